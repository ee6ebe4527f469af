"""Sweep the MLA decode kernel's launch parameters at decode shapes (DeepSeek-V2-Lite, bf16, one H200).

One JSON line per point on stdout: batch, context, the block table's width, splits, block_n, warps, stages,
microseconds per call (mean of calls captured in a CUDA graph, replayed between two events), the latent bytes read
per call and GB/s, and the largest difference from the default launch. The cache is read as the engine lays it out:
scattered blocks of 16 rows through a block table, once as wide as the context and once as wide as the engine's
CUDA graphs make it (4,096 tokens), where the split count follows the table's width, not the context.
Run: python scripts/gpu_mla_sweep.py [--quick | --default] > OUT.jsonl; python scripts/gpu_mla_sweep.py --summary OUT
(`--default`: the default launch alone at every shape, e.g. to compare two trees.)
"""

from __future__ import annotations

import functools
import itertools
import json
import sys

import torch

from afd.kernels.mla_decode import mla_decode, num_splits_for
from afd.profiling.graph_timing import graph_ms

NH, C, R, BLOCK = 16, 512, 64, 16


GRAPH_WIDTH = 4096 // BLOCK  # blocks a CUDA graph's table holds (the engine's default max_model_len)


def case(batch: int, context: int, width: int, gen: torch.Generator) -> tuple:
    """q_latent, q_pe, cache, table [batch, width] of scattered blocks (0, the null block, past the context), lens."""
    used = context // BLOCK
    blocks = batch * used + 1
    cache = torch.randn(blocks * BLOCK, C + R, generator=gen).to("cuda", torch.bfloat16)  # [rows, C + R]
    table = torch.zeros(batch, width, dtype=torch.int64)
    table[:, :used] = (torch.randperm(blocks - 1, generator=gen) + 1).view(batch, used)
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q_latent = torch.randn(batch, NH, C, generator=gen).to("cuda", torch.bfloat16)
    q_pe = torch.randn(batch, NH, R, generator=gen).to("cuda", torch.bfloat16)
    return q_latent, q_pe, cache, table.cuda(), lens


def summarize(path: str) -> None:
    """The default launch's point and the fastest point of every shape in a sweep's output."""
    best: dict[tuple[int, int, int], dict] = {}
    for line in open(path):
        r = json.loads(line)
        if "us" not in r:
            continue
        key = (r["batch"], r["context"], r["width"])
        if r["default"]:
            print("default", r)
        elif key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    for r in best.values():
        print("best", r)


def main() -> None:
    if "--summary" in sys.argv:
        return summarize(sys.argv[sys.argv.index("--summary") + 1])
    quick, default_only = "--quick" in sys.argv, "--default" in sys.argv
    gen = torch.Generator().manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = [(8, 512), (64, 512), (256, 512), (8, 4096), (64, 4096), (256, 4096)] if not quick else [(256, 512)]
    for batch, context in shapes:
        for width in sorted({context // BLOCK, GRAPH_WIDTH}):
            q_latent, q_pe, cache, table, lens = case(batch, context, width, gen)
            args = (q_latent, q_pe, cache, table, lens, 1 / (192**0.5))
            ref = mla_decode(*args, page=BLOCK).float()
            points = [{}] + ([] if default_only else [
                dict(num_splits=splits, block_n=block_n, num_warps=warps, num_stages=stages)
                for splits, block_n, warps, stages in itertools.product(
                    sorted({1, 2, 4, 8, num_splits_for(batch, 1, width * BLOCK, sms)[0]}), (32, 64), (4, 8), (2, 3)
                )
            ])  # fmt: skip
            nbytes = batch * context * (C + R) * 2
            for kwargs in points:
                try:
                    out = mla_decode(*args, page=BLOCK, **kwargs)
                    us = graph_ms(functools.partial(mla_decode, *args, page=BLOCK, **kwargs), reps=20, rounds=10) * 1e3
                    diff = (out.float() - ref).abs().max().item()
                    point = {"us": round(us, 2), "GBps": round(nbytes / us / 1e3, 1), "max_diff": diff}
                except Exception as exc:  # noqa: BLE001 - a launch that does not fit (shared memory) is a data point
                    point = {"error": f"{type(exc).__name__}: {str(exc)[:120]}"}
                row = {"batch": batch, "context": context, "width": width, "default": not kwargs, **kwargs}
                print(json.dumps({**row, "bytes": nbytes, **point}), flush=True)


if __name__ == "__main__":
    main()
