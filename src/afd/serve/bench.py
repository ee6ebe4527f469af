"""`afd bench serve`: online load through the HTTP API — seeded prompts, Poisson arrivals, streamed answers.

Each request is a `/v1/completions` call with token-id prompts (no tokenizer in the measurement),
`stream: true`, `ignore_eos` and `max_tokens`, sent at its arrival time whether or not earlier ones have
finished (an open-loop client, as vLLM's `benchmark_serving` is). Per request it records the time to the
first token, the gaps between tokens and the end-to-end latency; per run, output tokens/s over the
run's wall time, percentiles and errors. `SLO-compliant throughput` is the highest rate whose p90 TTFT
stays within the SLO.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import aiohttp

WORKLOADS = ("uneven", "mixed")
MIXED_SIGMA = 1.0  # lognormal prompt lengths: a long tail, as production prefill traffic has


@dataclass(frozen=True)
class Workload:
    """`uneven`: each prompt is `long_len` with probability `long_fraction`, else `short_len`. `mixed`:
    lognormal lengths with median `short_len`, capped at `long_len`."""

    kind: str = "uneven"
    requests: int = 64
    long_len: int = 1024
    short_len: int = 32
    long_fraction: float = 0.25
    max_tokens: int = 64
    seed: int = 0

    def prompts(self, vocab_size: int) -> list[list[int]]:
        rng = random.Random(self.seed)
        out = []
        for _ in range(self.requests):
            if self.kind == "mixed":
                n = min(self.long_len, max(1, round(rng.lognormvariate(math.log(self.short_len), MIXED_SIGMA))))
            else:
                n = self.long_len if rng.random() < self.long_fraction else self.short_len
            out.append([rng.randrange(vocab_size) for _ in range(n)])
        return out

    def arrivals(self, rate: float) -> list[float]:
        """Poisson arrivals at `rate` requests/s (seconds from the start); inf: all at once."""
        if math.isinf(rate):
            return [0.0] * self.requests
        rng, t, out = random.Random(self.seed + 1), 0.0, []
        for _ in range(self.requests):
            out.append(t)
            t += rng.expovariate(rate)
        return out


@dataclass
class RequestResult:
    prompt_len: int
    output_tokens: int = 0
    ttft_s: float | None = None  # None (JSON null) when the request failed
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    error: str | None = None


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile with linear interpolation (numpy's default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(results: list[RequestResult], wall_s: float) -> dict:
    ok = [r for r in results if r.error is None]
    ttft = [r.ttft_s for r in ok]
    itl = [g for r in ok for g in r.itl_s]
    e2e = [r.e2e_s for r in ok]
    tokens = sum(r.output_tokens for r in ok)
    out = {
        "requests": len(results),
        "completed": len(ok),
        "errors": len(results) - len(ok),
        "wall_s": wall_s,
        "output_tokens": tokens,
        "output_tok_s": tokens / wall_s if wall_s > 0 else 0.0,
    }
    for name, values in (("ttft", ttft), ("itl", itl), ("e2e", e2e)):
        for q in (50, 90, 99):
            out[f"{name}_p{q}_s"] = percentile(values, q)
    first_error = next((r.error for r in results if r.error), None)
    if first_error:
        out["first_error"] = first_error
    return out


async def _one(
    session: aiohttp.ClientSession,
    url: str,
    prompt: list[int],
    max_tokens: int,
    model: str | None,
    headers: dict,
    timeout_s: float,
) -> RequestResult:
    result = RequestResult(len(prompt))
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model:
        body["model"] = model
    start = last = time.perf_counter()
    try:
        async with session.post(
            f"{url}/v1/completions", json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return result
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    result.error = event["error"].get("message", "error event")
                    return result
                if event.get("usage"):
                    result.output_tokens = event["usage"]["completion_tokens"]
                if not event.get("choices") or event["choices"][0].get("finish_reason") is not None:
                    continue  # the usage chunk, or the closing chunk (the server streams one chunk per token before it)
                now = time.perf_counter()
                if result.ttft_s is None:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last)
                last = now
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.e2e_s = time.perf_counter() - start
    return result


async def _run(
    url: str,
    workload: Workload,
    rate: float,
    vocab_size: int,
    model: str | None,
    api_key: str | None,
    progress: Callable[[int, int], None],
    timeout_s: float,
) -> dict:
    prompts, arrivals = workload.prompts(vocab_size), workload.arrivals(rate)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    done = 0
    connector = aiohttp.TCPConnector(limit=0)  # open loop: never queue requests in the client

    async with aiohttp.ClientSession(connector=connector) as session:
        start = time.perf_counter()

        async def send(i: int) -> RequestResult:
            nonlocal done
            await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
            result = await _one(session, url, prompts[i], workload.max_tokens, model, headers, timeout_s)
            done += 1
            progress(done, len(prompts))
            return result

        results = await asyncio.gather(*(send(i) for i in range(len(prompts))))
        wall = time.perf_counter() - start
    return {"rate": rate, "summary": summarize(results, wall), "requests": [asdict(r) for r in results]}


def bench_url(
    url: str,
    workload: Workload,
    rates: list[float],
    *,
    vocab_size: int,
    model: str | None = None,
    api_key: str | None = None,
    progress: Callable[[str, bool], None] = lambda msg, end: None,
    timeout_s: float = 600.0,
) -> list[dict]:
    """One run per rate against the server at `url`; the raw results. `progress(message, run_ended)`."""
    asyncio.run(_warm_up(url, model, api_key, timeout_s))
    runs = []
    for rate in rates:

        def tick(done: int, total: int, rate=rate) -> None:
            progress(f"rate {format_rate(rate)}: {done}/{total} requests", done == total)

        runs.append(asyncio.run(_run(url, workload, rate, vocab_size, model, api_key, tick, timeout_s)))
    return runs


async def _warm_up(url: str, model: str | None, api_key: str | None, timeout_s: float) -> None:
    """One short request before the timed runs: a replica's first step pays one-time costs (allocator, kernels)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession() as session:
        result = await _one(session, url, [1] * 8, 2, model, headers, timeout_s)
    if result.error:
        raise RuntimeError(f"the server at {url} failed a warm-up request: {result.error}")


