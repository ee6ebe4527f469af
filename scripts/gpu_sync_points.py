"""Where a serving engine's host waits for the device: every synchronizing CUDA call made while stepping
(`torch.cuda.set_sync_debug_mode`), counted by its call sites in afd, over a burst of requests shaped like the
mixed workload (one GPU, seeded random weights, the serving defaults, warmed up as a server is). A step launched
ahead of its predecessor's tokens only pays off if its launch never waits: any site listed outside the reading of
sampled tokens stalls the host for the rest of the step in flight. Also prints the replica's step summary (host and
device time per step holding prompt tokens). `--cprofile N`: then a second burst of the same requests under cProfile,
its N costliest functions by own time and by cumulative time (the host's time per step, where it goes).

    PYTHONPATH=src python3 scripts/gpu_sync_points.py [--model deepseek-v2-lite] [--requests 256] [--budget 8192]
"""
# ruff: noqa: T201  (a script that prints its results)

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import os
import pstats
import traceback
import warnings

import torch

from afd.engine.engine import Engine, LocalExchange
from afd.engine.request import Request
from afd.engine.warm_up import warm_up_engine
from afd.model.weights import load_attention_model, load_ffn_model
from afd.runtime.online import step_summary

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="deepseek-v2-lite")
parser.add_argument("--requests", type=int, default=256)
parser.add_argument("--short-len", type=int, default=64)
parser.add_argument("--long-len", type=int, default=1024)
parser.add_argument("--max-tokens", type=int, default=64)
parser.add_argument("--budget", type=int, default=8192, help="max_num_batched_tokens")
parser.add_argument("--max-num-seqs", type=int, default=1024)
parser.add_argument("--frames", type=int, default=4, help="afd frames shown per call site")
parser.add_argument("--cprofile", type=int, default=0, help="functions shown of a profiled second burst")
args = parser.parse_args()

attn = load_attention_model(args.model, dtype="bfloat16", device="cuda")
ffn = load_ffn_model(args.model, dtype="bfloat16", device="cuda")
engine = Engine(attn, LocalExchange(ffn), args.budget, max_num_seqs=args.max_num_seqs, max_model_len=4096)
warm_up_engine(engine)
gen = torch.Generator().manual_seed(0)
vocab = attn.config.vocab_size


def add_burst() -> None:
    for _ in range(args.requests):  # prompt lengths uniform between the two, as the mixed workload draws them
        n = int(torch.randint(args.short_len, args.long_len + 1, (1,), generator=gen))
        engine.add(Request(torch.randint(0, vocab, (n,), generator=gen).tolist(), args.max_tokens))


add_burst()

package = os.path.dirname(os.path.dirname(os.path.abspath(__import__("afd").__file__)))
sites: collections.Counter[str] = collections.Counter()


def on_warning(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ARG001
    """warnings.showwarning: a synchronizing call, keyed by the afd frames that made it."""
    frames = [f for f in traceback.extract_stack()[:-1] if f.filename.startswith(package) and "/afd/" in f.filename]
    where = " <- ".join(f"{os.path.relpath(f.filename, package)}:{f.lineno} {f.name}" for f in frames[::-1])
    sites[f"{str(message).splitlines()[0][:70]} | {' <- '.join(where.split(' <- ')[: args.frames])}"] += 1


warnings.showwarning = on_warning
warnings.simplefilter("always")
torch.cuda.synchronize()
steps = 0
torch.cuda.set_sync_debug_mode("warn")
while engine.has_work():
    engine.step()
    steps += 1
torch.cuda.set_sync_debug_mode(0)
print(f"{steps} engine.step() calls, {sum(sites.values())} synchronizing calls at {len(sites)} sites:")
for site, count in sites.most_common():
    print(f"{count:6d}  {site}")
print(step_summary(engine))
if args.cprofile:
    add_burst()
    torch.cuda.synchronize()
    profile = cProfile.Profile()
    profile.enable()
    while engine.has_work():
        engine.step()
    profile.disable()
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats(order).print_stats(args.cprofile)
        print(text.getvalue())
