"""The MoE's routed experts alone, bf16 weights against block-scaled FP8 ones, on one GPU: per T, one CUDA graph of
`--layers` MoE layers of distinct weights (so nothing stays in L2), replayed; ms per layer and the touched weights'
bytes per second. Rows: bf16 (afd's Triton kernels at every T, past the engine's `FUSED_MOE_MAX_PAIRS` too),
bf16-engine (what the engine runs on 16-bit experts: those kernels, `torch._grouped_mm` past the bound), fp8 (FP8
weights with fp8 rows: x and the SwiGLU output quantized per row in groups of `--block`, fp8 x fp8 MMAs, what the
engine runs at every T), fp8-dequant (FP8 weights dequantized per call, one Triton pass each, then the 16-bit path:
what the engine ran at prefill sizes before the row tiles, kept as their peer).

    PYTHONPATH=src python3 scripts/gpu_moe_fp8.py [--tokens 1,8,64,256] [--layers 26] [--block 128] [--sweep]
        [--sweep-rows] [--sort]

fp8-decode-tiles and fp8-row-tiles are the fp8 row on each of the two kernel pairs whatever T (afd.kernels.moe_gate_up
/ moe_down, the decode form; afd.kernels.moe_prefill, tiles of rows), which picks `PREFILL_ROWS_PER_EXPERT`;
fp8-row-{gate_up,down}-alone each row-tile kernel alone, with its TFLOP/s.

`--sweep` also times the FP8 kernels over a few tile shapes per T, gate/up's and down's each with the other at the
table's (the table in afd.kernels.moe_tiles was chosen on bf16). `--sweep-rows` does the same for the row tiles
(afd.kernels.moe_prefill's `GATE_UP_TILE`, `DOWN_TILE`). `--sort` times the pairs' counting sort against the argsort
per T (`moe_sort.COUNTING_SORT_MAX_PAIRS`). `--sweep-dequant` times the dequantization pass
alone (both expert weights of every layer, one CUDA graph), at its default tile and over other tile shapes, with the
rate it moves bytes at (fp8 read, bf16 written). Prints one JSON line per row.
"""
# ruff: noqa: T201  (a script that prints its results)

from __future__ import annotations

import argparse
import json

import torch

from afd.kernels.fp8_quant import quantize_rows
from afd.kernels.fused_moe import ExpertScales, fused_routed_experts
from afd.kernels.moe_prefill import DOWN_TILE, GATE_UP_TILE, RowTileConfig, down_rows, gate_up_rows
from afd.kernels.moe_sort import counting_sort_pairs, sort_pairs
from afd.kernels.moe_tiles import (
    TileConfig,
    down_config,
    fit_dtype,
    gate_up_config,
    rows_per_expert_hint,
    tile_bucket,
)
from afd.model.fp8 import quantize_experts
from afd.model.moe import routed_experts, select_experts
from afd.profiling.graph_timing import graph_ms
from afd.routing import sort_pairs_by_expert

parser = argparse.ArgumentParser()
parser.add_argument("--tokens", default="1,8,64,256")
parser.add_argument("--layers", type=int, default=26)
parser.add_argument("--experts", type=int, default=64)
parser.add_argument("--hidden", type=int, default=2048)
parser.add_argument("--inter", type=int, default=1408)
parser.add_argument("--top-k", type=int, default=6)
parser.add_argument("--block", type=int, default=128)
parser.add_argument("--iters", type=int, default=20)
parser.add_argument("--sweep", action="store_true")
parser.add_argument("--sweep-dequant", action="store_true", help="the dequantization pass alone over tile shapes")
parser.add_argument("--sweep-rows", action="store_true", help="the row-tile kernels over tile shapes")
parser.add_argument("--sort", action="store_true", help="the counting sort against the argsort")
args = parser.parse_args()
E, H, INTER, K, block = args.experts, args.hidden, args.inter, args.top_k, (args.block, args.block)
dev = torch.device("cuda")

layers16, layers8 = [], []
for i in range(args.layers):
    g = torch.Generator(device=dev).manual_seed(i)
    w13 = torch.randn(E, 2 * INTER, H, device=dev, generator=g) * H**-0.5
    w2 = torch.randn(E, H, INTER, device=dev, generator=g) * INTER**-0.5
    q = quantize_experts(w13, w2, block)
    layers8.append(q)
    layers16.append(tuple(w.bfloat16() for w in q.dequantized(torch.float32)))
    del w13, w2