def bench_servers(
    configs: list[tuple[str, list[str]]],
    argv: list[str],
    workload: Workload,
    rates: list[float],
    progress: Callable[[str, bool], None],
    *,
    vocab_size: int,
    timeout_s: float,
) -> list[dict]:
    """Start `afd serve argv + flags` for each (label, flags) in turn on a free port, measure it, stop it."""
    from afd.runtime.launch import free_port
    from afd.serve.run import ServerProcess

    results = []
    for label, flags in configs:
        progress(f"{label}: starting the server ...", True)
        server = ServerProcess([*argv, "--port", str(free_port()), *flags], timeout_s)
        try:
            runs = bench_url(
                server.url,
                workload,
                rates,
                vocab_size=vocab_size,
                timeout_s=timeout_s,
                progress=lambda m, end, label=label: progress(f"{label}: {m}", end),
            )
        finally:
            code = server.stop()
        results.append({"name": label, "runs": runs, "server_exit_status": code})
    return results


def slo_throughput(runs: list[dict], slo_ttft_s: float) -> float | None:
    """The highest rate whose p90 TTFT is within the SLO and whose every request succeeded; None if none is."""
    good = [r["rate"] for r in runs if r["summary"]["errors"] == 0 and r["summary"]["ttft_p90_s"] <= slo_ttft_s]
    return max(good) if good else None


def strict_json(value):
    """`value` with infinite floats (the rate `inf`) as the string "inf": JSON has no infinity."""
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [strict_json(v) for v in value]
    return value


def format_rate(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}/s"


def format_table(results: list[dict], slo_ttft_s: float) -> str:
    """One row per (server config, rate), then the SLO-compliant throughput of each config."""
    head = (
        f"{'server':<18} {'rate':>7} {'ok':>5} {'err':>4} {'out tok/s':>10} {'TTFT p50':>9} {'p90':>8} "
        f"{'p99':>8} {'ITL p50':>8} {'p99':>8} {'E2E p50':>8} {'p99':>8}"
    )
    lines = [head, "-" * len(head)]

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1e3:.0f}ms"

    for res in results:
        for run in res["runs"]:
            s = run["summary"]
            lines.append(
                f"{res['name']:<18} {format_rate(run['rate']):>7} {s['completed']:>5} {s['errors']:>4} "
                f"{s['output_tok_s']:>10.1f} {ms(s['ttft_p50_s']):>9} {ms(s['ttft_p90_s']):>8} "
                f"{ms(s['ttft_p99_s']):>8} {ms(s['itl_p50_s']):>8} {ms(s['itl_p99_s']):>8} "
                f"{ms(s['e2e_p50_s']):>8} {ms(s['e2e_p99_s']):>8}"
            )
    lines.append("-" * len(head))
    for res in results:
        best = slo_throughput(res["runs"], slo_ttft_s)
        text = format_rate(best) if best is not None else f"none of the rates (p90 TTFT over {slo_ttft_s:g} s)"
        lines.append(f"{res['name']}: SLO-compliant rate (p90 TTFT <= {slo_ttft_s:g} s): {text}")
    return "\n".join(lines)
