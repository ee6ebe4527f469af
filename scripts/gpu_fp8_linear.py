"""The FP8 linear kernel (afd.kernels.fp8_linear) against bf16 `F.linear` on one GPU, at the linear shapes of
DeepSeek-V2-Lite and V3 (what `FP8Linear` runs: attention projections, dense MLPs, shared experts).

Per (model, linear, M): one CUDA graph of calls on distinct copies of the weight (enough copies that they do not
stay in L2), replayed `--iters` times; ms per call, the bytes a call must move (weight, its scales, rows in, rows
out) per second, the HBM floor (those bytes at the device-to-device copy bandwidth measured in the same run),
TFLOP/s, and fp8/bf16. Rows: bf16 (`F.linear`, cuBLAS), fp8 (`fp8_linear` as the model calls it: the kernel with
its tile table, or the dense path where `takes_kernel` says so), fp8-kernel (the kernel at its bucket's tile where
`fp8` took the dense path), fp8-dense (the dense path at every M: the weight dequantized, `F.linear`; where the two
paths cross),
fp8-sweep (other tile shapes; `--sweep`).

    PYTHONPATH=src python3 scripts/gpu_fp8_linear.py [--models v2-lite,v3] [--rows 1,64,256,8192] [--only o_proj]
        [--block 128] [--iters 20] [--sweep]

Prints one JSON line per row, then a table (stderr) of fp8 against bf16.
"""
# ruff: noqa: T201  (a script that prints its results)

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

from afd.kernels.fp8_linear import (
    KERNEL_MAX_ROWS,
    LinearConfig,
    choose_config,
    dequantize_weight,
    fp8_linear,
    sm_count,
    takes_kernel,
)
from afd.model.fp8 import dequantize, quantize
from afd.profiling.graph_timing import graph_ms

# (name, N, K) of each FP8Linear shape (out_features, in_features)
SHAPES = {
    "v2-lite": [
        ("q_proj", 3072, 2048),
        ("kv_a_proj_with_mqa", 576, 2048),
        ("kv_b_proj", 4096, 512),
        ("o_proj", 2048, 2048),
        ("dense gate/up_proj", 10944, 2048),
        ("dense down_proj", 2048, 10944),
        ("shared gate/up_proj", 2816, 2048),
        ("shared down_proj", 2048, 2816),
    ],
    "v3": [
        ("q_a_proj", 1536, 7168),
        ("q_b_proj", 24576, 1536),
        ("kv_a_proj_with_mqa", 576, 7168),
        ("kv_b_proj", 32768, 512),
        ("o_proj", 7168, 16384),
        ("dense gate/up_proj", 18432, 7168),
        ("dense down_proj", 7168, 18432),
        ("shared gate/up_proj", 2048, 7168),
        ("shared down_proj", 7168, 2048),
    ],
}
L2_FLUSH_BYTES = 256 << 20  # weight copies per graph until they add up to this (an H200's L2 is 50 MiB)
MAX_COPIES = 16

parser = argparse.ArgumentParser()
parser.add_argument("--models", default="v2-lite,v3")
parser.add_argument("--rows", default="1,64,256,8192")
parser.add_argument("--only", default="", help="comma-separated substrings of linear names to keep")
parser.add_argument("--block", type=int, default=128)
parser.add_argument("--iters", type=int, default=20)
parser.add_argument("--sweep", action="store_true", help="also time other tile shapes of the kernel")
args = parser.parse_args()
dev = torch.device("cuda")
block = (args.block, args.block)
rows_list = [int(r) for r in args.rows.split(",")]


def copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write), the floor's bandwidth."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        b.copy_(a)
    end.record()
    torch.cuda.synchronize()
    return 2 * a.numel() * 10 / (start.elapsed_time(end) * 1e-3)


def timed(calls) -> float:
    """ms per call of `calls` (a list of thunks, one per weight copy), captured in one CUDA graph."""
    return graph_ms(lambda: [call() for call in calls], reps=1, rounds=args.iters) / len(calls)


def sweep_configs(rows: int) -> list[LinearConfig]:
    """A few tile shapes around the table's for this M (narrower row tiles too, several per program); past the
    table's rows, larger tiles (where the kernel might overtake the dense path)."""
    if rows > KERNEL_MAX_ROWS:
        shapes = [(64, 64, 4, 4), (64, 128, 4, 3), (128, 64, 4, 3), (128, 128, 8, 3), (64, 128, 8, 4), (128, 64, 8, 4)]
        return [LinearConfig(bm, bn, 128, split, w, st) for bm, bn, w, st in shapes for split in (1, 2)]
    bucket = 16 if rows <= 16 else 32 if rows <= 32 else 64
    shapes = [(bm, warps) for bm in (16, 32, 64) if bm <= bucket for warps in (4, 8) if warps == 4 or bm == 64]
    return [LinearConfig(bm, bn, 128, split, w) for bm, w in shapes for bn in (16, 32, 64) for split in (1, 2, 4)]


