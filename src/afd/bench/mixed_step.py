"""Timing of `afd bench step --mixed DxC` (the row itself: `afd.bench.step.mixed_row`): one step of D decodes beside a
fresh C-token prompt chunk, timed beside the same D-decode step and the same C-token prefill step measured alone,
and their sum.

Why: under load almost every served step is mixed, so a mixed step should cost about what its two halves cost
apart; a ratio well above 1 means the mixed step pays for something the halves do not (host-bound pieces, a lost
decode graph). The mixed step's host time (scheduling to its work queued, the device idle before it) says whether
the host keeps ahead of it: above its device time, a served mixed step leaves the GPU waiting. All three are timed
as the prefill rows are: the median of `steps` steps with overlapped steps off and the device drained around each,
every kind of graph on as a served step uses it (decode graphs for the decodes alone, prefill graph pieces for the
mixed step and the prefill).
"""

from __future__ import annotations

import statistics
import time

import torch

from afd.engine.engine import Engine, Request


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_step(engine: Engine) -> tuple[float, float]:
    """(seconds, host seconds) of one engine step started on an idle device: its wall time, device drained, and
    the host's part of it, from scheduling to the step's work queued (`StepClock`)."""
    clock = engine.runner.step_clock
    _sync(engine.device)
    host = clock.host_seconds
    start = time.perf_counter()
    engine.step()
    _sync(engine.device)
    return time.perf_counter() - start, clock.host_seconds - host


def timed_prompt_steps(
    engine: Engine, chunk: int, steps: int, gen: torch.Generator, running: int
) -> tuple[float, float]:
    """Median (seconds, host seconds) of `steps` steps (after one warm-up) that each admit a fresh `chunk`-token
    prompt of one output token beside the `running` sequences already decoding; each must finish its prompt in
    that step."""
    times = []
    for _ in range(steps + 1):
        engine.add(Request(torch.randint(0, engine.model.config.vocab_size, (chunk,), generator=gen).tolist(), 1))
        times.append(_timed_step(engine))
        if len(engine.running) != running or engine.waiting:
            raise RuntimeError(f"a {chunk}-token prompt beside {running} decodes did not fit one step")
    return statistics.median(t for t, _ in times[1:]), statistics.median(h for _, h in times[1:])


def time_decodes_and_mixed(engine: Engine, chunk: int, steps: int, gen: torch.Generator) -> tuple[float, float, float]:
    """With decodes seeded and overlapped steps off: the median ms of `steps` decode steps (after a warm-up, their
    graph captured first), then of `steps` mixed steps that each add a fresh `chunk`-token prompt beside them, and
    the mixed steps' median host ms (scheduling to queued)."""
    decodes = len(engine.running)
    if engine.cuda_graphs is not None:
        engine.cuda_graphs.capture_for(decodes)
    times = [_timed_step(engine)[0] for _ in range(steps + 1)]
    decode_ms = statistics.median(times[1:]) * 1e3
    mixed_s, host_s = timed_prompt_steps(engine, chunk, steps, gen, decodes)
    return decode_ms, mixed_s * 1e3, host_s * 1e3


def mixed_fields(
    decodes: int, context: int, chunk: int, decode_ms: float, mixed_ms: float, prefill_ms: float, mixed_host_ms: float
) -> dict:
    """One mixed row: the three times, their sum and the mixed step over it, and the mixed step's host time (from
    its scheduling to its work queued) over its own time."""
    total = decode_ms + prefill_ms
    return {
        "decodes": decodes,
        "context": context,
        "chunk": chunk,
        "tokens": decodes + chunk,
        "mixed_ms": mixed_ms,
        "decode_ms": decode_ms,
        "prefill_ms": prefill_ms,
        "sum_ms": total,
        "mixed_over_sum": mixed_ms / total,
        "mixed_host_ms": mixed_host_ms,
        "host_over_mixed": mixed_host_ms / mixed_ms,
    }


def format_mixed(rows: list[dict]) -> list[str]:
    """Table lines of the mixed rows (none without them)."""
    if not rows:
        return []
    lines = [
        f"{'mixed':<8} {'decodes':>7} {'context':>7} {'chunk':>6} {'mixed ms':>9} {'decode ms':>9} {'prefill ms':>10} "
        f"{'sum ms':>9} {'mixed/sum':>9} {'host ms':>8} {'host/mixed':>10}"
    ]
    for r in rows:
        lines.append(
            f"{'':<8} {r['decodes']:>7} {r['context']:>7} {r['chunk']:>6} {r['mixed_ms']:>9.2f} {r['decode_ms']:>9.2f} "
            f"{r['prefill_ms']:>10.2f} {r['sum_ms']:>9.2f} {r['mixed_over_sum']:>8.2f}x {r['mixed_host_ms']:>8.2f} "
            f"{r['host_over_mixed']:>10.0%}"
        )
    return lines
