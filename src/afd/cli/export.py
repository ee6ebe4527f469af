"""`afd export --model PRESET DIR`: a preset written as a Hugging Face checkpoint (`afd.model.export`)."""

from __future__ import annotations

import argparse

from afd.cli.input import UsageError, non_negative_int


def add_export_parser(sub) -> None:
    p = sub.add_parser(
        "export",
        help="write a preset as a Hugging Face checkpoint (config.json, model.safetensors, a byte-level tokenizer "
        "with a chat template, generation_config.json) that transformers and vLLM load",
    )
    p.add_argument("--model", required=True, help="the preset")
    p.add_argument("dir", help="the directory to write (new, or empty)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32", help="stored dtype")
    p.add_argument("--seed", type=non_negative_int, default=0, help="seed of the preset's weights")
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    from afd.model.export import export_preset

    try:
        files = export_preset(args.model, args.dir, dtype=args.dtype, seed=args.seed)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    print(f"afd export: {args.model} written to {args.dir} ({', '.join(f.name for f in files)})")
    return 0