def timed(step, T: int) -> float:
    """ms per layer of `step(layer_index, x, ids, weights)` over all layers, captured in one CUDA graph."""
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    r = select_experts(torch.randn(T, E, device=dev), top_k=K, norm_topk_prob=True)
    ids, weights = r.topk_ids, r.topk_weights

    def all_layers():
        return [step(i, x, ids, weights) for i in range(args.layers)]

    return graph_ms(all_layers, reps=1, rounds=args.iters) / args.layers


def touched_bytes(T: int, weight_bytes: float) -> float:
    """Bytes of the experts a batch of T tokens touches under even routing (expected distinct experts)."""
    touched = E * (1 - (1 - K / E) ** T)
    return touched * 3 * H * INTER * weight_bytes


def report(row: str, T: int, ms: float, weight_bytes: float, **extra) -> None:
    gbps = touched_bytes(T, weight_bytes) / (ms * 1e-3) / 1e9
    print(json.dumps({"row": row, "T": T, "ms_per_layer": round(ms, 4), "GBps": round(gbps), **extra}), flush=True)


def fp8_step(configs=None):
    def step(i, x, ids, weights):
        q = layers8[i]
        scales = ExpertScales(q.w13_scale_inv, q.w2_scale_inv, q.block)
        return fused_routed_experts(x, ids, weights, q.w13, q.w2, 0, scales=scales, configs=configs)

    return step


# (block_n, block_k, warps, stages) tried per T by --sweep
SWEEP_SHAPES = [
    (bn, bk, w, st)
    for bn, bk in ((32, 128), (64, 128), (128, 128), (128, 64), (256, 128))
    for w, st in ((4, 3), (4, 5), (8, 4), (4, 8))
]
# (block_n, block_k, warps, stages) also tried with 128 rows a tile where the table's largest row bucket runs
# (prefill sizes: more rows per weight tile read)
WIDE_ROW_SHAPES = [(128, 128, 8, 3), (64, 128, 8, 3), (128, 128, 4, 3), (128, 64, 8, 4)]
scale_bytes = 1 + 4 / (block[0] * block[1])  # one byte per weight plus its share of an fp32 scale
# (rows, columns, warps) of the dequantization pass tried by --sweep-dequant
DEQUANT_SHAPES = [(32, 128, 4), (64, 128, 4), (64, 128, 8), (128, 128, 8), (32, 256, 4), (64, 256, 8), (16, 512, 4)]
if args.sweep_dequant:
    from afd.kernels.fp8_linear import DEQUANT_TILE, dequantize_weight

    def dequant_ms(tile, warps) -> float:
        def all_layers():
            return [
                dequantize_weight(w, s, block, torch.bfloat16, tile=tile, num_warps=warps)
                for q in layers8
                for w, s in ((q.w13, q.w13_scale_inv), (q.w2, q.w2_scale_inv))
            ]

        return graph_ms(all_layers, reps=1, rounds=args.iters) / args.layers

    moved = 3 * E * 3 * H * INTER  # bytes a layer: each weight read as fp8 and written as bf16
    for rows, cols, warps in [(*DEQUANT_TILE, 4), *DEQUANT_SHAPES]:
        ms = dequant_ms((rows, cols), warps)
        print(json.dumps({"row": "dequant", "tile": [rows, cols, warps], "ms_per_layer": round(ms, 4),
                          "GBps": round(moved / (ms * 1e-3) / 1e9)}), flush=True)  # fmt: skip
# (block_m, block_n, block_k, warps, stages) of the row tiles tried by --sweep-rows
ROW_SHAPES = [(128, 128, 128, 8, 3), (64, 128, 128, 8, 3), (64, 128, 128, 8, 4), (128, 64, 128, 8, 3),
              (128, 64, 128, 8, 4), (64, 128, 128, 4, 3), (64, 64, 128, 4, 4), (128, 128, 128, 8, 4),
              (64, 256, 128, 8, 3)]  # fmt: skip


