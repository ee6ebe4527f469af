"""The load and the run of `afd bench serve --chaos`: Poisson arrivals of greedy requests, sorted against a
reference while `afd.bench.chaos.kill_loop` kills ranks; the summary, its lines, and a server started for it.

The reference is the single-process engine's tokens (`afd.engine.generate`) where the ranks compute on the CPU
(same model, dtype, seed: greedy tokens match exactly), else the server's own tokens asked before any kill.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time

import aiohttp

from afd.bench.chaos import Kill, Outcome, classify, kill_loop, leftovers, names_rank, request_body, run_tokens
from afd.bench.serve_client import client_session, percentile
from afd.serve import loop

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 60.0  # the server's graceful stop after the chaos


def poisson_arrivals(rate: float, seconds: float, seed: int) -> list[float]:
    """Arrival times (s) of a Poisson process at `rate` requests/s within `seconds`."""
    rng, t, out = random.Random(seed), 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            return out
        out.append(t)


async def request_once(session: aiohttp.ClientSession, url: str, body: dict, expected: list[int] | None,
                       bound_s: float, headers: dict | None = None) -> Outcome:  # fmt: skip
    """One request, read whole and sorted (`classify`); hung when it takes longer than `bound_s`."""
    try:
        async with asyncio.timeout(bound_s), session.post(url + "/v1/completions", json=body, headers=headers) as r:
            raw = (await r.read()).decode(errors="replace")
            return classify(r.status, r.headers.get("Retry-After"), raw, body["stream"], expected)
    except TimeoutError:
        return Outcome("hung", f"no answer within {bound_s:g} s", body["stream"])
    except (aiohttp.ClientError, OSError) as exc:
        return Outcome("failed", f"connection: {type(exc).__name__}: {exc}", body["stream"])


async def _load(url: str, prompts: list[list[int]], max_tokens: list[int], reference: list[list[int]] | None,
                arrivals: list[float], bound_s: float, headers: dict) -> list[Outcome]:  # fmt: skip
    """Request n at `arrivals[n]`: prompt n mod len(prompts), every other one streamed."""
    async with client_session() as session:
        start = time.perf_counter()

        async def send(n: int) -> Outcome:
            await asyncio.sleep(max(0.0, start + arrivals[n] - time.perf_counter()))
            i = n % len(prompts)
            body = request_body(prompts[i], max_tokens[i], stream=n % 2 == 1)
            expected = None if reference is None else reference[i]
            return await request_once(session, url, body, expected, bound_s, headers)

        return list(await asyncio.gather(*(send(n) for n in range(len(arrivals)))))


def engine_reference(prompts: list[list[int]], max_tokens: list[int], **engine: object) -> list[list[int]]:
    """The single-process engine's greedy tokens per prompt (`engine`: generate's model, dtype, seed, ...)."""
    from afd.engine.generate import generate

    outputs = generate(prompts=prompts, max_new_tokens=max(max_tokens), **engine)
    return [out.token_ids[:n] for out, n in zip(outputs, max_tokens, strict=True)]


def server_reference(url: str, prompts: list[list[int]], max_tokens: list[int], bound_s: float,
                     headers: dict | None = None) -> list[list[int]]:  # fmt: skip
    """The server's own greedy tokens per prompt, asked before any kill."""
    outcomes = loop.run(_load(url, prompts, max_tokens, None, [0.0] * len(prompts), bound_s, headers or {}))
    bad = next((o for o in outcomes if o.kind != "unchecked"), None)
    if bad is not None:
        raise RuntimeError(f"a reference request before the chaos did not complete: {bad.kind}: {bad.error}")
    return [o.token_ids for o in outcomes]


