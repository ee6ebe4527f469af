"""`afd demo`: the embedded end-to-end check — reference vs every connector on an uneven workload.

Prints one row per run (connector, topology, tokens/s, time to first token p50/p99, max |Δ logprob|
against the reference) and passes only if every run's greedy tokens equal the reference's and its
log-probabilities stay within the tolerance. The runs themselves are `afd.bench.harness`'s, shared with
`afd bench` and `afd bench serve`.
"""

from __future__ import annotations

import logging
import random

from afd.bench.harness import RunResult, max_logprob_diff, percentile, run_connector, run_reference
from afd.runtime.spec import RunSpec

log = logging.getLogger(__name__)

LOGPROB_TOLERANCE = 1e-4  # float32


DEMO_LENGTHS = [96, 3, 80, 2, 64, 5, 48, 4]  # prompt i -> replica i % 2: replica 0 long, replica 1 short


def uneven_prompts(vocab_size: int, *, seed: int = 0, lengths: list[int] = DEMO_LENGTHS) -> list[list[int]]:
    """Deliberately uneven: with 2 replicas, one gets every long prompt and the other every short one."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in lengths]


TABLE_FOOTER = """\
tok/s: generated tokens / engine time of the slowest replica (process start and model loading excluded).
TTFT: from a replica's first step to each request's first token. The reference is timed after an untimed
warm-up run; each connector run is one cold run of fresh processes. On a small CPU model the times are
milliseconds and swing between runs: compare the last column, not the speed."""


def format_table(reference: RunResult, runs: list[RunResult]) -> str:
    header = f"{'connector':<10} {'topology':<9} {'tok/s':>8} {'TTFT p50':>10} {'TTFT p99':>10} {'max |Δ logprob|':>16}"
    lines = [header, "-" * len(header)]
    for run in [reference, *runs]:
        diff = 0.0 if run is reference else max_logprob_diff(reference.outputs, run.outputs)
        lines.append(
            f"{run.connector:<10} {run.topology:<9} {run.tokens_per_s:>8.1f} "
            f"{percentile(run.ttft_s, 50) * 1e3:>8.1f}ms {percentile(run.ttft_s, 99) * 1e3:>8.1f}ms {diff:>16.2e}"
        )
    lines += ["-" * len(header), TABLE_FOOTER]
    return "\n".join(lines)


CONNECTORS = ("p2p", "async")


def run_demo(
    *,
    model: str = "tiny",
    num_attn: int = 2,
    num_ffn: int = 2,
    max_new_tokens: int = 8,
    device: str = "cpu",
    connectors: tuple[str, ...] = CONNECTORS,
    progress=None,
) -> tuple[RunResult, list[RunResult], bool]:
    """Reference, then every connector on the same uneven prompts; True if every output matches."""
    from afd.model.weights import load_model_config

    say = progress or (lambda msg: log.info(msg))
    prompts = uneven_prompts(load_model_config(model).vocab_size)
    lengths = ", ".join(str(len(p)) for p in prompts)
    say(f"on {device}: {len(prompts)} prompts of {lengths} tokens, {max_new_tokens} new tokens each, model {model!r}")
    say("running the single-process reference (once to warm up, once timed) ...")
    spec = RunSpec(model=model, device=device, max_new_tokens=max_new_tokens, prompt_logprobs=True, timeout_s=300)
    run_reference(spec, prompts)  # a cold first run pays one-time costs (allocator, kernels): its tok/s swung 14-311
    reference = run_reference(spec, prompts)
    runs, ok = [], True
    for connector in connectors:
        say(f"running {connector} {num_attn}A{num_ffn}F (one process per rank) ...")
        run = run_connector(connector, num_attn, num_ffn, spec, prompts)
        diff = max_logprob_diff(reference.outputs, run.outputs)
        matched = diff <= LOGPROB_TOLERANCE
        ok &= matched
        say(
            f"  {connector}: {'matches the reference' if matched else 'DIFFERS from the reference'} "
            f"(max |Δ logprob| {diff:.2e})"
        )
        runs.append(run)
    return reference, runs, ok
