"""What the planner's cost model predicts for the decode steps an `afd bench step --json` result measured, beside them:
how far a profile carries to other shapes and weight formats (V2-Lite's fits priced at DeepSeek-V3's layers, bf16's
at fp8's bytes), the assumption every `afd plan` past one machine rests on.

    python3 scripts/predict_step.py STEP.json --model deepseek-v3 --layers 4 --dense-layers 1 [--profile h200]

STEP.json: `afd bench step --json` (with `--quantization`, its bf16 baseline is compared too), here the output of
`scripts/model_slice.py`, whose slice `--model/--layers/--dense-layers` name again. The step is `none` R=1's:
the attention side, every MoE layer's routed and shared experts at the graph's rows, the engine's host cost per
step (no serving costs: the bench streams nothing). Prints measured ms (decode: CUDA-graph steps), predicted ms
and the error per decode and prefill row.
"""

from __future__ import annotations

import argparse
import json
import sys

from model_slice import slice_preset

from afd.model.config import ModelConfig
from afd.model.presets import PRESETS
from afd.planning.costs import chunk_pairs, shapes_of
from afd.planning.deployment import Deployment, StepCosts, StepLoad
from afd.planning.profile import default_profile, load_profile


def predicted_ms(costs: StepCosts, batch: int, context: int, prefill: bool) -> float:
    """`none` R=1's step in ms: `batch` decode rows over `context` cached tokens each, or (`prefill`) `batch` whole
    prompts of `context` tokens."""
    if prefill:
        pairs = batch * chunk_pairs(0, context)
        load = StepLoad(batch=0, ctx=0.0, prefill=batch * context, pairs=pairs, seqs=batch)
    else:
        load = StepLoad(batch=batch, ctx=float(batch * context), prefill=0, pairs=0.0, seqs=batch)
    return costs.replica_step(load) * 1e3


def rows(result: dict, config: ModelConfig, model: str, profile_name: str | None) -> list[tuple]:
    """(weights, step, batch, context, measured ms, predicted ms, profile) of each decode (graph ms) and prefill row
    of `result`, priced by `profile_name` or, without one, by the profile `afd plan --model MODEL --weights W` takes
    for the result's weight format."""
    weights = "fp8" if result.get("fp8_weights") else result["dtype"]
    profile_name = profile_name or default_profile(model, weights)
    profile = load_profile(profile_name)
    costs = StepCosts(Deployment("none"), shapes_of(config, weights), profile)
    found = []
    for step, measured in (("decode", "graph_ms"), ("prefill", "ms")):
        for r in result.get(step) or []:
            if r.get(measured) is not None:
                predicted = predicted_ms(costs, r["batch"], r["context"], step == "prefill")
                found.append((weights, step, r["batch"], r["context"], r[measured], predicted, profile_name))
    return found


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("step_json")
    p.add_argument("--model", default="deepseek-v3", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int, help="the slice's decoder layers (default: the whole model)")
    p.add_argument("--dense-layers", type=int, default=1, help="of them, dense MLP layers")
    p.add_argument(
        "--profile", help="a profile JSON or a shipped one's name (default: afd plan's for --model and each format)"
    )
    args = p.parse_args()
    name = slice_preset(args.model, args.layers, args.dense_layers) if args.layers else args.model
    config = ModelConfig.from_hf(PRESETS[name])
    with open(args.step_json) as f:
        result = json.load(f)
    found = rows(result["baseline"], config, args.model, args.profile) if "baseline" in result else []
    found += rows(result, config, args.model, args.profile)
    print(f"{name}: step ms measured / predicted by the cost model (error), profile")
    for weights, step, batch, context, measured, predicted, profile in found:
        error = (predicted - measured) / measured
        print(
            f"  {weights:9} {step:7} batch {batch:4} context {context:5}: {measured:7.2f} / {predicted:7.2f} "
            f"({error:+.1%})  {profile}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
