"""The requests of `afd bench serve`: seeded prompt shapes and Poisson arrivals, or a JSONL trace.

Every rate of one bench sends the same requests (the prompts do not depend on the rate) and the same
exponential draws, scaled by the rate, as arrival gaps: runs at different rates differ only in load.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

WORKLOADS = ("uniform", "uneven", "mixed")
MIXED_SIGMA = 1.0  # lognormal prompt lengths: a long tail, as production prefill traffic has
TRACE_KEYS = ("prompt_len", "max_tokens", "arrival_s")
MAX_TRACE_BYTES = 64 << 20


class TraceError(ValueError):
    """A trace file that cannot be used, in one sentence naming the file and line."""


@dataclass(frozen=True)
class TraceEntry:
    """One line of a trace: a prompt of `prompt_len` tokens that asks for `max_tokens`, sent `arrival_s` seconds
    after the start (None: Poisson arrivals at the bench's rates)."""

    prompt_len: int
    max_tokens: int
    arrival_s: float | None = None


def load_trace(path: str | Path) -> tuple[TraceEntry, ...]:
    """The entries of a JSONL trace (`{"prompt_len", "max_tokens", "arrival_s"?}` per line; blank lines skipped).
    Every line has `arrival_s` or none does."""
    path = Path(path)
    try:
        if path.stat().st_size > MAX_TRACE_BYTES:
            raise TraceError(f"trace {path} is larger than {MAX_TRACE_BYTES >> 20} MiB")
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"cannot read trace {path}: {getattr(exc, 'strerror', None) or exc}") from None
    entries = [_entry(line, f"trace {path} line {n}") for n, line in enumerate(lines, 1) if line.strip()]
    if not entries:
        raise TraceError(f"trace {path} has no requests")
    if len({e.arrival_s is None for e in entries}) > 1:
        raise TraceError(f"trace {path}: either every line has arrival_s or none does")
    return tuple(entries)


def _entry(line: str, where: str) -> TraceEntry:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where} is not JSON ({exc.msg})") from None
    if not isinstance(obj, dict) or not set(obj) <= set(TRACE_KEYS) or not {"prompt_len", "max_tokens"} <= set(obj):
        raise TraceError(f"{where} must be an object with prompt_len, max_tokens and optionally arrival_s")
    for key in ("prompt_len", "max_tokens"):
        value = obj[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise TraceError(f"{where}: {key} must be a positive integer, got {value!r}")
    arrival = obj.get("arrival_s")
    if arrival is not None and (
        not isinstance(arrival, int | float) or isinstance(arrival, bool) or not 0 <= arrival < math.inf
    ):
        raise TraceError(f"{where}: arrival_s must be a non-negative number of seconds, got {arrival!r}")
    return TraceEntry(obj["prompt_len"], obj["max_tokens"], None if arrival is None else float(arrival))


@dataclass(frozen=True)
class Workload:
    """`uniform`: prompt lengths uniform in [`short_len`, `long_len`] (equal for one fixed length). `uneven`: each
    prompt is `long_len` with probability `long_fraction`, else `short_len`. `mixed`: lognormal lengths with median
    `short_len`, capped at `long_len`. `trace`: the lengths and token counts of `trace` (its arrival times too,
    when it has them); `requests` and the lengths are then unused."""

    kind: str = "uneven"
    requests: int = 64
    long_len: int = 1024
    short_len: int = 32
    long_fraction: float = 0.25
    max_tokens: int = 64
    seed: int = 0
    trace: tuple[TraceEntry, ...] = ()
    warmups: int = 0  # untimed: the first `warmups` requests, sent at once before the timed runs

    def warm_up_requests(self, vocab_size: int) -> list[tuple[list[int], int]]:
        """(prompt, max_tokens) of the untimed warm-up: the workload's first requests, so that the shapes a server
        compiles kernels and captures graphs for on first sight are seen before the clock runs."""
        count = min(self.warmups, self.num_requests)
        return list(zip(self.prompts(vocab_size)[:count], self.max_tokens_of()[:count], strict=True))

    @property
    def num_requests(self) -> int:
        return len(self.trace) if self.kind == "trace" else self.requests

    @property
    def timed(self) -> bool:
        """A trace with its own arrival times: one run, at the trace's pace, whatever the rates."""
        return self.kind == "trace" and self.trace[0].arrival_s is not None

    def max_tokens_of(self) -> list[int]:
        """Tokens each request asks for."""
        if self.kind == "trace":
            return [e.max_tokens for e in self.trace]
        return [self.max_tokens] * self.requests

    def prompts(self, vocab_size: int) -> list[list[int]]:
        """Seeded random token ids of each request's length."""
        rng = random.Random(self.seed)
        out = []
        for i in range(self.num_requests):
            if self.kind == "trace":
                n = self.trace[i].prompt_len
            elif self.kind == "mixed":
                n = min(self.long_len, max(1, round(rng.lognormvariate(math.log(self.short_len), MIXED_SIGMA))))
            elif self.kind == "uniform":
                n = rng.randint(min(self.short_len, self.long_len), max(self.short_len, self.long_len))
            else:
                n = self.long_len if rng.random() < self.long_fraction else self.short_len
            out.append([rng.randrange(vocab_size) for _ in range(n)])
        return out

    def arrivals(self, rate: float) -> list[float]:
        """Seconds from the start: the trace's own times, else Poisson arrivals at `rate` requests/s (inf: all at
        once)."""
        if self.timed:
            return [e.arrival_s for e in self.trace]
        if math.isinf(rate):
            return [0.0] * self.num_requests
        rng, t, out = random.Random(self.seed + 1), 0.0, []
        for _ in range(self.num_requests):
            out.append(t)
            t += rng.expovariate(rate)
        return out

    def mean_rate(self) -> float:
        """A timed trace's requests per second over its span (inf when every request arrives at once)."""
        times = self.arrivals(math.inf)
        span = max(times) - min(times)
        return (len(times) - 1) / span if span > 0 else math.inf

    def describe(self) -> dict:
        """The workload for the raw JSON (a trace by its size, not its lines)."""
        if self.kind == "trace":
            return {"kind": "trace", "requests": len(self.trace), "timed": self.timed, "seed": self.seed,
                    "warmups": self.warmups}  # fmt: skip
        return {k: v for k, v in vars(self).items() if k != "trace"}
