"""`afd bench serve --overhead`: what the HTTP front end adds to time to first token over the engine alone.

The same requests (prompts, token counts, arrival times) go once through `afd serve --connector none
--replicas 1` — HTTP, router, the link to the replica process, server-sent events, timed by the client —
and once straight into one whole-model replica engine built the same way in this process
(`afd.runtime.harness.replica_engine` / `drive_arrivals`), timed from each request's arrival to the step
that made its first token. The server runs first and is stopped before the engine loads, so on CUDA the
two never share the GPU. Per rate: p50 TTFT of each, their difference, and the median of the per-request
differences (the requests are the same, so they pair up).
"""

from __future__ import annotations

import time

from afd.engine import Request
from afd.runtime.launch import RunSpec
from afd.serve.bench import (
    WARM_UP_PROMPT,
    WARM_UP_TOKENS,
    RequestResult,
    bench_servers,
    format_rate,
    percentile,
    run_rates,
    run_record,
)
from afd.serve.progress import Progress
from afd.serve.workload import Workload

ENGINE_ALONE = "engine alone"
SERVER = ("none R=1", ["--connector", "none", "--replicas", "1"])


def bench_engine(
    spec: RunSpec, workload: Workload, rates: list[float], progress: Progress, *, vocab_size: int, timeout_s: float
) -> dict:
    """The workload at each rate straight into one in-process replica engine (after one untimed warm-up request,
    as the server gets); the same result shape as one server config of `bench_servers`."""
    from afd.runtime.harness import drive_arrivals, release_device_memory, replica_engine

    progress.note(f"{ENGINE_ALONE}: loading one replica engine in this process ...")
    prompts, max_tokens = workload.prompts(vocab_size), workload.max_tokens_of()
    engine = replica_engine(spec)
    try:
        drive_arrivals(engine, [Request(list(WARM_UP_PROMPT), WARM_UP_TOKENS)], [0.0], timeout_s)
        runs = []
        for rate in run_rates(workload, rates):
            arrivals = workload.arrivals(rate)
            requests = [Request(list(p), n) for p, n in zip(prompts, max_tokens, strict=True)]
            progress.start(f"{ENGINE_ALONE}: rate {format_rate(rate)}", len(requests))
            try:
                start = time.perf_counter()
                times = drive_arrivals(engine, requests, arrivals, timeout_s + max(arrivals), progress.advance)
                wall = time.perf_counter() - start
            finally:
                progress.finish()
            results = [RequestResult.from_token_times(len(p), t) for p, t in zip(prompts, times, strict=True)]
            runs.append(run_record(rate, results, wall))
    finally:
        del engine
        release_device_memory(spec.device)
    return {"name": ENGINE_ALONE, "runs": runs}


def bench_overhead(
    argv: list[str],
    spec: RunSpec,
    workload: Workload,
    rates: list[float],
    progress: Progress,
    *,
    vocab_size: int,
    timeout_s: float,
) -> list[dict]:
    """The server (`afd serve argv --connector none --replicas 1`), then the engine alone (`spec`: the same
    flags), on the same requests."""
    common = dict(vocab_size=vocab_size, timeout_s=timeout_s)
    served = bench_servers([SERVER], argv, workload, rates, progress, **common)
    return [*served, bench_engine(spec, workload, rates, progress, **common)]


def front_end_overhead(server: dict, engine: dict) -> list[dict]:
    """Per rate: p50 TTFT through the server and of the engine alone, what the front end adds to the p50, and
    the median over requests of (server TTFT - engine TTFT)."""
    rows = []
    for s_run, e_run in zip(server["runs"], engine["runs"], strict=True):
        pairs = [
            (s["ttft_s"], e["ttft_s"])
            for s, e in zip(s_run["requests"], e_run["requests"], strict=True)
            if s["ttft_s"] is not None and e["ttft_s"] is not None
        ]
        s_p50, e_p50 = s_run["summary"]["ttft_p50_s"], e_run["summary"]["ttft_p50_s"]
        rows.append(
            {
                "rate": s_run["rate"],
                "requests": len(pairs),
                "server_ttft_p50_s": s_p50,
                "engine_ttft_p50_s": e_p50,
                "added_p50_s": s_p50 - e_p50 if s_p50 is not None and e_p50 is not None else None,
                "paired_median_s": percentile([a - b for a, b in pairs], 50),
            }
        )
    return rows


def format_overhead(rows: list[dict]) -> str:
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1e3:.2f} ms"

    lines = ["front end over the engine alone (same requests, same arrival times):"]
    for r in rows:
        lines.append(
            f"  rate {format_rate(r['rate'])}: TTFT p50 {ms(r['server_ttft_p50_s'])} through HTTP vs "
            f"{ms(r['engine_ttft_p50_s'])} engine alone: the front end adds {ms(r['added_p50_s'])} to the p50 "
            f"(median per-request difference {ms(r['paired_median_s'])}, {r['requests']} requests)"
        )
    return "\n".join(lines)
