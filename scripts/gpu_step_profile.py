"""Where a graphed decode step's GPU time goes: kernels by device time over a few replays (torch.profiler).

PYTHONPATH=src python3 scripts/gpu_step_profile.py [--model deepseek-v2-lite] [--batch 8,256] [--context 512]
    [--quantization fp8] [--eager] [--rows 24] [--trace DIR]

`--trace DIR` writes each profiled step's Chrome trace (`DIR/<graph|eager>_b<batch>.json`), whose kernels in order
show one layer's launches and the gaps between them.
"""
# ruff: noqa: T201  (a script that prints its results)

from __future__ import annotations

import argparse
import os

import torch
from torch.profiler import ProfilerActivity, profile

from afd.bench.step import _drop_all, _seed_decodes
from afd.engine.engine import Engine, LocalExchange
from afd.model.weights import load_attention_model, load_ffn_model

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="deepseek-v2-lite")
parser.add_argument("--batch", default="8,256")
parser.add_argument("--context", type=int, default=512)
parser.add_argument("--quantization", choices=["fp8"], default=None)
parser.add_argument("--eager", action="store_true", help="profile the eager step too")
parser.add_argument("--rows", type=int, default=24, help="kernels listed per table")
parser.add_argument("--trace", default=None, help="write each profile's Chrome trace into this directory")
args = parser.parse_args()
batches = [int(b) for b in args.batch.split(",")]
attn = load_attention_model(args.model, dtype="bfloat16", device="cuda", quantization=args.quantization)
ffn = load_ffn_model(args.model, dtype="bfloat16", device="cuda", quantization=args.quantization)
blocks = max(batches) * (args.context // 16 + 4)
engine = Engine(attn, LocalExchange(ffn), 8192, max_num_seqs=max(batches), num_blocks=blocks, max_model_len=4096)
engine.kv_cache.cache[:, 16:-1].normal_()
gen = torch.Generator().manual_seed(0)
runner = engine.cuda_graphs
for batch in batches:
    for label, graphs in (("graph", runner), ("eager", None))[: 2 if args.eager else 1]:
        engine.cuda_graphs = graphs
        _seed_decodes(engine, [args.context] * batch, 12, gen)
        for _ in range(3):
            engine.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                engine.step()
            torch.cuda.synchronize()
        print(f"=== {label} decode, batch {batch}, context {args.context}: 3 steps, kernels by device time")
        averages = prof.key_averages()
        table = averages.table(sort_by="self_device_time_total", row_limit=args.rows, max_name_column_width=80)
        print(table)
        if args.trace:
            os.makedirs(args.trace, exist_ok=True)
            prof.export_chrome_trace(os.path.join(args.trace, f"{label}_b{batch}.json"))
        _drop_all(engine)
