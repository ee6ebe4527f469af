"""`afd demo`: the embedded end-to-end check — reference vs every connector on an uneven workload.

Prints one row per run (connector, topology, tokens/s, time to first token p50/p99, max |Δ logprob|
against the reference) and passes only if every run's greedy tokens equal the reference's and its
log-probabilities stay within the tolerance.
"""

from __future__ import annotations

import logging
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from afd.engine import Output

log = logging.getLogger(__name__)

LOGPROB_TOLERANCE = 1e-4  # float32


def uneven_prompts(vocab_size: int, *, seed: int = 0, count: int = 8) -> list[list[int]]:
    """Deliberately uneven: a few long prompts among many short ones, so replicas get different loads."""
    rng = random.Random(seed)
    lengths = [96, 3, 5, 64, 2, 7, 4, 48][:count] + [rng.randint(2, 12) for _ in range(max(0, count - 8))]
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in lengths]


@dataclass
class RunResult:
    connector: str
    topology: str
    outputs: list[Output]
    elapsed_s: float
    ttft_s: list[float]

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


def format_table(reference: RunResult, runs: list[RunResult]) -> str:
    header = f"{'connector':<10} {'topology':<9} {'tok/s':>8} {'TTFT p50':>10} {'TTFT p99':>10} {'max |Δ logprob|':>16}"
    lines = [header, "-" * len(header)]
    for run in [reference, *runs]:
        diff = 0.0 if run is reference else max_logprob_diff(reference.outputs, run.outputs)
        lines.append(
            f"{run.connector:<10} {run.topology:<9} {run.tokens_per_s:>8.1f} "
            f"{percentile(run.ttft_s, 50) * 1e3:>8.1f}ms {percentile(run.ttft_s, 99) * 1e3:>8.1f}ms {diff:>16.2e}"
        )
    return "\n".join(lines)


def timed(fn: Callable[[], tuple[list[Output], list[float]]]) -> tuple[list[Output], list[float], float]:
    start = time.perf_counter()
    outputs, ttft = fn()
    return outputs, ttft, time.perf_counter() - start


def summarize_ttft(stats: dict) -> list[float]:
    return [t for replica in stats.get("replicas", []) for t in replica.get("ttft_s", [])]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")
