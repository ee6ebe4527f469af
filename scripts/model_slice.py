"""An afd command on the first layers of a preset too big for one GPU (DeepSeek-V3's 671B): `afd bench step` of its
real layer shapes, bf16 against FP8 in one run, or `afd profile` of its parts.

    python3 scripts/model_slice.py --model deepseek-v3 --layers 4 --dense-layers 1 -- bench step \
        --dtype bfloat16 --device cuda --batch 8,64,256 --context 512 --prefill 4x1024 --quantization fp8
    python3 scripts/model_slice.py --model deepseek-v3 --layers 4 --dense-layers 1 -- profile \
        --dtype bfloat16 --device cuda --no-exchange --no-calibration -o v3_layers.json

The slice is the preset's config with `num_hidden_layers` and `first_k_dense_replace` replaced, registered as a
preset of its own name in this process (seeded random weights, as every preset), its `quantization_config` dropped:
bf16 weights, so that `--quantization fp8` quantizes them at load and both rows come from one set of weights.
Everything after `--` is the afd command line, `--model` added; it must run in this process (no launched ranks:
`bench step`, `profile --no-exchange --no-calibration`). What a layer costs scales to the whole model by its layer
counts; a memory floor is the slice's.
"""

from __future__ import annotations

import argparse
import sys

from afd.cli.main import main as afd_main
from afd.model.presets import PRESETS


def slice_preset(model: str, layers: int, dense_layers: int) -> str:
    """Register `model`'s first `layers` layers (`dense_layers` of them dense) as a preset; its name."""
    config = dict(PRESETS[model])
    if not 0 <= dense_layers < layers <= config["num_hidden_layers"]:
        raise SystemExit(f"--layers {layers} --dense-layers {dense_layers}: need 0 <= dense < layers <= the model's")
    config.update(num_hidden_layers=layers, first_k_dense_replace=dense_layers)
    config.pop("quantization_config", None)
    name = f"{model}-first-{layers}-layers"
    PRESETS[name] = config
    return name


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="deepseek-v3", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int, default=4, help="decoder layers in the slice")
    p.add_argument("--dense-layers", type=int, default=1, help="of them, dense MLP layers (the rest MoE)")
    args, rest = p.parse_known_args()
    command = [a for a in rest if a != "--"]
    subcommand = command[:2] if command[:1] == ["bench"] else command[:1]
    if not subcommand:
        raise SystemExit("give the afd command after --, e.g. -- bench step --device cuda")
    name = slice_preset(args.model, args.layers, args.dense_layers)
    return afd_main([*subcommand, "--model", name, *command[len(subcommand) :]])


if __name__ == "__main__":
    sys.exit(main())
