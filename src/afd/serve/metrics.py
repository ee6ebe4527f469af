"""`GET /metrics`: the server's counters and histograms in the Prometheus text format (version 0.0.4).

Written by hand rather than through `prometheus_client`: a handful of gauges, counters and histograms,
all labelled by `replica`, do not justify a dependency the GPU image would have to carry. Everything is
touched from the event loop's thread only, so nothing here takes a lock.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets: TTFT from 1 ms to 2.5 min, inter-token latency from 10 ms to 80 s (plus finer low ones)
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)
ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
)


@dataclass
class Histogram:
    """Cumulative buckets as Prometheus reads them (`le` = less than or equal), plus sum and count."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.buckets, value)  # first bucket whose bound is >= value
        if i < len(self.counts):
            self.counts[i] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out, running = [], 0
        for bound, n in zip(self.buckets, self.counts, strict=True):
            running += n
            out.append(f'{name}_bucket{{{labels},le="{_number(bound)}"}} {running}')
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {self.count}')
        out.append(f"{name}_sum{{{labels}}} {_number(self.total)}")
        out.append(f"{name}_count{{{labels}}} {self.count}")
        return out


@dataclass
class ReplicaMetrics:
    """One replica's numbers: what it reported (`load` messages) and what the front end measured."""

    running: int = 0
    waiting: int = 0
    cache_usage: float = 0.0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # finish reason -> requests
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    engine_ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))


# name, type, help, how to read it from one replica
_GAUGES = (
    ("afd_num_requests_running", "gauge", "Requests in the replica's running batch.", lambda m: m.running),
    ("afd_num_requests_waiting", "gauge", "Requests queued in the replica, not yet admitted.", lambda m: m.waiting),
    (
        "afd_kv_cache_usage_perc",
        "gauge",
        "Fraction of the replica's KV-cache blocks in use (0..1).",
        lambda m: m.cache_usage,
    ),
    (
        "afd_prompt_tokens_total",
        "counter",
        "Prompt tokens of the requests sent to the replica.",
        lambda m: m.prompt_tokens,
    ),
    ("afd_generation_tokens_total", "counter", "Tokens the replica generated.", lambda m: m.generation_tokens),
)
_HISTOGRAMS = (
    ("afd_time_to_first_token_seconds", "Time from a request's arrival to its first token.", lambda m: m.ttft),
    (
        "afd_engine_time_to_first_token_seconds",
        "Time from a request reaching its replica to the end of the step that made its first token.",
        lambda m: m.engine_ttft,
    ),
    ("afd_inter_token_latency_seconds", "Time between two tokens of one request.", lambda m: m.itl),
    ("afd_e2e_request_latency_seconds", "Time from a request's arrival to its end.", lambda m: m.e2e),
)


def render(replicas: list[ReplicaMetrics], *, healthy: bool, front_waiting: int) -> str:
    """The whole `/metrics` page."""
    lines = [
        "# HELP afd_healthy 1 while every rank of the server is alive, else 0.",
        "# TYPE afd_healthy gauge",
        f"afd_healthy {int(healthy)}",
        "# HELP afd_front_end_waiting Requests the front end holds beyond the replicas' running capacity.",
        "# TYPE afd_front_end_waiting gauge",
        f"afd_front_end_waiting {front_waiting}",
    ]
    for name, kind, text, read in _GAUGES:
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
        lines += [f'{name}{{replica="{i}"}} {_number(read(m))}' for i, m in enumerate(replicas)]
    name = "afd_request_success_total"
    lines += [f"# HELP {name} Requests that ended, by finish reason.", f"# TYPE {name} counter"]
    for i, m in enumerate(replicas):
        lines += [f'{name}{{replica="{i}",finished_reason="{r}"}} {n}' for r, n in sorted(m.finished.items())]
    for name, text, read in _HISTOGRAMS:
        lines += [f"# HELP {name} {text}", f"# TYPE {name} histogram"]
        for i, m in enumerate(replicas):
            lines += read(m).lines(name, f'replica="{i}"')
    return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    """Prometheus number syntax: integers without a decimal point, `+Inf`, `NaN`."""
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))
