"""`afd bench serve --overhead`: what the HTTP front end adds to time to first token over the engine alone.

The same requests (prompts, token counts, arrival times) go once through `afd serve --connector none
--replicas 1` — HTTP, router, the link to the replica process, server-sent events, timed by the client —
and once straight into one whole-model replica engine built the same way, in a process of its own as the
server's replica is (`afd.bench.harness.replica_engine` / `drive_arrivals`), timed from each request's
arrival to the step that made its first token. The server runs first and is stopped before the engine loads,
so on CUDA the two never share the GPU. Per rate: p50 TTFT of each, their difference, and the median of the per-request
differences (the requests are the same, so they pair up). The two runs differ in more than the front end (GPU clocks,
the process), so the figure that answers the question is measured inside the server's run: each request's client
TTFT minus the time its replica reports from taking the request to the step that made its first token.
"""

from __future__ import annotations

import multiprocessing as mp
import time

from afd.bench.serve_client import (
    WARM_UP_PROMPT,
    WARM_UP_TOKENS,
    Progress,
    RequestResult,
    bench_servers,
    format_rate,
    percentile,
    run_rates,
    run_record,
)
from afd.bench.workload import Workload
from afd.engine.engine import Request
from afd.runtime.spec import RunSpec

ENGINE_ALONE = "engine alone"
ENGINE_LOAD_S = 600.0  # the engine-alone process's model load, warm-up and graph capture, at most
SERVER = ("none R=1", ["--connector", "none", "--replicas", "1"])


def _engine_alone(spec: RunSpec, workload: Workload, rates: list[float], vocab_size: int, timeout_s: float, conn):
    """The child process: one replica engine, one untimed warm-up request, then every rate; progress and the
    token times go back through `conn` as ("start", label, n) / ("advance",) / ("finish",) / ("rate", rate, times,
    wall) / ("done",), or ("error", message)."""
    try:
        from afd.bench.harness import drive_arrivals, replica_engine

        prompts, max_tokens = workload.prompts(vocab_size), workload.max_tokens_of()
        engine = replica_engine(spec)
        warm = [(list(WARM_UP_PROMPT), WARM_UP_TOKENS), *workload.warm_up_requests(vocab_size)]  # as the server gets
        drive_arrivals(engine, [Request(p, n) for p, n in warm], [0.0] * len(warm), timeout_s)
        for rate in run_rates(workload, rates):
            arrivals = workload.arrivals(rate)
            requests = [Request(list(p), n) for p, n in zip(prompts, max_tokens, strict=True)]
            conn.send(("start", f"{ENGINE_ALONE}: rate {format_rate(rate)}", len(requests)))
            start = time.perf_counter()
            times = drive_arrivals(
                engine, requests, arrivals, timeout_s + max(arrivals), lambda: conn.send(("advance",))
            )
            conn.send(("rate", rate, times, time.perf_counter() - start))
        conn.send(("done",))
    except BaseException as exc:  # noqa: BLE001 - the parent reports it in one sentence
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        conn.close()


def bench_engine(
    spec: RunSpec, workload: Workload, rates: list[float], progress: Progress, *, vocab_size: int, timeout_s: float
) -> dict:
    """The workload at each rate straight into one replica engine in a process of its own, as each of the
    server's replicas runs (after one untimed warm-up request, as the server gets); the same result shape as
    one server config of `bench_servers`. Its own process, not this one: the bench's own Python state (threads,
    garbage, the HTTP client's leftovers) would otherwise slow a host-bound engine and flatter the front end."""
    progress.note(f"{ENGINE_ALONE}: loading one replica engine in a process of its own ...")
    prompts = workload.prompts(vocab_size)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(
        target=_engine_alone, args=(spec, workload, rates, vocab_size, timeout_s, child), name="afd-engine-alone"
    )
    proc.start()
    child.close()
    budget = ENGINE_LOAD_S + sum(timeout_s + max(workload.arrivals(r)) for r in run_rates(workload, rates))
    deadline = time.monotonic() + budget
    runs = []
    try:
        while True:
            if not parent.poll(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"the engine alone did not finish the workload within {budget:.0f} s")
            try:
                msg = parent.recv()
            except EOFError:
                raise RuntimeError(f"the engine-alone process ended early (exit code {proc.exitcode})") from None
            kind = msg[0]
            if kind == "start":
                progress.start(msg[1], msg[2])
            elif kind == "advance":
                progress.advance()
            elif kind == "rate":
                progress.finish()
                _, rate, times, wall = msg
                results = [RequestResult.from_token_times(len(p), t) for p, t in zip(prompts, times, strict=True)]
                runs.append(run_record(rate, results, wall))
            elif kind == "error":
                progress.finish()
                raise RuntimeError(f"the engine alone failed: {msg[1]}")
            else:
                break
    finally:
        parent.close()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
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
                # in the server's own run: client TTFT minus the replica's time to the first token, per request
                "front_end_p50_s": s_run["summary"].get("front_end_p50_s"),
                "front_end_p90_s": s_run["summary"].get("front_end_p90_s"),
                # of it, the server's own: from the request's bytes read to its first chunk written, less the engine
                "server_p50_s": s_run["summary"].get("server_p50_s"),
                "http_floor_p50_s": s_run.get("http_floor_p50_s"),  # GET /health round trips, same client
                "ttft_stages_p50_s": s_run["summary"].get("ttft_stages_p50_s"),  # where the server's TTFT goes
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
            f"(median per-request difference {ms(r['paired_median_s'])}, {r['requests']} requests); "
            f"within the server's run, client TTFT minus its replica's own: p50 {ms(r['front_end_p50_s'])}, "
            f"p90 {ms(r['front_end_p90_s'])} (an HTTP round trip to /health, the floor: p50 "
            f"{ms(r['http_floor_p50_s'])}); of it, inside the server: p50 {ms(r.get('server_p50_s'))}"
        )
        if r.get("ttft_stages_p50_s"):
            stages = ", ".join(f"{name} {ms(s)}" for name, s in r["ttft_stages_p50_s"].items())
            lines.append(f"    the server's TTFT by stage, p50 of each: {stages}")
    return "\n".join(lines)
