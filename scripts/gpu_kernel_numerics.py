"""The CUDA step with afd's Triton kernels and CUDA graphs against the eager engine (PyTorch ops, no graphs):
per-position |Δp| of the reference's tokens, in one process on one GPU.

    PYTHONPATH=src python3 scripts/gpu_kernel_numerics.py [--model deepseek-v2-lite] [--prompts 16] [--len 384]

Prompt positions are teacher-forced (prefill kernels); generated positions count up to the first token where
the two runs part (decode kernels and graphs). Prints one JSON line.
"""
# ruff: noqa: T201  (a script that prints its results)

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math

import torch

from afd.engine.engine import Engine, LocalExchange, Request
from afd.kernels import eager_ops
from afd.model.weights import load_attention_model, load_ffn_model

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="deepseek-v2-lite")
parser.add_argument("--prompts", type=int, default=16)
parser.add_argument("--len", type=int, default=384)
parser.add_argument("--new", type=int, default=64)
args = parser.parse_args()

attn = load_attention_model(args.model, dtype="bfloat16", device="cuda")
ffn = load_ffn_model(args.model, dtype="bfloat16", device="cuda")
gen = torch.Generator().manual_seed(0)
prompts = [torch.randint(0, attn.config.vocab_size, (args.len,), generator=gen).tolist() for _ in range(args.prompts)]


def run(triton: bool, graphs: bool):
    with contextlib.nullcontext() if triton else eager_ops():
        engine = Engine(attn, LocalExchange(ffn), 8192, max_num_seqs=64, num_blocks=4096, enforce_eager=not graphs)
        for p in prompts:
            engine.add(Request(list(p), args.new, prompt_logprobs=True))
        outputs = engine.run()
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return outputs


def compare(name: str, fast, eager) -> dict:
    prompt_d, gen_d, same_tokens = [], [], 0
    for f, e in zip(fast, eager, strict=True):
        pairs = zip(f.prompt_logprobs[1:], e.prompt_logprobs[1:], strict=True)
        prompt_d += [abs(math.exp(a) - math.exp(b)) for a, b in pairs]
        for tf, te, a, b in zip(f.token_ids, e.token_ids, f.logprobs, e.logprobs, strict=True):
            if tf != te:
                break
            gen_d.append(abs(math.exp(a) - math.exp(b)))
        same_tokens += f.token_ids == e.token_ids
    every = prompt_d + gen_d
    return {
        "compare": name,
        "model": args.model,
        "positions": len(every),
        "prompt_positions": len(prompt_d),
        "generated_positions": len(gen_d),
        "mean_abs_dp": sum(every) / len(every),
        "max_abs_dp": max(every),
        "mean_abs_dp_generated": sum(gen_d) / max(1, len(gen_d)),
        "sequences_with_equal_tokens": same_tokens,
        "sequences": len(fast),
    }


fast, no_graphs, eager = run(True, True), run(True, False), run(False, False)
print(json.dumps(compare("triton+graphs vs eager ops", fast, eager)))
print(json.dumps(compare("triton+graphs vs triton eager", fast, no_graphs)))
print(json.dumps(compare("triton eager vs eager ops", no_graphs, eager)))
