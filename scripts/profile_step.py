"""Where an engine step's time goes: the single-process reference on one GPU, with torch.profiler.

python scripts/profile_step.py [--model deepseek-v2-lite] [--dtype bfloat16] [--prompts 8] [--len 512]
"""

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from afd.engine.engine import Engine, LocalExchange, Request
from afd.model.weights import load_attention_model, load_ffn_model

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="deepseek-v2-lite")
parser.add_argument("--dtype", default="bfloat16")
parser.add_argument("--prompts", type=int, default=8)
parser.add_argument("--len", type=int, default=512)
parser.add_argument("--steps", type=int, default=32)
args = parser.parse_args()

load = dict(dtype=args.dtype, device="cuda")
attn, ffn = load_attention_model(args.model, **load), load_ffn_model(args.model, **load)
engine = Engine(attn, LocalExchange(ffn), args.prompts * args.len)
g = torch.Generator().manual_seed(0)
for _ in range(args.prompts):
    ids = torch.randint(0, attn.config.vocab_size, (args.len,), generator=g).tolist()
    engine.add(Request(ids, args.steps + 8))
torch.cuda.synchronize()
t = time.perf_counter()
engine.step()  # prefill
torch.cuda.synchronize()
print(f"prefill of {args.prompts}x{args.len} tokens: {(time.perf_counter() - t) * 1e3:.1f} ms")
for _ in range(3):
    engine.step()
torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(args.steps):
    engine.step()
torch.cuda.synchronize()
dt = (time.perf_counter() - t) / args.steps
print(f"decode step ({args.prompts} sequences): {dt * 1e3:.1f} ms -> {args.prompts / dt:.1f} tok/s")
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=60))
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60))
