"""A quantized model against the same model unquantized: mean / max |Δp| at the reference's greedy token over every
position, and argmax agreement with the same quantized weights run dequantized (kernels off) where that run's top-2
margin is above `--margin` (`afd.bench.quant_numerics`), and the same agreement for the 16-bit model's kernels
against its eager ops (`unquantized_*`: the floor the quantized kernels' figure can reach).

    PYTHONPATH=src python3 scripts/quant_numerics.py [--model deepseek-v2-lite] [--dtype bfloat16] [--device cuda]
        [--prompts 16] [--prompt-len 257] [--margin 0.01] [--json F]

FP8's target (V2-Lite shapes, bf16 compute, >= 4,096 positions): mean |Δp| <= 5e-3 against the 16-bit model, tokens
equal to the dequantized run's wherever decided.
Prints one JSON line.
"""
# ruff: noqa: T201  (a script that prints its result)

from __future__ import annotations

import argparse
import json

from afd.bench.quant_numerics import quantization_numerics

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model", default="deepseek-v2-lite")
parser.add_argument("--quantization", default="fp8")
parser.add_argument("--dtype", default="bfloat16")
parser.add_argument("--device", default="cuda")
parser.add_argument("--prompts", type=int, default=16)
parser.add_argument("--prompt-len", type=int, default=257)
parser.add_argument("--margin", type=float, default=1e-2)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--json")
args = parser.parse_args()
result = quantization_numerics(
    args.model, quantization=args.quantization, dtype=args.dtype, device=args.device, prompts=args.prompts,
    prompt_len=args.prompt_len, margin=args.margin, seed=args.seed,
)  # fmt: skip
print(json.dumps(result))
if args.json:
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
