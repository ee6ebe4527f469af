"""Experts and routings for the MoE kernels' tests, CPU and GPU."""

from __future__ import annotations

import torch

import afd.model.moe as moe  # noqa: E402
from afd.model.moe import select_experts  # noqa: E402

E, H, INTER = 8, 64, 48  # tiny CPU shapes: H and I not multiples of the default 64/128 tiles


def _experts(num_experts: int, hidden: int, inter: int, dtype=torch.float32, device="cpu", seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g, device=device) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g, device=device) * inter**-0.5
    return w13.to(dtype), w2.to(dtype)


def _routing(T: int, num_experts: int, K: int, device="cpu", seed: int = 0) -> moe.Routing:
    g = torch.Generator(device=device).manual_seed(seed)
    return select_experts(torch.randn(T, num_experts, generator=g, device=device), top_k=K, norm_topk_prob=True)
