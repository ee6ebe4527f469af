"""RMSNorm in one pass: one program per row reads the row once, normalizes in fp32 and writes `weight * x̂`.

Replaces the eager chain `x.float() -> pow -> mean -> add -> rsqrt -> mul -> to(dtype) -> mul weight` (7 kernels,
each re-reading the row) with one launch. Numerics follow `afd.model.layers.RMSNorm` (the `transformers` contract):
the normalized row is cast to the input dtype *before* the multiply by the weight, and that product is taken
in fp32 and rounded once, as PyTorch's bf16 multiply does. Only the order of the fp32 sum of squares differs
from `torch.mean`, so a bf16 output may differ from eager by an ulp where the normalizer lands on a rounding
boundary.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK_N = 32768  # a whole row sits in one program's registers (DeepSeek's widest: 7168)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    N,
    stride_x,
    stride_out,
    inv_n,
    eps,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    is_col = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=is_col, other=0.0)  # [BLOCK_N] input dtype
    xf = x.to(tl.float32)
    mean_sq = tl.sum(xf * xf, axis=0) * inv_n  # torch.mean also multiplies by 1/N
    normed = (xf * tl.math.rsqrt(mean_sq + eps)).to(x.dtype)  # rounded to the input dtype, as eager does
    w = tl.load(w_ptr + cols, mask=is_col, other=0.0)
    y = normed.to(tl.float32) * w.to(tl.float32)  # one fp32 product, rounded once to the output dtype
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=is_col)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., N] (fp32/bf16/fp16, rows may be strided), weight: [N] -> [..., N] contiguous.

    Output dtype is `promote(weight.dtype, x.dtype)`, as `weight * x̂.to(x.dtype)` gives eagerly.
    """
    N = x.shape[-1]
    if weight.shape != (N,):
        raise ValueError(f"weight of shape {tuple(weight.shape)} does not match rows of {N}")
    BLOCK_N = triton.next_power_of_2(N)
    if BLOCK_N > MAX_BLOCK_N:
        raise ValueError(f"rms_norm holds a row in registers, up to {MAX_BLOCK_N} wide; this one is {N}")
    x2 = x if x.dim() == 2 else x.reshape(-1, N)  # [M, N]; a 2-D strided view (kv_c of a split) stays a view
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    M = x2.shape[0]
    if M == 0 or N == 0:
        return out
    num_warps = 4 if BLOCK_N <= 1024 else 8 if BLOCK_N <= 4096 else 16
    _rms_norm_kernel[(M,)](
        x2,
        weight.contiguous(),
        out,
        N,
        x2.stride(0),
        N,
        1.0 / N,
        eps,
        BLOCK_N=BLOCK_N,
        num_warps=num_warps,
        enable_fp_fusion=False,
    )
    return out
