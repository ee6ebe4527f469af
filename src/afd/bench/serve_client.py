"""`afd bench serve`: online load through the HTTP API — seeded requests, Poisson arrivals, streamed answers.

Each request is a `/v1/completions` call with token-id prompts (no tokenizer in the measurement),
`stream: true`, `ignore_eos` and `max_tokens`, sent at its arrival time whether or not earlier ones have
finished (an open-loop client on aiohttp, as vLLM's serving benchmark is). Per request it records the time to
the first token, the gaps between tokens and the end-to-end latency; per run, requests/s and output tokens/s
over the run's wall time, percentiles and errors. The client's own cost per request stays out of the front end's
share of TTFT: that share is cut at the server's own stamps (`ttft_stages`, `RequestResult.server_s`). The
requests are `afd.bench.workload`'s; the table, the SLO-compliant throughput and the plot are `afd.bench.report`'s.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import urllib.parse
from dataclasses import asdict, dataclass, field
from typing import NamedTuple, TextIO

import aiohttp
from tqdm import tqdm

from afd.bench.workload import Workload
from afd.serve import loop
from afd.serve.busy_poll import spin

QUANTILES = (50, 90, 99)


class BenchError(RuntimeError):
    """A measurement that cannot go on (a server that fails its warm-up request), in one sentence."""


@dataclass
class RequestResult:
    prompt_len: int
    output_tokens: int = 0
    ttft_s: float | None = None  # None (JSON null) when the request failed
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    error: str | None = None
    engine_ttft_s: float | None = None  # the replica's own share of ttft_s, as the server reports it
    stages_s: dict[str, float] | None = None  # ttft_s cut at the server's stamps (`ttft_stages`; same host only)

    @property
    def front_end_s(self) -> float | None:
        """What everything outside the engine (HTTP, routing, the link, streaming) added to this request's TTFT."""
        if self.error is not None or self.ttft_s is None or self.engine_ttft_s is None:
            return None
        return self.ttft_s - self.engine_ttft_s

    @property
    def server_s(self) -> float | None:
        """The server's own part of `front_end_s`: from the request's last bytes read by the server to its first
        token's chunk handed to the socket, less the engine (same host only: it needs the stages)."""
        if self.stages_s is None or self.engine_ttft_s is None:
            return None
        stages = self.stages_s
        return self.ttft_s - stages["client_to_arrived"] - stages["written_to_client"] - self.engine_ttft_s

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (vLLM's TPOT); None with fewer than two tokens."""
        if self.error is not None or self.e2e_s is None or self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @classmethod
    def from_token_times(cls, prompt_len: int, times_s: list[float]) -> RequestResult:
        """A request whose tokens came at `times_s` (seconds from its arrival), as the engine alone reports it."""
        if not times_s:
            return cls(prompt_len, error="no token")
        gaps = [b - a for a, b in zip(times_s, times_s[1:], strict=False)]
        return cls(prompt_len, len(times_s), times_s[0], gaps, times_s[-1])


# TTFT from the client's send to its first token, cut at the moments the server stamps on the way (`Submitted.stamps`)
TTFT_STAGES = (
    ("client_to_arrived", "arrived"),  # the client's request built and sent, to its last bytes read by the server
    ("arrived_to_handler", "handler"),  # the server's HTTP parsing, to its handler's start
    ("handler_to_sent", "sent"),  # the body read and checked, the replica picked, the `add` built
    ("sent_to_replica", "replica_took"),  # pickled, over the link, the replica's loop noticing and unpickling it
    ("engine", "replica_stepped"),  # the replica's own share: from taking the request to the end of its first step
    ("replica_to_front", "front_got"),  # the tokens message back over the link to the front end's loop
    ("front_to_written", "written"),  # the request's handler waking, detokenizing, the chunk built
    ("written_to_client", None),  # the chunk written, its way to the client, and the client's parsing
)


def ttft_stages(client_sent: float, client_first: float, stamps: dict[str, float]) -> dict[str, float] | None:
    """The client's TTFT as the durations between the server's stamps (they sum to it); None when a stamp is
    missing. Meaningful only when client and server read one clock: `time.perf_counter()` is CLOCK_MONOTONIC,
    shared by every process of one Linux host."""
    if any(key is not None and key not in stamps for _, key in TTFT_STAGES):
        return None
    points = [client_sent, *(stamps[key] for _, key in TTFT_STAGES if key is not None), client_first]
    return {name: b - a for (name, _), a, b in zip(TTFT_STAGES, points[:-1], points[1:], strict=True)}


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile with linear interpolation (numpy's default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(results: list[RequestResult], wall_s: float) -> dict:
    """Counts, request and output-token throughput over the run's wall time, and p50/p90/p99 of TTFT, TPOT,
    inter-token latency (every gap of every request) and end-to-end latency over the successful requests."""
    ok = [r for r in results if r.error is None]
    tokens = sum(r.output_tokens for r in ok)
    out = {
        "requests": len(results),
        "completed": len(ok),
        "errors": len(results) - len(ok),
        "wall_s": wall_s,
        "output_tokens": tokens,
        "request_throughput": len(ok) / wall_s if wall_s > 0 else 0.0,
        "output_tok_s": tokens / wall_s if wall_s > 0 else 0.0,
    }
    series = {
        "ttft": [r.ttft_s for r in ok],
        "tpot": [r.tpot_s for r in ok if r.tpot_s is not None],
        "itl": [g for r in ok for g in r.itl_s],
        "e2e": [r.e2e_s for r in ok],
        "front_end": [r.front_end_s for r in ok if r.front_end_s is not None],
        "server": [r.server_s for r in ok if r.server_s is not None],
    }
    for name, values in series.items():
        for q in QUANTILES:
            out[f"{name}_p{q}_s"] = percentile(values, q)
    staged = [r.stages_s for r in ok if r.stages_s is not None]
    if staged:
        out["ttft_stages_p50_s"] = {name: percentile([s[name] for s in staged], 50) for name, _ in TTFT_STAGES}
    first_error = next((r.error for r in results if r.error), None)
    if first_error:
        out["first_error"] = first_error
    return out


def run_rates(workload: Workload, rates: list[float]) -> list[float]:
    """The rates to run: as asked, or the one mean rate of a trace with its own arrival times."""
    return [workload.mean_rate()] if workload.timed else list(rates)


async def _one(
    session: aiohttp.ClientSession,
    url: str,
    prompt: list[int],
    max_tokens: int,
    model: str | None,
    headers: dict,
    timeout_s: float,
    same_clock: bool = False,
) -> RequestResult:
    """One streamed request; with `same_clock` (the server is on this host), its TTFT cut into stages too."""
    result = RequestResult(len(prompt))
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "afd_timing": True,  # afd's servers report the engine's share of TTFT; others ignore the field
    }
    if model:
        body["model"] = model
    data = json.dumps(body).encode()  # before the clock starts: the client's own work, not the server's
    headers = {**headers, "Content-Type": "application/json"}
    start = last = first_at = time.perf_counter()
    stamps = None
    try:
        async with (
            asyncio.timeout(timeout_s),
            session.post(url + "/v1/completions", data=data, headers=headers) as resp,
        ):
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.read()).decode(errors='replace')[:200]}"
                return result
            async for raw in resp.content:  # line by line: server-sent events are lines
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    result.error = event["error"].get("message", "error event")
                    return result
                if event.get("usage"):
                    result.output_tokens = event["usage"]["completion_tokens"]
                if isinstance(event.get("afd_timing"), dict):
                    result.engine_ttft_s = event["afd_timing"].get("engine_ttft_s")
                    stamps = event["afd_timing"].get("stamps")
                if not event.get("choices") or event["choices"][0].get("finish_reason") is not None:
                    continue  # the usage chunk, or the closing chunk (the server streams one chunk per token before it)
                now = time.perf_counter()
                if result.ttft_s is None:
                    result.ttft_s, first_at = now - start, now
                else:
                    result.itl_s.append(now - last)
                last = now
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return result
    result.e2e_s = time.perf_counter() - start
    if same_clock and isinstance(stamps, dict) and result.ttft_s is not None:
        result.stages_s = ttft_stages(start, first_at, stamps)
    return result


