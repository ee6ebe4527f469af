"""`afd bench`: connectors side by side on an uneven request mix, and numerics against the reference.

Throughput: replica 0 gets long prompts, every other replica short ones, so a synchronous DP wave
makes the short replicas wait on the long one while `async` lets them run ahead. All runs of one
bench use the same prompts, the same model and the same machine, so their ratios are meaningful.

Numerics: every run scores the same sequences (prompt + the reference's greedy continuation) and
the per-position probabilities are compared with the single-process reference, as the issue asks.
"""

from __future__ import annotations

import datetime
import logging
import math
import platform
import random
from dataclasses import asdict, dataclass

from afd.bench.harness import RunResult, percentile, run_connector, run_reference
from afd.config import default_shared_experts, ubatch_keys
from afd.runtime.spec import RunSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Workload:
    """Replica 0: `requests` prompts of `long_len` tokens; every other replica: `requests` of `short_len`."""

    requests: int = 8
    long_len: int = 1024
    short_len: int = 32
    max_new_tokens: int = 32
    seed: int = 0

    def prompts(self, vocab_size: int, num_attn: int) -> list[list[int]]:
        """Prompt i goes to replica i % A, so position decides which replica gets a long prompt."""
        rng = random.Random(self.seed)
        out = []
        for i in range(self.requests * num_attn):
            n = self.long_len if i % num_attn == 0 else self.short_len
            out.append([rng.randrange(vocab_size) for _ in range(n)])
        return out


def run_summary(run: RunResult) -> dict:
    replicas = [
        {
            "elapsed_s": r.get("elapsed_s"),
            "num_steps": r.get("num_steps"),
            "ttft_p50_s": percentile(r.get("ttft_s", []), 50),
            "decode_step_p50_ms": percentile(r.get("decode_steps_ms", []), 50),
            "decode_steps": len(r.get("decode_steps_ms", [])),
        }
        for r in run.replicas
    ]
    return {
        "connector": run.connector,
        "topology": run.topology,
        "generated_tokens": run.generated_tokens,
        "elapsed_s": run.elapsed_s,
        "tokens_per_s": run.tokens_per_s,
        "ttft_p50_s": percentile(run.ttft_s, 50),
        "ttft_p99_s": percentile(run.ttft_s, 99),
        # the median wall time of an all-decode step (launch to tokens), over every replica's such steps
        "decode_step_p50_ms": percentile([t for r in run.replicas for t in r.get("decode_steps_ms", [])], 50),
        "replicas": replicas,
    }


def probability_diff(reference: RunResult, run: RunResult) -> dict:
    """Mean and max |p_run - p_ref| over every scored position (prompt logprobs of identical sequences)."""
    diffs = []
    for ref, out in zip(reference.outputs, run.outputs, strict=True):
        for a, b in zip(ref.prompt_logprobs[1:], out.prompt_logprobs[1:], strict=True):
            diffs.append(abs(math.exp(a) - math.exp(b)))
    return {
        "positions": len(diffs),
        "mean_abs_dprob": sum(diffs) / len(diffs) if diffs else 0.0,
        "max_abs_dprob": max(diffs, default=0.0),
    }


def device_name(device: str) -> str:
    if device == "cuda":
        import torch

        return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    return f"cpu ({platform.processor() or platform.machine()})"


def run_bench(
    *,
    model: str,
    dtype: str,
    device: str,
    num_attn: int,
    num_ffn: int,
    connectors: tuple[str, ...],
    workload: Workload,
    score: bool = True,
    ubatches: tuple[int, ...] = (1,),
    max_num_batched_tokens: int | None = None,
    repeat: int = 1,
    shared_experts: tuple[str, ...] | None = None,
    quantization: str | None = None,
    progress=None,
) -> dict:
    """Each connector once per micro-batch count in `ubatches` (1: off) and per place of the shared experts in
    `shared_experts` ("ffn", "attention": async only, skipped for the others; None: each connector's command-line
    default, `config.default_shared_experts`); `max_num_batched_tokens` is the
    engines' token budget per step (None: max(2048, 2 x the long prompt)).

    `repeat` > 1: every configuration is launched that many times, in rounds (each round launches every
    configuration once, so drift over the run spreads evenly); a run's row is its median launch by elapsed time, and
    `launches_elapsed_s` keeps them all. Why: one launch of a short workload (a single prefill step) varied by ±20%
    on the GPU, more than the effects it was run to measure."""
    from afd.model.weights import load_model_config

    say = progress or log.info
    vocab = load_model_config(model).vocab_size
    prompts = workload.prompts(vocab, num_attn)
    budget = max_num_batched_tokens or max(2048, workload.long_len * 2)
    spec = RunSpec(
        model=model,
        dtype=dtype,
        quantization=quantization,
        device=device,
        max_new_tokens=workload.max_new_tokens,
        max_num_batched_tokens=budget,
        timeout_s=900,
    )
    result: dict = {
        "date": datetime.date.today().isoformat(),
        "device": device_name(device),
        "model": model,
        "dtype": dtype,
        "quantization": quantization,
        "topology": f"{num_attn}A{num_ffn}F",
        "workload": asdict(workload),
        "max_num_batched_tokens": budget,
        "runs": [],
    }
    runs = list(
        dict.fromkeys(
            (c, m, where)
            for c in connectors
            for where in shared_experts or (default_shared_experts(c),)
            if where == "ffn" or c == "async"
            for m in ubatches
        )
    )
    launches: dict[tuple[str, int, str], list[dict]] = {run: [] for run in runs}
    for round_ in range(repeat):
        for connector, m, where in runs:
            label = run_label(connector, m, where)
            say(f"throughput: {label} {num_attn}A{num_ffn}F{repeat_label(round_, repeat)} ...")
            run = run_connector(
                connector, num_attn, num_ffn, spec, prompts, extra_config=run_config(connector, m, where)
            )
            launches[(connector, m, where)].append(run_summary(run))
    for (_, m, where), summaries in launches.items():
        row = median_launch(summaries)
        if repeat > 1:
            row["launches_elapsed_s"] = [s["elapsed_s"] for s in summaries]
        result["runs"].append({**row, "ubatches": m, "shared_experts": where})
    result["repeat"] = repeat
    if score:
        say("numerics: single-process reference ...")
        reference = run_reference(spec, prompts)
        scored = [p + o.token_ids for p, o in zip(prompts, reference.outputs, strict=True)]
        score_spec = RunSpec(
            model=model,
            dtype=dtype,
            quantization=quantization,
            device=device,
            max_new_tokens=1,
            prompt_logprobs=True,
            max_num_batched_tokens=budget + workload.max_new_tokens,
            timeout_s=900,
        )
        ref_scores = run_reference(score_spec, scored)
        result["numerics"] = {}
        for connector, m, where in runs:
            label = run_label(connector, m, where)
            say(f"numerics: {label} scoring the reference's sequences ...")
            run = run_connector(
                connector, num_attn, num_ffn, score_spec, scored, extra_config=run_config(connector, m, where)
            )
            result["numerics"][label] = probability_diff(ref_scores, run)
    return result


