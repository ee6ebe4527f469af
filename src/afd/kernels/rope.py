"""Rotary embedding in one launch: reads x (any row/head strides) and cos/sin once, writes the rotated halves.

Replaces the eager chain of `afd.model.layers.apply_rope` (to fp32, two strided slices, four multiplies, a subtract, an
add, a concatenate and a cast back: ~10 kernels per call) with one. The arithmetic is the eager one, op for op
(`x1 * cos - x2 * sin`, `x2 * cos + x1 * sin` in fp32, no fused multiply-add, one rounding to x.dtype), so the
result is bitwise equal to the eager path.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    NH,
    HALF,
    stride_xt,
    stride_xh,
    stride_ct,
    stride_ot,
    stride_oh,
    INTERLEAVE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    j = tl.arange(0, BLOCK_HALF)  # [BLOCK_HALF] pair index
    is_j = j < HALF
    mask = (heads[:, None] < NH) & is_j[None, :]  # [BLOCK_H, BLOCK_HALF]
    cos = tl.load(cos_ptr + t * stride_ct + j, mask=is_j, other=0.0)[None, :]  # [1, BLOCK_HALF] fp32
    sin = tl.load(sin_ptr + t * stride_ct + j, mask=is_j, other=0.0)[None, :]
    if INTERLEAVE:  # pairs (x[2j], x[2j+1])
        first = 2 * j
        second = 2 * j + 1
    else:  # halves (x[j], x[j + R/2])
        first = j
        second = j + HALF
    x_row = x_ptr + t * stride_xt + heads[:, None] * stride_xh  # [BLOCK_H, 1]
    x1 = tl.load(x_row + first[None, :], mask=mask, other=0.0)
    x2 = tl.load(x_row + second[None, :], mask=mask, other=0.0)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    o1 = x1f * cos - x2f * sin
    o2 = x2f * cos + x1f * sin
    o_row = out_ptr + t * stride_ot + heads[:, None] * stride_oh + j[None, :]  # [BLOCK_H, BLOCK_HALF]
    tl.store(o_row, o1.to(x1.dtype), mask=mask)
    tl.store(o_row + HALF, o2.to(x1.dtype), mask=mask)


def rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x: [T, R] or [T, nh, R] (any strides, last dim unit stride), cos/sin: [T, R/2] fp32 -> [T, (nh,) R] x.dtype.

    The output is laid out as [rotated firsts | rotated seconds]. `out` (same shape, last dim unit stride) may be
    given to write in place, e.g. into the rope part of q, and may be `x` itself: every program reads its own
    elements before it writes them.
    """
    T, R = x.shape[0], x.shape[-1]
    if R % 2 or cos.shape != (T, R // 2) or sin.shape != cos.shape:
        raise ValueError(f"rope of x {tuple(x.shape)} needs cos/sin of shape ({T}, {R // 2}), got {tuple(cos.shape)}")
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    elif out.shape != x.shape or out.dtype != x.dtype:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} does not match x {tuple(x.shape)} {x.dtype}")
    nh = math.prod(x.shape[1:-1])  # 1 for [T, R]
    x3, out3 = x.reshape(T, nh, R), out.view(T, nh, R)  # [T, nh, R]; a strided 3-D view stays a view
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    if out3.stride(-1) != 1:
        raise ValueError("rope writes into an out whose last dim has unit stride")
    cos, sin = cos.float(), sin.float()
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    NH, HALF = x3.shape[1], R // 2
    if T == 0 or NH == 0:
        return out
    BLOCK_HALF = triton.next_power_of_2(HALF)
    BLOCK_H = min(triton.next_power_of_2(NH), max(1, 2048 // BLOCK_HALF))
    _rope_kernel[(T, triton.cdiv(NH, BLOCK_H))](
        x3,
        cos,
        sin,
        out3,
        NH,
        HALF,
        x3.stride(0),
        x3.stride(1),
        cos.stride(0),
        out3.stride(0),
        out3.stride(1),
        INTERLEAVE=interleave,
        BLOCK_H=BLOCK_H,
        BLOCK_HALF=BLOCK_HALF,
        num_warps=4,
        enable_fp_fusion=False,
    )
    return out