def client_session() -> aiohttp.ClientSession:
    """Connections kept alive between requests and as many as run at once: an open loop never queues in the
    client (aiohttp's default caps them at 100)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None))


async def _run(
    url: str,
    workload: Workload,
    rate: float,
    vocab_size: int,
    model: str | None,
    api_key: str | None,
    progress: Progress,
    timeout_s: float,
    busy_poll: bool,
) -> dict:
    same_clock = is_this_host(url)
    prompts, arrivals, max_tokens = workload.prompts(vocab_size), workload.arrivals(rate), workload.max_tokens_of()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    spinner = asyncio.create_task(spin()) if busy_poll else None
    try:
        async with client_session() as session:
            start = time.perf_counter()

            async def send(i: int) -> RequestResult:
                await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
                result = await _one(session, url, prompts[i], max_tokens[i], model, headers, timeout_s, same_clock)
                progress.advance()
                return result

            results = await asyncio.gather(*(send(i) for i in range(len(prompts))))
            wall = time.perf_counter() - start
    finally:
        if spinner is not None:
            spinner.cancel()
    return run_record(rate, results, wall)


def is_this_host(url: str) -> bool:
    """Whether the server at `url` runs on this machine (a loopback address), so its stamps share our clock."""
    return urllib.parse.urlsplit(url).hostname in ("127.0.0.1", "localhost", "::1")


def run_record(rate: float, results: list[RequestResult], wall_s: float) -> dict:
    """One rate's raw results: its summary and every request's numbers."""
    return {"rate": rate, "summary": summarize(results, wall_s), "requests": [asdict(r) for r in results]}


def bench_url(
    url: str,
    workload: Workload,
    rates: list[float],
    *,
    vocab_size: int,
    model: str | None = None,
    api_key: str | None = None,
    progress: Progress | None = None,
    timeout_s: float = 600.0,
    label: str = "",
    busy_poll: bool = False,
) -> list[dict]:
    """One run per rate against the server at `url` (one run for a timed trace); the raw results. `busy_poll`: this
    client's event loop never sleeps either (as the server's under `--busy-poll`)."""
    progress = progress or Progress()
    http_floor = loop.run(_warm_up(url, model, api_key, timeout_s, workload.warm_up_requests(vocab_size)))
    runs = []
    for rate in run_rates(workload, rates):
        progress.start(f"{label}rate {format_rate(rate)}", workload.num_requests)
        before = loop.run(step_clock(url, timeout_s))
        try:
            runs.append(loop.run(_run(url, workload, rate, vocab_size, model, api_key, progress, timeout_s, busy_poll)))
        finally:
            progress.finish()
        runs[-1]["http_floor_p50_s"] = http_floor
        after = loop.run(step_clock(url, timeout_s))
        if before is not None and after is not None and after.steps > before.steps:
            runs[-1]["summary"]["steps"] = {
                "device_s": after.device_s - before.device_s,  # every replica's together
                "count": after.steps - before.steps,
                "replicas": after.replicas,
                "idle_s": after.idle_s - before.idle_s,  # every replica's together
                "prompt_device_s": after.prompt_device_s - before.prompt_device_s,  # steps holding a prompt token
                "prompt_count": after.prompt_steps - before.prompt_steps,
            }
    return runs


class StepClockReading(NamedTuple):
    """The servers' step clocks on a `/metrics` page, every replica's together."""

    device_s: float
    steps: int
    replicas: int  # those that ran a timed step
    idle_s: float  # the device idle between steps while a replica had work
    prompt_device_s: float = 0.0  # the part of device_s in steps holding a prompt token
    prompt_steps: int = 0


async def step_clock(url: str, timeout_s: float) -> StepClockReading | None:
    """`step_clock_of` the server's `/metrics` page (None without one)."""
    async with client_session() as session, asyncio.timeout(timeout_s), session.get(url + "/metrics") as resp:
        return step_clock_of(await resp.text()) if resp.status == 200 else None


