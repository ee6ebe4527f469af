"""`afd demo`: the embedded end-to-end check — reference vs every connector on an uneven workload.

Prints one row per run (connector, topology, tokens/s, time to first token p50/p99, max |Δ logprob|
against the reference) and passes only if every run's greedy tokens equal the reference's and its
log-probabilities stay within the tolerance.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field

from afd.config import parse_config
from afd.engine import Output
from afd.runtime.launch import RunSpec

log = logging.getLogger(__name__)

LOGPROB_TOLERANCE = 1e-4  # float32


DEMO_LENGTHS = [96, 3, 80, 2, 64, 5, 48, 4]  # prompt i -> replica i % 2: replica 0 long, replica 1 short


def uneven_prompts(vocab_size: int, *, seed: int = 0, lengths: list[int] = DEMO_LENGTHS) -> list[list[int]]:
    """Deliberately uneven: with 2 replicas, one gets every long prompt and the other every short one."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in lengths]


@dataclass
class RunResult:
    connector: str
    topology: str
    outputs: list[Output]
    elapsed_s: float
    ttft_s: list[float]
    replicas: list[dict] = field(default_factory=list)

    @property
    def generated_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def max_logprob_diff(reference: list[Output], outputs: list[Output]) -> float:
    """Largest |Δ| over generated and prompt log-probabilities; inf if the greedy tokens differ."""
    worst = 0.0
    for ref, out in zip(reference, outputs, strict=True):
        if ref.token_ids != out.token_ids:
            return float("inf")
        pairs = list(zip(ref.logprobs, out.logprobs, strict=True))
        if ref.prompt_logprobs is not None and out.prompt_logprobs is not None:
            pairs += [(a, b) for a, b in zip(ref.prompt_logprobs, out.prompt_logprobs, strict=True) if a is not None]
        worst = max([worst, *(abs(a - b) for a, b in pairs)])
    return worst


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


def run_reference(spec: RunSpec, prompts: list[list[int]]) -> RunResult:
    """The single-process engine, timed the same way as a replica. On CUDA its KV pool takes most of the
    GPU (`gpu_memory_utilization`): everything is handed back before the launched ranks need the GPUs."""
    try:
        return _run_reference(spec, prompts)
    finally:
        release_device_memory(spec.device)


def release_device_memory(device: str) -> None:
    """Return this process's cached GPU memory to the driver (the reference engine is gone by now)."""
    if device == "cuda":
        import gc

        import torch

        gc.collect()  # graphs and cache tensors may sit in reference cycles
        torch.cuda.empty_cache()


def _run_reference(spec: RunSpec, prompts: list[list[int]]) -> RunResult:
    from afd.engine import Engine, LocalExchange
    from afd.runtime.worker import RankJob, drive_replica
    from afd.weights import load_attention_model, load_ffn_model

    load = dict(dtype=spec.dtype, device=spec.device, seed=spec.seed)
    attn, ffn = load_attention_model(spec.model, **load), load_ffn_model(spec.model, **load)
    budget = max(spec.max_num_batched_tokens, *map(len, prompts))
    engine = Engine(attn, LocalExchange(ffn), budget, **spec.cache.engine_kwargs())
    job = RankJob(
        config=parse_config({}),
        role="attention",
        role_rank=0,
        spec=spec,
        prompts=tuple(map(tuple, prompts)),
    )
    outputs, stats = drive_replica(engine, job, lambda has_work: has_work)
    return RunResult("none", "1 proc", outputs, stats.end - stats.start, stats.to_json()["ttft_s"], [stats.to_json()])


def run_connector(connector: str, num_attn: int, num_ffn: int, spec: RunSpec, prompts: list[list[int]]) -> RunResult:
    """One launched run; elapsed is the slowest replica's engine time (process start and loading excluded)."""
    from afd.runtime.launch import free_port, launch

    config = parse_config(
        {"connector": connector, "num_attention_ranks": num_attn, "num_ffn_ranks": num_ffn, "port": free_port()}
    )
    outputs, stats = launch(config, spec, prompts)
    replicas = stats["replicas"]
    elapsed = max((r["elapsed_s"] for r in replicas if r), default=0.0)
    ttft = [t for r in replicas for t in r.get("ttft_s", [])]
    return RunResult(connector, f"{num_attn}A{num_ffn}F", outputs, elapsed, ttft, replicas)


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
    from afd.weights import load_model_config

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
