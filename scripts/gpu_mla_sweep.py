"""Sweep the MLA decode kernel's launch parameters at decode shapes (DeepSeek-V2-Lite, bf16, one H200).

One JSON line per point on stdout: batch, context, splits, block_n, warps, stages, microseconds per call (mean
of calls captured in a CUDA graph, replayed between two events), the latent bytes read per call and GB/s, and the
largest difference from the default launch.
Run: python scripts/gpu_mla_sweep.py [--quick] > OUT.jsonl; python scripts/gpu_mla_sweep.py --summary OUT.jsonl
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


def case(batch: int, context: int, gen: torch.Generator) -> tuple:
    blocks = batch * context // BLOCK + 1
    cache = torch.randn(blocks * BLOCK, C + R, generator=gen).to("cuda", torch.bfloat16)  # [rows, C + R]
    order = torch.randperm(blocks - 1, generator=gen)[: batch * context // BLOCK] + 1  # scattered blocks
    rows = (order.view(batch, -1, 1) * BLOCK + torch.arange(BLOCK)).view(batch, context).cuda()  # [B, L]
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q_latent = torch.randn(batch, NH, C, generator=gen).to("cuda", torch.bfloat16)
    q_pe = torch.randn(batch, NH, R, generator=gen).to("cuda", torch.bfloat16)
    return q_latent, q_pe, cache, rows, lens


def summarize(path: str) -> None:
    """The default launch's point and the fastest point of every shape in a sweep's output."""
    best: dict[tuple[int, int], dict] = {}
    for line in open(path):
        r = json.loads(line)
        if "us" not in r:
            continue
        key = (r["batch"], r["context"])
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
        if r["splits"] == r["default_splits"] and r["block_n"] == 32 and r["warps"] == 4 and r["stages"] == 2:
            print("default", r)
    for r in best.values():
        print("best", r)


def main() -> None:
    if "--summary" in sys.argv:
        return summarize(sys.argv[sys.argv.index("--summary") + 1])
    quick = "--quick" in sys.argv
    gen = torch.Generator().manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = [(8, 512), (64, 512), (256, 512), (64, 4096)] if not quick else [(256, 512)]
    for batch, context in shapes:
        q_latent, q_pe, cache, rows, lens = case(batch, context, gen)
        scale = 1 / (192**0.5)
        ref = mla_decode(q_latent, q_pe, cache, rows, lens, scale).float()
        nbytes = batch * context * (C + R) * 2
        default = num_splits_for(batch, 1, context, sms)[0]
        for splits, block_n, warps, stages in itertools.product(
            sorted({1, 2, 4, 8, default}), (32, 64), (4, 8), (2, 3)
        ):
            try:
                kwargs = dict(num_splits=splits, block_n=block_n, num_warps=warps, num_stages=stages)
                args = (q_latent, q_pe, cache, rows, lens, scale)
                out = mla_decode(*args, **kwargs)
                us = graph_ms(functools.partial(mla_decode, *args, **kwargs), reps=20, rounds=10) * 1e3
                diff = (out.float() - ref).abs().max().item()
                point = {"us": round(us, 2), "GBps": round(nbytes / us / 1e3, 1), "max_diff": diff}
            except Exception as exc:  # noqa: BLE001 - a launch that does not fit (shared memory) is a data point
                point = {"error": f"{type(exc).__name__}: {str(exc)[:120]}"}
            row = {
                "batch": batch,
                "context": context,
                "splits": splits,
                "default_splits": default,
                "block_n": block_n,
                "warps": warps,
                "stages": stages,
                "bytes": nbytes,
                **point,
            }
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