def step_clock_of(metrics_text: str) -> StepClockReading | None:
    """From a `/metrics` page: the step device time so far (`afd.serve.metrics.STEP_DEVICE_SECONDS`, every
    replica's together), the step count, the replicas that ran a timed step and the device's idle time between
    steps, and the part of the steps that held a prompt token; None when no step was timed (CPU steps are not,
    another server has no such series)."""
    from prometheus_client.parser import text_string_to_metric_families

    from afd.serve import metrics as m

    names = (m.STEP_DEVICE_SECONDS, m.STEPS, m.STEP_IDLE_SECONDS, m.PROMPT_STEP_DEVICE_SECONDS, m.PROMPT_STEPS)
    values: dict[str, dict[str, float]] = {name: {} for name in names}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name in values:
                values[sample.name][sample.labels.get("replica", "")] = sample.value
    counts = values[m.STEPS]
    if not any(counts.values()):
        return None
    return StepClockReading(
        sum(values[m.STEP_DEVICE_SECONDS].values()),
        int(sum(counts.values())),
        sum(1 for c in counts.values() if c),
        sum(values[m.STEP_IDLE_SECONDS].values()),
        sum(values[m.PROMPT_STEP_DEVICE_SECONDS].values()),
        int(sum(values[m.PROMPT_STEPS].values())),
    )


