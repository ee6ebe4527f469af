"""Experts and routings for the MoE layer's tests, CPU and GPU."""

from __future__ import annotations

import torch

import afd.model.moe as moe
from afd.model.moe import select_experts


def _experts(E: int, H: int, inter: int, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    w13 = torch.randn(E, 2 * inter, H, generator=g, device=device) * H**-0.5
    w2 = torch.randn(E, H, inter, generator=g, device=device) * inter**-0.5
    return w13.to(dtype), w2.to(dtype)


def _routing(T: int, E: int, K: int, device: str = "cpu", seed: int = 0) -> moe.Routing:
    g = torch.Generator(device=device).manual_seed(seed)
    return select_experts(torch.randn(T, E, generator=g, device=device), top_k=K, norm_topk_prob=True)
