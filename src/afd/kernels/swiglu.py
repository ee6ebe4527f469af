"""SwiGLU's elementwise half in one launch: `silu(gate) * up` from the output of one gate/up GEMM.

Replaces `F.silu(g)` and `* u` (two kernels and a round trip of [T, I] through memory) with one kernel that reads
each input once. Numerics are those of the eager pair: silu as PyTorch's CUDA kernel computes it,
`g / (1 + exp(-g))` in fp32 with IEEE division and the CUDA math library's `expf` (libdevice; `tl.exp` would be
the faster approximate one), rounded to the input dtype; then the product in fp32, rounded once. So for equal
inputs the output is bitwise the eager one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _silu_mul_kernel(
    gate_ptr,
    up_ptr,
    out_ptr,
    N,
    stride_gate,
    stride_up,
    stride_out,
    PRECISE_EXP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    is_col = cols < N
    g = tl.load(gate_ptr + row * stride_gate + cols, mask=is_col, other=0.0)
    u = tl.load(up_ptr + row * stride_up + cols, mask=is_col, other=0.0)
    gf = g.to(tl.float32)
    if PRECISE_EXP:
        e = libdevice.exp(-gf)
    else:
        e = tl.exp(-gf)
    silu = tl.math.div_rn(gf, 1.0 + e).to(g.dtype)  # F.silu's output, in the input dtype
    y = silu.to(tl.float32) * u.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=is_col)


# Triton's CPU interpreter (TRITON_INTERPRET=1 when the kernel was defined) has no libdevice; numpy's exp stands in
# there, which only the fp32 CPU tests see.
_PRECISE_EXP = isinstance(_silu_mul_kernel, triton.runtime.JITFunction)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gate, up: [T, I] (rows may be strided, e.g. the two halves of a [T, 2I] GEMM output) -> [T, I] contiguous.

    Same dtype for both inputs (fp32/bf16/fp16); the output has it too.
    """
    if gate.shape != up.shape or gate.dim() != 2 or gate.dtype != up.dtype:
        raise ValueError(
            f"silu_mul needs two [T, I] of one dtype, got {tuple(gate.shape)} {gate.dtype} and "
            f"{tuple(up.shape)} {up.dtype}"
        )
    if gate.stride(-1) != 1:
        gate = gate.contiguous()
    if up.stride(-1) != 1:
        up = up.contiguous()
    T, N = gate.shape
    if out is None:
        out = torch.empty(T, N, dtype=gate.dtype, device=gate.device)
    elif out.shape != gate.shape or out.dtype != gate.dtype or out.stride(-1) != 1:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} does not match gate {tuple(gate.shape)} {gate.dtype}")
    if T == 0 or N == 0:
        return out
    BLOCK = min(1024, triton.next_power_of_2(N))
    _silu_mul_kernel[(T, triton.cdiv(N, BLOCK))](
        gate,
        up,
        out,
        N,
        gate.stride(0),
        up.stride(0),
        out.stride(0),
        PRECISE_EXP=_PRECISE_EXP,
        BLOCK=BLOCK,
        num_warps=4,
        enable_fp_fusion=False,
    )
    return out


def swiglu(x: torch.Tensor, gate_up_weight: torch.Tensor) -> torch.Tensor:
    """x: [..., H], gate_up_weight: [2I, H] (gate rows, then up rows) -> silu(x Wg^T) * (x Wu^T): [..., I].

    One GEMM for both projections, then `silu_mul` on its two halves.
    """
    inter = gate_up_weight.shape[0] // 2
    gate_up = torch.nn.functional.linear(x.reshape(-1, x.shape[-1]), gate_up_weight)  # [T, 2I]
    return silu_mul(gate_up[:, :inter], gate_up[:, inter:]).view(*x.shape[:-1], inter)
