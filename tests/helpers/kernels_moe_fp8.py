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


def dequantized_rows(x: torch.Tensor, group: int) -> torch.Tensor:
    """What fp8 rows stand for: `quantize_row_groups(x, group)`, then each value times its group's scale (fp32)."""
    from afd.kernels.moe_tiles import quantize_row_groups

    q, scale = quantize_row_groups(x, group)
    return q.float() * scale.repeat_interleave(group, dim=1)[:, : x.shape[1]]


def _expert_on_fp8_rows(w13: torch.Tensor, w2: torch.Tensor, rows: torch.Tensor, group: int, act_dtype) -> torch.Tensor:
    """One expert (fp32 weights `[2I, H]`, `[H, I]`) on rows already quantized, its SwiGLU output rounded to
    `act_dtype` and quantized per row as the kernels do: [n, H] fp32."""
    gate, up = (rows @ w13.T).chunk(2, dim=-1)  # [n, I] each
    act = (torch.nn.functional.silu(gate) * up).to(act_dtype)
    return dequantized_rows(act, group) @ w2.T


def fp8_rows_routed_reference(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, q: FP8Experts, expert_start: int = 0
) -> torch.Tensor:
    """What the fused kernels compute for FP8 experts, as an eager loop over the local experts in fp32: x [T, H] and
    each pair's SwiGLU output quantized per row in groups of b1 (fp8 rows), the weights dequantized -> [T, H] fp32."""
    w13, w2 = q.dequantized(torch.float32)
    rows = dequantized_rows(x, q.block[1])  # [T, H] fp32
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(w13.shape[0]):
        t, k = (topk_ids == expert_start + e).nonzero(as_tuple=True)
        if t.numel():
            y = _expert_on_fp8_rows(w13[e], w2[e], rows[t], q.block[1], x.dtype)  # [n, H]
            out.index_add_(0, t, y * topk_weights[t, k].float()[:, None])
    return out


def fp8_rows_grouped_reference(x: torch.Tensor, group_sizes: list[int], q: FP8Experts) -> torch.Tensor:
    """The grouped (async) form of `fp8_rows_routed_reference`: `group_sizes[e]` consecutive rows of x per expert,
    unweighted -> [sum(group_sizes), H] fp32."""
    w13, w2 = q.dequantized(torch.float32)
    rows = dequantized_rows(x[: sum(group_sizes)], q.block[1])
    ends = torch.tensor(group_sizes).cumsum(0).tolist()
    parts = [
        _expert_on_fp8_rows(w13[e], w2[e], rows[end - n : end], q.block[1], x.dtype)
        for e, (n, end) in enumerate(zip(group_sizes, ends, strict=True))
    ]
    return torch.cat(parts)
