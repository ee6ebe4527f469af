"""FP8 experts for the fp8 MoE kernels' tests, CPU and GPU: random experts whose blocks differ in magnitude."""

from __future__ import annotations

import torch

from afd.model.fp8 import FP8Experts, quantize_experts
from helpers.kernels_moe import _experts


def _spread(w: torch.Tensor, block: tuple[int, int], g: torch.Generator) -> torch.Tensor:
    """`w [E, out, in]` with each `block` of it times its own power of two in [1/8, 8]: block scales then differ by
    up to 64x, so a scale read from the wrong block shows in the result."""
    num, out, inp = w.shape
    n0, n1 = -(-out // block[0]), -(-inp // block[1])
    f = 2.0 ** torch.randint(-3, 4, (num, n0, n1), generator=g, device=w.device).float()
    f = f.repeat_interleave(block[0], dim=1)[:, :out].repeat_interleave(block[1], dim=2)[:, :, :inp]
    return w * f


def fp8_experts(
    num_experts: int, hidden: int, inter: int, block: tuple[int, int], device: str = "cpu", seed: int = 0
) -> FP8Experts:
    """Experts `w13 [E, 2I, H]`, `w2 [E, H, I]` quantized in `block` blocks (gate and up apart, as checkpoints
    store them), block magnitudes spread (`_spread`)."""
    w13, w2 = _experts(num_experts, hidden, inter, device=device, seed=seed)
    g = torch.Generator(device=device).manual_seed(seed + 1)
    gate, up = _spread(w13[:, :inter], block, g), _spread(w13[:, inter:], block, g)
    return quantize_experts(torch.cat([gate, up], dim=1), _spread(w2, block, g), block)