def report(row: str, shape: tuple[str, str, int, int, int], ms: float, moved: int, **extra) -> None:
    """One JSON line: ms per call, bytes moved per second, the HBM floor of those bytes, TFLOP/s."""
    model, name, n, k, rows = shape
    line = {"row": row, "model": model, "linear": name, "N": n, "K": k, "M": rows, "ms": round(ms, 5)}
    line |= {"GBps": round(moved / (ms * 1e-3) / 1e9), "floor_ms": round(moved / bandwidth * 1e3, 5)}
    line |= {"TFLOPs": round(2 * rows * n * k / (ms * 1e-3) / 1e12, 1), **extra}
    print(json.dumps(line), flush=True)


def bench_rows(shape: tuple[str, str, int, int, int], weights: list, dense: list[torch.Tensor]) -> str:
    """Every row of one (model, linear, M); returns its table line."""
    model, name, n, k, rows = shape
    x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
    io = 2 * rows * (k + n)
    fp8_bytes = n * k + 4 * -(-n // block[0]) * -(-k // block[1]) + io
    bf16_ms = timed([lambda d=d: F.linear(x, d) for d in dense])
    report("bf16", shape, bf16_ms, 2 * n * k + io)
    fp8_ms = timed([lambda w=w, s=s: fp8_linear(x, w, s, block) for w, s in weights])
    on_kernel = takes_kernel(rows, n)
    tile = list(vars(choose_config(rows, n, k, block, sms)).values()) if on_kernel else "dense"
    report("fp8", shape, fp8_ms, fp8_bytes, fp8_over_bf16=round(fp8_ms / bf16_ms, 3), tile=tile)
    if not on_kernel:  # the kernel where the dense path runs, at the tile of the bucket that covers M
        cfg = choose_config(min(rows, KERNEL_MAX_ROWS), n, k, block, sms)
        ms = timed([lambda w=w, s=s: fp8_linear(x, w, s, block, config=cfg) for w, s in weights])
        report("fp8-kernel", shape, ms, fp8_bytes, fp8_over_bf16=round(ms / bf16_ms, 3), tile=list(vars(cfg).values()))

    def dense_path(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return F.linear(x, dequantize_weight(w, s, block, x.dtype))

    ms = timed([lambda w=w, s=s: dense_path(w, s) for w, s in weights])
    report("fp8-dense", shape, ms, fp8_bytes, fp8_over_bf16=round(ms / bf16_ms, 3))
    if args.sweep:
        for cfg in sweep_configs(rows):
            try:
                ms = timed([lambda w=w, s=s, c=cfg: fp8_linear(x, w, s, block, config=c) for w, s in weights])
            except Exception as exc:  # a tile that does not fit shared memory: report it, go on
                print(json.dumps({"row": "fp8-sweep", "M": rows, "tile": str(cfg), "error": str(exc)[:120]}))
                continue
            report("fp8-sweep", shape, ms, fp8_bytes, tile=list(vars(cfg).values()))
    floor = fp8_bytes / bandwidth * 1e3
    return (
        f"{model:8} {name:20} {n:6}x{k:<6} M={rows:<5} bf16 {bf16_ms:8.4f} ms  fp8 {fp8_ms:8.4f} ms  "
        f"fp8/bf16 {fp8_ms / bf16_ms:5.2f}  fp8 floor {floor:8.4f} ms  fp8/floor {fp8_ms / floor:5.2f}"
    )


def bench_linear(model: str, name: str, n: int, k: int) -> list[str]:
    """Distinct copies of one linear's weight (fp8 and dequantized bf16), every M; the table lines."""
    copies = max(1, min(MAX_COPIES, -(-L2_FLUSH_BYTES // (n * k))))
    weights = []
    for i in range(copies):
        g = torch.Generator(device=dev).manual_seed(i)
        weights.append(quantize(torch.randn(n, k, device=dev, generator=g) * k**-0.5, block))
    dense = [dequantize(w, s, block, torch.bfloat16) for w, s in weights]
    lines = [bench_rows((model, name, n, k, rows), weights, dense) for rows in rows_list]
    del weights, dense
    torch.cuda.empty_cache()
    return lines


bandwidth = copy_bandwidth()
sms = sm_count(dev)
print(json.dumps({"row": "device", "name": torch.cuda.get_device_name(dev), "sms": sms, "copy_GBps": bandwidth / 1e9}))
table: list[str] = []
for model in args.models.split(","):
    for name, n, k in SHAPES[model]:
        if not args.only or any(part in name for part in args.only.split(",")):
            table += bench_linear(model, name, n, k)
print("\n".join(table), file=sys.stderr)
