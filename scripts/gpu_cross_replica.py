"""Cross-replica FFN batching at decode sizes: the FFN time per layer for two attention replicas' items served together
against the time for one replica's (the target: <= 1.3x).

For one MoE layer of DeepSeek-V2-Lite (bf16, every expert on this GPU) and T rows per replica, the device time of
(a) one replica's item alone, (b) two replicas' items in one expert pass (`expert_pass` with both: what an FFN rank
does when they wait together), (c) the two items in two passes; each timed as the decode step runs it (many calls
in one CUDA graph, `afd.profiling.graph_timing.graph_ms`). One JSON line per T, then a summary line.
Run: python scripts/gpu_cross_replica.py [--tokens 1,8,32,64] > OUT.jsonl
"""

from __future__ import annotations

import argparse
import json

import torch

from afd.connectors.expert_pass import WorkRows, expert_pass
from afd.model.moe import select_experts
from afd.model.weights import load_ffn_model
from afd.profiling.graph_timing import graph_ms


def item(ffn, num_tokens: int, gen: torch.Generator) -> WorkRows:  # noqa: ANN001
    """T rows of one replica: random hidden states, routed as the model's gate would spread them (top-k of random
    logits), every row through the shared experts here (one FFN rank)."""
    config = ffn.config
    x = (torch.randn(num_tokens, config.hidden_size, generator=gen) * 0.1).to("cuda", torch.bfloat16)
    logits = torch.randn(num_tokens, config.n_routed_experts, generator=gen).cuda()
    routing = select_experts(logits, top_k=config.num_experts_per_tok)
    return WorkRows(x, routing.topk_ids.to(torch.int32), routing.topk_weights.float(), num_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="deepseek-v2-lite")
    parser.add_argument("--tokens", default="1,8,32,64", help="rows per replica, comma-separated")
    args = parser.parse_args()
    ffn = load_ffn_model(args.model, dtype="bfloat16", device="cuda")
    layer = next(i for i in range(ffn.config.num_hidden_layers) if ffn.config.is_moe_layer(i))
    gen = torch.Generator().manual_seed(0)
    worst = 0.0
    with torch.inference_mode():
        for num_tokens in (int(t) for t in args.tokens.split(",")):
            a, b = item(ffn, num_tokens, gen), item(ffn, num_tokens, gen)
            one = graph_ms(lambda a=a: expert_pass(ffn, layer, [a]))
            together = graph_ms(lambda a=a, b=b: expert_pass(ffn, layer, [a, b]))
            apart = graph_ms(lambda a=a, b=b: (expert_pass(ffn, layer, [a]), expert_pass(ffn, layer, [b])))
            worst = max(worst, together / one)
            row = {"rows_per_replica": num_tokens, "one_ms": one, "two_together_ms": together, "two_apart_ms": apart,
                   "together_over_one": together / one, "apart_over_one": apart / one}  # fmt: skip
            print(json.dumps(row), flush=True)
    summary = {"model": args.model, "layer": layer, "worst_together_over_one": worst, "target": 1.3}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