def row_kernels_alone(T: int) -> None:
    """gate/up and down of the row tiles each alone (inputs made outside the graph), ms a layer and TFLOP/s."""
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    ids = select_experts(torch.randn(T, E, device=dev), top_k=K, norm_topk_prob=True).topk_ids
    pair_idx, token_idx, offs = sort_pairs(ids, 0, E)
    rows, x_scale = quantize_rows(x, block[1])
    act, act_scale = quantize_rows(torch.randn(T * K, INTER, device=dev, dtype=torch.bfloat16), block[1])
    out = torch.empty(T * K, H, device=dev)
    group = block[1] if block[1] == GATE_UP_TILE.block_n else None
    kernels = {
        "gate_up": (
            lambda q: gate_up_rows(
                rows, x_scale, offs, q.w13, q.w13_scale_inv, block, token_idx=token_idx, quantize_group=group
            ),
            2,
        ),  # fmt: skip
        "down": (lambda q: down_rows(act, act_scale, offs, q.w2, q.w2_scale_inv, block, out, dest_idx=pair_idx), 1),
    }
    for name, (kernel, parts) in kernels.items():
        ms = graph_ms(lambda kernel=kernel: [kernel(q) for q in layers8], reps=1, rounds=args.iters) / args.layers
        tflops = 2 * T * K * H * INTER * parts / (ms * 1e-3) / 1e12
        print(json.dumps({"row": f"fp8-row-{name}-alone", "T": T, "ms_per_layer": round(ms, 4),
                          "TFLOPs": round(tflops)}), flush=True)  # fmt: skip


def sort_ms(T: int, sort) -> float:
    ids = select_experts(torch.randn(T, E, device=dev), top_k=K, norm_topk_prob=True).topk_ids
    return graph_ms(lambda: [sort(ids) for _ in range(args.layers)], reps=1, rounds=args.iters) / args.layers


for T in [int(t) for t in args.tokens.split(",")]:
    if args.sort:
        counting = sort_ms(T, lambda ids: counting_sort_pairs(ids, 0, E))
        argsort = sort_ms(T, lambda ids: sort_pairs_by_expert(ids, 0, E))
        print(json.dumps({"row": "sort", "T": T, "counting_ms": round(counting, 4), "argsort_ms": round(argsort, 4)}))
        continue
    report("bf16", T, timed(lambda i, x, ids, w: fused_routed_experts(x, ids, w, *layers16[i], 0), T), 2)
    report("bf16-engine", T, timed(lambda i, x, ids, w: routed_experts(x, ids, w, *layers16[i], 0), T), 2)
    report("fp8", T, timed(fp8_step(), T), scale_bytes)
    hint = rows_per_expert_hint(T, K, E)
    table = (fit_dtype(gate_up_config(hint), torch.bfloat16), fit_dtype(down_config(hint), torch.bfloat16))
    report("fp8-decode-tiles", T, timed(fp8_step(table), T), scale_bytes)
    report("fp8-row-tiles", T, timed(fp8_step((GATE_UP_TILE, DOWN_TILE)), T), scale_bytes)
    row_kernels_alone(T)
    if args.sweep_rows:
        for which, kernel in enumerate(("gate_up", "down")):
            for shape in ROW_SHAPES:
                cfg = RowTileConfig(*shape)
                configs = (cfg, DOWN_TILE) if which == 0 else (GATE_UP_TILE, cfg)
                try:
                    ms = timed(fp8_step(configs), T)
                except Exception as exc:  # a shape that does not fit shared memory: report, go on
                    print(json.dumps({"row": "fp8-row-sweep", "T": T, "kernel": kernel, "tile": shape,
                                      "error": str(exc)[:120]}))  # fmt: skip
                    continue
                report("fp8-row-sweep", T, ms, scale_bytes, kernel=kernel, tile=list(shape))
    dq = timed(lambda i, x, ids, w: routed_experts(x, ids, w, *layers8[i].dequantized(torch.bfloat16), 0), T)
    report("fp8-dequant", T, dq, scale_bytes)
    if args.sweep:  # each kernel over tile shapes around the table's row bucket for this T, the other at the table
        bm = tile_bucket(hint)
        wide = [(128, bn, bk, w, st) for bn, bk, w, st in WIDE_ROW_SHAPES] if bm == tile_bucket(1 << 20) else []
        for which, kernel in enumerate(("gate_up", "down")):
            for bm, bn, bk, warps, stages in [(bm, *shape) for shape in SWEEP_SHAPES] + wide:
                cfg = TileConfig(bm, bn, bk, warps, stages)
                configs = (cfg, table[1]) if which == 0 else (table[0], cfg)
                try:
                    ms = timed(fp8_step(configs), T)
                except Exception as exc:  # a shape that does not fit shared memory: report, go on
                    print(json.dumps({"row": "fp8-sweep", "T": T, "kernel": kernel, "tile": str(cfg),
                                      "error": str(exc)[:120]}))  # fmt: skip
                    continue
                report("fp8-sweep", T, ms, scale_bytes, kernel=kernel, tile=[bm, bn, bk, warps, stages])
