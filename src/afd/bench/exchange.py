"""`afd bench exchange`: one layer's exchange round trip with a no-op FFN, beside a copy of the same bytes.

What it isolates: the connector's own cost per MoE layer — planning, packing, transfers both ways,
waiting and combining — with an FFN side that answers zeros without computing. One attention rank and
one FFN rank (1A1F) run as two processes through the real transports (gloo / shared memory on CPU,
NCCL / NVSHMEM on CUDA, attention on GPU 0 and FFN on GPU 1 when there are two). For every token
count T it times round trips one by one (p50, p90; the device synchronized after each) and back to
back (mean), beside the time to copy the same bytes once each way, measured in the same run before the
ranks start: a memcpy on CPU; on CUDA a peer copy GPU 0 -> GPU 1 and back, many copies between two
CUDA events (one event pair around a single copy reads ~20 µs there).

At 1A1F both connectors move the same bytes per layer: T rows of `H` model-dtype values plus `K` int32
ids and `K` fp32 weights there, T rows of `H` values back.

This module measures the copy, starts both ranks of each connector and makes the table; what each rank runs
is in `afd.bench.exchange_rank`.
"""

from __future__ import annotations

import datetime
import json
import logging
import multiprocessing as mp
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from afd.bench.exchange_rank import rank_main
from afd.bench.offline import device_name
from afd.model.weights import load_model_config
from afd.runtime.launch import free_port

logger = logging.getLogger(__name__)


def row_bytes(hidden_size: int, topk: int, itemsize: int) -> tuple[int, int]:
    """(request, reply) bytes per token of one 1A1F layer exchange, the same for both connectors."""
    return hidden_size * itemsize + 8 * topk, hidden_size * itemsize


def _sync_all() -> None:
    for d in range(torch.cuda.device_count()):
        torch.cuda.synchronize(d)


def copy_us(nbytes: int, src: str, dst: str, iters: int) -> float:
    """Mean µs of one copy of `nbytes` from device `src` to `dst` ('cpu' or 'cuda:N'), over `iters` copies."""
    a = torch.ones(max(nbytes, 1), dtype=torch.uint8, device=src)
    b = torch.empty_like(a, device=dst)
    b.copy_(a)  # warm-up (peer access is enabled on the first copy)
    if a.is_cuda:
        _sync_all()
        with torch.cuda.device(a.device):  # a peer copy runs on the source device's current stream
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                b.copy_(a)
            end.record()
        _sync_all()
        return start.elapsed_time(end) * 1e3 / iters
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs: a parallel copy on busy cores measured its wake-ups
    try:
        start_s = time.perf_counter()
        for _ in range(iters):
            b.copy_(a)
        return (time.perf_counter() - start_s) * 1e6 / iters
    finally:
        torch.set_num_threads(threads)


def rank_devices(device: str) -> tuple[str, str]:
    """(attention, FFN) devices: two GPUs when there are, else both ranks on one device."""
    if device != "cuda":
        return "cpu", "cpu"
    return "cuda:0", f"cuda:{1 if torch.cuda.device_count() > 1 else 0}"


def _run_connector(connector: str, spec: dict) -> list[dict]:
    """Both ranks of one connector as processes; their wait is bounded and every child is reaped."""
    spec = {**spec, "connector": connector, "port": free_port()}
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="afd_bench_exchange_") as tmp:
        outs = [str(Path(tmp, f"rank{r}.json")) for r in range(2)]
        procs = [ctx.Process(target=rank_main, args=(spec, r, outs[r]), daemon=True) for r in range(2)]
        try:
            for p in procs:
                p.start()
            deadline = time.monotonic() + 2 * spec["timeout_s"]
            for p in procs:
                p.join(max(0.0, deadline - time.monotonic()))
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(5)
        reports = [json.loads(Path(o).read_text()) if Path(o).is_file() else None for o in outs]
    for rank, report in enumerate(reports):
        if report is None or "error" in report:
            why = "no report within the timeout" if report is None else report["error"]
            raise RuntimeError(f"{connector} world rank {rank} failed: {why}")
    return next(r["rows"] for r in reports if r["rows"] is not None)


