"""The eager references of the fused RMSNorm, rope and MLP kernels, shared by their CPU and GPU tests."""

from __future__ import annotations

import os

import torch

from afd.model.attention_side import RMSNorm, apply_rope  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


def _eager(fn, *args, **kwargs):
    """`fn` (afd.model.attention_side code) on the eager path whatever the device: the oracle."""
    old = os.environ.get("AFD_DISABLE_TRITON")
    os.environ["AFD_DISABLE_TRITON"] = "1"
    try:
        return fn(*args, **kwargs)
    finally:
        if old is None:
            del os.environ["AFD_DISABLE_TRITON"]
        else:
            os.environ["AFD_DISABLE_TRITON"] = old


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
