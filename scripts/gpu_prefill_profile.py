"""Where a prefill step's time goes: one step of `batch` prompts of `prompt_len` tokens under torch.profiler,
the top kernels by device time (CUDA) or the top ops by CPU time (CPU), plus the step's wall time.

    PYTHONPATH=src python3 scripts/gpu_prefill_profile.py [--model deepseek-v2-lite] [--batch 8] [--prompt-len 1024]
        [--quantization fp8]
    PYTHONPATH=src python3 scripts/gpu_prefill_profile.py --device cpu --model tiny --batch 2 --prompt-len 16

Weights are the preset's seeded random ones (a step's time does not depend on the values). The first step
warms up (Triton compiles, cuBLAS picks its algorithms); the profiled one is the second.
"""
# ruff: noqa: T201  (a script that prints its results)

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from afd.bench.step import overlap_off
from afd.engine.engine import Engine, LocalExchange, Request
from afd.model.weights import load_attention_model, load_ffn_model

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="deepseek-v2-lite")
parser.add_argument("--device", default="cuda")
parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
parser.add_argument("--batch", type=int, default=8)
parser.add_argument("--prompt-len", type=int, default=1024)
parser.add_argument("--rows", type=int, default=25)
parser.add_argument("--quantization", default=None, help="e.g. fp8: quantize the weights at load")
args = parser.parse_args()
cuda = args.device.startswith("cuda")
dtype = args.dtype or ("bfloat16" if cuda else "float32")
load = dict(dtype=dtype, device=args.device, quantization=args.quantization)
attn = load_attention_model(args.model, **load)
ffn = load_ffn_model(args.model, **load)
tokens = args.batch * args.prompt_len
blocks_per_seq = -(-(args.prompt_len + 1) // 16)
engine = Engine(
    attn,
    LocalExchange(ffn),
    tokens,
    max_num_seqs=args.batch,
    num_blocks=args.batch * blocks_per_seq,
    block_size=16,
    max_model_len=args.prompt_len + 1,
)
gen = torch.Generator().manual_seed(0)


def prefill_step() -> float:
    """One step that prefills every prompt (and samples each one's only token); its wall seconds."""
    for _ in range(args.batch):
        prompt = torch.randint(0, attn.config.vocab_size, (args.prompt_len,), generator=gen).tolist()
        engine.add(Request(prompt, 1))
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    with overlap_off(engine):  # finalized inside the step, so its wall time is the whole step
        engine.step()
    if cuda:
        torch.cuda.synchronize()
    if engine.has_work():
        raise RuntimeError(f"{args.batch} x {args.prompt_len} tokens did not prefill in one step")
    return time.perf_counter() - start


warm = prefill_step()
wall = prefill_step()
activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
with profile(activities=activities) as prof:
    profiled = prefill_step()
sort_by = "self_device_time_total" if cuda else "self_cpu_time_total"
print(
    f"=== prefill {args.batch} x {args.prompt_len} tokens, {args.model} {dtype} on {args.device}: "
    f"warm-up step {warm * 1e3:.1f} ms, step {wall * 1e3:.1f} ms, profiled step {profiled * 1e3:.1f} ms"
)
print(prof.key_averages().table(sort_by=sort_by, row_limit=args.rows, max_name_column_width=80))