async def _warm_up(
    url: str, model: str | None, api_key: str | None, timeout_s: float, requests: list[tuple[list[int], int]]
) -> float | None:
    """One short request before the timed runs: a replica's first step pays one-time costs (allocator, kernels);
    then `requests` (the workload's first, `--warmups`) all at once, untimed, for the shapes it has not seen.
    Returns the p50 of `HTTP_FLOOR_PROBES` round trips to `/health` by this client: the HTTP floor the front end's
    share of TTFT compares with (no JSON body, no replica), None when the server has no `/health`."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with client_session() as session:
        result = await _one(session, url, WARM_UP_PROMPT, WARM_UP_TOKENS, model, headers, timeout_s)
        warm = [_one(session, url, p, n, model, headers, timeout_s) for p, n in requests]
        results = [result, *await asyncio.gather(*warm)]
        failed = next((r.error for r in results if r.error), None)
        if failed:
            raise BenchError(f"the server at {url} failed a warm-up request: {failed}")
        times = []
        for _ in range(HTTP_FLOOR_PROBES):
            start = time.perf_counter()
            async with asyncio.timeout(timeout_s), session.get(url + "/health") as resp:
                await resp.read()
                if resp.status != 200:
                    return None
            times.append(time.perf_counter() - start)
    return percentile(times[HTTP_FLOOR_PROBES // 5 :], 50)  # the first few open the connection


HTTP_FLOOR_PROBES = 50


WARM_UP_PROMPT, WARM_UP_TOKENS = [1] * 8, 2


def bench_servers(
    configs: list[tuple[str, list[str]]],
    argv: list[str],
    workload: Workload,
    rates: list[float],
    progress: Progress,
    *,
    vocab_size: int,
    timeout_s: float,
) -> list[dict]:
    """Start `afd serve argv + flags` for each (label, flags) in turn on a free port, measure it, stop it."""
    from afd.runtime.launch import free_port
    from afd.serve.run import ServerProcess

    results = []
    for label, flags in configs:
        progress.note(f"{label}: starting the server ...")
        server = ServerProcess([*argv, "--port", str(free_port()), *flags], timeout_s)
        try:
            runs = bench_url(
                server.url,
                workload,
                rates,
                vocab_size=vocab_size,
                timeout_s=timeout_s,
                progress=progress,
                label=f"{label}: ",
                busy_poll="--busy-poll" in argv,
            )
        finally:
            code = server.stop()
        results.append({"name": label, "runs": runs, "server_exit_status": code})
    return results


class Progress:
    """Progress of the runs: a tqdm bar per run on a terminal; in a log (tqdm turns itself off there), one line
    per server start and per finished run; nothing at all without a `stream` (the library's default)."""

    def __init__(self, stream: TextIO | None = None, prefix: str = "[afd bench serve]") -> None:
        self.stream, self.prefix = stream, prefix
        self.bar: tqdm | None = None
        self.label, self.total, self.done, self.started = "", 0, 0, 0.0

    def note(self, message: str) -> None:
        """A milestone (a server starts)."""
        if self.stream is not None:
            tqdm.write(f"{self.prefix} {message}", file=self.stream)
            self.stream.flush()

    def start(self, label: str, total: int) -> None:
        """A run of `total` requests begins."""
        self.label, self.total, self.done, self.started = label, total, 0, time.perf_counter()
        if self.stream is not None:
            self.bar = tqdm(total=total, desc=label, unit="req", file=self.stream, disable=None, leave=True)

    def advance(self) -> None:
        """One request of the run ended (success or error)."""
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)

    def finish(self) -> None:
        """The run ended: its bar closes (on a terminal) or its line is written (in a log)."""
        if self.bar is None:
            return
        bar, self.bar = self.bar, None
        bar.close()
        if bar.disable:
            elapsed = time.perf_counter() - self.started
            self.note(f"{self.label}: {self.done}/{self.total} requests in {elapsed:.1f} s")


def format_rate(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}/s"