def run_chaos(url: str, server_pid: int, prompts: list[list[int]], max_tokens: list[int],
              reference: list[list[int]] | None, *, rate: float, seconds: float, interval_s: float, bound_s: float,
              heal_bound_s: float, seed: int = 0, api_key: str | None = None) -> dict:  # fmt: skip
    """Poisson load at `rate` for `seconds` while `kill_loop` kills the server's ranks; `summarize`'s dict."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    arrivals = poisson_arrivals(rate, seconds, seed + 1)
    rng = random.Random(seed)

    async def both() -> tuple[list[Outcome], list[Kill]]:
        kills = asyncio.to_thread(kill_loop, url, server_pid, seconds, interval_s, rng, heal_bound_s)
        return tuple(
            await asyncio.gather(_load(url, prompts, max_tokens, reference, arrivals, bound_s, headers), kills)
        )

    outcomes, kills = loop.run(both())
    return summarize(outcomes, kills, checked=reference is not None)


def summarize(outcomes: list[Outcome], kills: list[Kill], checked: bool) -> dict:
    """Counts by kind, the failures whose error names no killed rank (`stray`) and the time to heal p50/max."""
    names = {k.rank for k in kills}
    failed = [o.error for o in outcomes if o.kind == "failed"]
    stray = [e for e in failed if not any(names_rank(e, name) for name in names)]
    heals = [k.heal_s for k in kills if k.heal_s is not None]
    count = {kind: sum(o.kind == kind for o in outcomes) for kind in ("right", "unchecked", "wrong", "refused", "hung")}
    return {
        "requests": len(outcomes),
        "completed": count["right"] + count["unchecked"],
        "failed": len(failed),
        "wrong": count["wrong"],
        "hung": count["hung"],
        "refused": count["refused"],
        "num_stray_failures": len(stray),
        "stray_failures": stray[:20],
        "checked_tokens": checked,
        "kills": [vars(k) for k in kills],
        "not_healed": sum(k.heal_s is None for k in kills),
        "heal_p50_s": percentile(heals, 50),
        "heal_max_s": max(heals) if heals else None,
    }


def format_chaos(name: str, summary: dict) -> str:
    """The summary in a few lines."""
    s = summary
    heal = f"{s['heal_p50_s']:.2f} / {s['heal_max_s']:.2f} s" if s["heal_p50_s"] is not None else "-"
    lines = [
        f"chaos {name}: {s['requests']} requests: {s['completed']} completed, {s['failed']} failed, {s['wrong']} "
        f"wrong, {s['hung']} hung ({s['refused']} refused while no replica served)"
        + ("" if s["checked_tokens"] else "; tokens not checked (no reference)"),
        f"  {len(s['kills'])} kills: time to heal p50 / max {heal}, {s['not_healed']} not healed; "
        f"{s['num_stray_failures']} failures name no killed rank",
        "  " + ", ".join(f"{k['rank']}: {_seconds(k['heal_s'])}" for k in s["kills"]),
    ]
    left = s.get("leftovers")
    if left is not None:
        lines.append(f"  left behind after the stop: {len(left['processes'])} ranks, {len(left['segments'])} segments")
    lines += [f"  failure naming no killed rank: {e}" for e in s["stray_failures"][:5]]
    return "\n".join(lines)


def _seconds(value: float | None) -> str:
    return "not healed" if value is None else f"{value:.2f} s"


def chaos_server(argv: list[str], prompts: list[list[int]], max_tokens: list[int],
                 engine: dict | None, *, startup_timeout_s: float, **chaos: object) -> dict:  # fmt: skip
    """Start `afd serve argv` on a free port, run the chaos on it (`run_chaos`'s keywords), stop it and look for
    what it left. `engine`: `engine_reference`'s keywords, or None for the server's own tokens before the chaos."""
    from afd.runtime.launch import free_port
    from afd.serve.run import ServerProcess

    reference = None if engine is None else engine_reference(prompts, max_tokens, **engine)
    server = ServerProcess([*argv, "--port", str(free_port())], startup_timeout_s)
    pid = server.proc.pid
    try:
        tokens = run_tokens(pid)
        if reference is None:
            reference = server_reference(server.url, prompts, max_tokens, float(chaos["bound_s"]))
        summary = run_chaos(server.url, pid, prompts, max_tokens, reference, **chaos)
    finally:
        code = server.stop(STOP_TIMEOUT_S)
    summary["server_exit_status"] = code
    summary["leftovers"] = leftovers(pid, tokens)
    return summary