def run_bench_exchange(
    *,
    model: str,
    dtype: str,
    device: str,
    tokens: list[int],
    connectors: tuple[str, ...],
    iters: int = 50,
    warmup: int = 5,
    layers: int = 1,
    graph: bool = False,
    timeout_s: float = 120.0,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Copy times first (nothing else running), then each connector's round trips; one result dict."""
    say = progress or logger.info
    config = load_model_config(model)
    hidden, topk = config.hidden_size, config.num_experts_per_tok
    itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    there, back = row_bytes(hidden, topk, itemsize)
    attn_dev, ffn_dev = rank_devices(device)
    copy_iters = max(iters, 200)
    say(f"copying the same bytes {attn_dev} -> {ffn_dev} -> {attn_dev} ...")
    copies = {
        t: copy_us(t * there, attn_dev, ffn_dev, copy_iters) + copy_us(t * back, ffn_dev, attn_dev, copy_iters)
        for t in tokens
    }
    spec = {
        "hidden_size": hidden,
        "topk": topk,
        "num_experts": config.n_routed_experts,
        "dtype": dtype,
        "tokens": list(tokens),
        "iters": iters,
        "warmup": warmup,
        "layers": layers,
        "graph": graph,
        "timeout_s": timeout_s,
        "devices": {"attention": attn_dev, "ffn": ffn_dev},
    }
    rows = []
    for connector in connectors:
        say(f"{connector}: 1A1F round trips at T = {', '.join(map(str, tokens))} ...")
        for row in _run_connector(connector, spec):
            t = row["tokens"]
            rows.append(
                {
                    "connector": connector,
                    **row,
                    "bytes": t * (there + back),
                    "copy_us": copies[t],
                    "p50_over_copy": row["p50_us"] / copies[t] if copies[t] > 0 else None,
                }
            )
    return {
        "date": datetime.date.today().isoformat(),
        "device": device_name(device),
        "model": model,
        "dtype": dtype,
        "torch": torch.__version__,
        "topology": "1A1F",
        "ranks_on": {"attention": attn_dev, "ffn": ffn_dev},
        "hidden_size": hidden,
        "topk": topk,
        "iters": iters,
        "warmup": warmup,
        "layers": layers,
        "graph": graph,
        "copy_iters": copy_iters,
        "rows": rows,
    }


def run_exchange_stress(
    *,
    model: str,
    dtype: str,
    device: str,
    round_trips: int,
    max_tokens: int = 64,
    graph: bool = False,
    timeout_s: float = 600.0,
) -> dict:
    """The async connector's ordering under load: `round_trips` exchanges (two messages each) of random sizes
    through the real window and transport, an echo FFN; raises unless every reply equals its request. `graph`
    (CUDA): through captured passes, as decode steps send (`_stress_captured`)."""
    config = load_model_config(model)
    attn_dev, ffn_dev = rank_devices(device)
    spec = {
        "hidden_size": config.hidden_size,
        "topk": config.num_experts_per_tok,
        "num_experts": config.n_routed_experts,
        "num_layers": config.num_hidden_layers,
        "dtype": dtype,
        "tokens": [max_tokens],
        "stress": round_trips,
        "graph": graph,
        "timeout_s": timeout_s,
        "devices": {"attention": attn_dev, "ffn": ffn_dev},
    }
    (row,) = _run_connector("async", spec)
    if row["mismatches"]:
        raise RuntimeError(f"{row['mismatches']} of {round_trips} replies differed from their requests")
    return {
        "date": datetime.date.today().isoformat(),
        "device": device_name(device),
        "model": model,
        "dtype": dtype,
        "max_tokens": max_tokens,
        "captured": graph,
        **row,
    }


def _unit(layers: int, graph: bool = False) -> str:
    unit = "round trips" if layers == 1 else f"passes of {layers} layers (times per layer)"
    return unit + (", async passes replayed from one CUDA graph (exchanges captured), p2p eager" if graph else "")


def format_bench_exchange(result: dict) -> str:
    """One line per (connector, T): round trip p50 / p90 / mean beside the copy of the same bytes."""
    lines = [
        f"{result['model']} {result['dtype']} on {result['device']} (torch {result['torch']}), "
        f"{result['topology']}, no-op FFN, {result['iters']} "
        f"{_unit(result.get('layers', 1), result.get('graph', False))} per point; "
        "copy: the same bytes "
        f"{result['ranks_on']['attention']} -> {result['ranks_on']['ffn']} and back",
        f"{'connector':<9} {'tokens':>6} {'bytes':>10} {'p50 us':>9} {'p90 us':>9} {'mean us':>9} "
        f"{'copy us':>9} {'p50/copy':>9}",
    ]
    for r in result["rows"]:
        ratio = "-" if r["p50_over_copy"] is None else f"{r['p50_over_copy']:.1f}x"
        lines.append(
            f"{r['connector']:<9} {r['tokens']:>6} {r['bytes']:>10} {r['p50_us']:>9.1f} {r['p90_us']:>9.1f} "
            f"{r['mean_us']:>9.1f} {r['copy_us']:>9.2f} {ratio:>9}"
        )
    return "\n".join(lines)
