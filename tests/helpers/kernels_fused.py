"""The eager references of the fused RMSNorm, rope and MLP kernels, shared by their CPU and GPU tests."""

from __future__ import annotations

import torch

from afd.kernels import eager_ops
from afd.model.attention_side import RMSNorm, apply_rope  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


def _eager(fn, *args, **kwargs):
    """`fn` (afd.model.attention_side code) on the eager path whatever the device: the oracle."""
    with eager_ops():
        return fn(*args, **kwargs)


def _eager_rope(x, cos, sin, interleave):
    return _eager(apply_rope, x, cos, sin, interleave)


def _norm(dim: int, dtype: torch.dtype, device: torch.device) -> RMSNorm:
    norm = RMSNorm(dim, 1e-6).to(device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(dim))
    return norm


def _cos_sin(T: int, half: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = torch.arange(T, dtype=torch.float32)[:, None] * (10000.0 ** (-torch.arange(half) / half))[None, :]
    return freqs.cos().to(device) * 1.1, freqs.sin().to(device) * 1.1  # [T, R/2], a YaRN-like factor
