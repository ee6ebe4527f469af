"""Timing of `afd bench step --mixed DxC` (the row itself: `afd.bench.step.mixed_row`): one step of D decodes beside a
fresh C-token prompt chunk, timed beside the same D-decode step and the same C-token prefill step measured alone,
and their sum.

Why: under load almost every served step is mixed, so a mixed step should cost about what its two halves cost
apart; a ratio well above 1 means the mixed step pays for something the halves do not (host-bound pieces, a lost
decode graph). All three are timed as the prefill rows are: the median of `steps` steps with overlapped steps off
and the device drained around each, every kind of graph on as a served step uses it (decode graphs for the decodes
alone, prefill graph pieces for the mixed step and the prefill).
"""

from __future__ import annotations

import statistics
import time

import torch

from afd.engine.engine import Engine, Request


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_prompt_steps(engine: Engine, chunk: int, steps: int, gen: torch.Generator, running: int) -> float:
    """Median seconds of `steps` steps (after one warm-up) that each admit a fresh `chunk`-token prompt of one
    output token beside the `running` sequences already decoding; each must finish its prompt in that step."""
    times = []
    for _ in range(steps + 1):
        engine.add(Request(torch.randint(0, engine.model.config.vocab_size, (chunk,), generator=gen).tolist(), 1))
        _sync(engine.device)
        start = time.perf_counter()
        engine.step()
        _sync(engine.device)
        times.append(time.perf_counter() - start)
        if len(engine.running) != running or engine.waiting:
            raise RuntimeError(f"a {chunk}-token prompt beside {running} decodes did not fit one step")
    return statistics.median(times[1:])


def time_decodes_and_mixed(engine: Engine, chunk: int, steps: int, gen: torch.Generator) -> tuple[float, float]:
    """With decodes seeded and overlapped steps off: the median ms of `steps` decode steps (after a warm-up, their
    graph captured first), then of `steps` mixed steps that each add a fresh `chunk`-token prompt beside them."""
    decodes = len(engine.running)
    if engine.cuda_graphs is not None:
        engine.cuda_graphs.capture_for(decodes)
    times = []
    for _ in range(steps + 1):
        _sync(engine.device)
        start = time.perf_counter()
        engine.step()
        _sync(engine.device)
        times.append(time.perf_counter() - start)
    decode_ms = statistics.median(times[1:]) * 1e3
    return decode_ms, timed_prompt_steps(engine, chunk, steps, gen, decodes) * 1e3


def mixed_fields(decodes: int, context: int, chunk: int, decode_ms: float, mixed_ms: float, prefill_ms: float) -> dict:
    """One mixed row: the three times, their sum and the mixed step over it."""
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
    }


def format_mixed(rows: list[dict]) -> list[str]:
    """Table lines of the mixed rows (none without them)."""
    if not rows:
        return []
    lines = [
        f"{'mixed':<8} {'decodes':>7} {'context':>7} {'chunk':>6} {'mixed ms':>9} {'decode ms':>9} {'prefill ms':>10} "
        f"{'sum ms':>9} {'mixed/sum':>9}"
    ]
    for r in rows:
        lines.append(
            f"{'':<8} {r['decodes']:>7} {r['context']:>7} {r['chunk']:>6} {r['mixed_ms']:>9.2f} {r['decode_ms']:>9.2f} "
            f"{r['prefill_ms']:>10.2f} {r['sum_ms']:>9.2f} {r['mixed_over_sum']:>8.2f}x"
        )
    return lines