def repeat_label(round_: int, repeat: int) -> str:
    return f" (launch {round_ + 1} of {repeat})" if repeat > 1 else ""


def median_launch(summaries: list[dict]) -> dict:
    """The launch with the median elapsed time (the lower middle one of an even count): a real run, not a blend."""
    ordered = sorted(summaries, key=lambda s: s["elapsed_s"])
    return dict(ordered[(len(ordered) - 1) // 2])


def ubatch_gains(runs: list[dict]) -> list[str]:
    """How much shorter each run's elapsed time is with m > 1 than without micro-batches, and with the shared
    experts on the attention rank than on the FFN ranks (the same connector and micro-batch count otherwise)."""
    elapsed = {(r["connector"], r.get("ubatches", 1), r.get("shared_experts", "ffn")): r["elapsed_s"] for r in runs}
    lines = []
    for (connector, m, where), t in elapsed.items():
        label = run_label(connector, m, where)
        for base_key, versus in (
            ((connector, 1, where), "without micro-batches"),
            ((connector, m, "ffn"), "with the shared experts on the FFN ranks"),
        ):
            base = elapsed.get(base_key)
            if base_key != (connector, m, where) and base:
                change = 1 - t / base
                lines.append(
                    f"{label}: elapsed {t:.3f} s vs {base:.3f} s {versus} ({change:+.1%} "
                    f"{'faster' if change >= 0 else 'slower'})"
                )
    return lines


def run_config(connector: str, num_ubatches: int, shared_experts: str = "ffn") -> dict:
    """`connector_extra_config` of one bench run: micro-batches, and (async) where the shared experts run."""
    extra = ubatch_keys(connector, num_ubatches)
    return extra | {"shared_experts_on_attention": shared_experts == "attention"} if connector == "async" else extra


def run_label(connector: str, num_ubatches: int, shared_experts: str = "ffn") -> str:
    name = connector + ("+sa" if shared_experts == "attention" else "")  # sa: shared experts on the attention rank
    return name if num_ubatches == 1 else f"{name} m={num_ubatches}"


def format_bench(result: dict) -> str:
    labels = [run_label(r["connector"], r.get("ubatches", 1), r.get("shared_experts", "ffn")) for r in result["runs"]]
    width = max([10, *map(len, labels)])
    lines = [
        f"{result['model']} {result['dtype']} on {result['device']}, {result['topology']}",
        f"workload {result['workload']}",
        f"{'connector':<{width}} {'tok/s':>9} {'TTFT p50':>10} {'TTFT p99':>10} {'decode step p50':>16}  "
        "per-replica elapsed (s)",
    ]
    repeat = result.get("repeat", 1)
    if repeat > 1:
        lines.insert(2, f"each row: the median of {repeat} launches by elapsed time (all of them: launches_elapsed_s)")
    for run, label in zip(result["runs"], labels, strict=True):
        per = " / ".join(f"{r['elapsed_s']:.2f}" for r in run["replicas"])
        step = run.get("decode_step_p50_ms")
        no_step = step is None or math.isnan(step)  # no all-decode step was timed (one new token)
        step_text = "-" if no_step else f"{step:.2f}ms"
        lines.append(
            f"{label:<{width}} {run['tokens_per_s']:>9.1f} {run['ttft_p50_s'] * 1e3:>8.1f}ms "
            f"{run['ttft_p99_s'] * 1e3:>8.1f}ms {step_text:>16}  {per}"
        )
    lines += ubatch_gains(result["runs"])
    for connector, n in result.get("numerics", {}).items():
        lines.append(
            f"numerics {connector}: {n['positions']} positions, mean |Δp| {n['mean_abs_dprob']:.2e}, "
            f"max |Δp| {n['max_abs_dprob']:.2e}"
        )
    return "\n".join(lines)
