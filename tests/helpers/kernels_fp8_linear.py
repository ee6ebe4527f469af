"""FP8 linear weights for the fp8 linear kernel's tests, CPU and GPU: random, each block of its own magnitude."""

from __future__ import annotations

import torch

from afd.model.fp8 import quantize
from helpers.kernels_moe_fp8 import _spread


def fp8_weight(
    out_features: int, in_features: int, block: tuple[int, int], device: str = "cpu", seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(W_fp8 [N, K], scale [ceil(N/b0), ceil(K/b1)])` of a random weight whose blocks are scaled by powers of two
    in [1/8, 8] (`_spread`): a scale read from the wrong block changes the result by far more than rounding."""
    g = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g, device=device) * in_features**-0.5
    return quantize(_spread(w[None], block, g)[0], block)
