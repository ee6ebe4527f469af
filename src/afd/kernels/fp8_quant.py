"""Activations quantized per row in groups of `group` columns, in one launch: the fp8 rows of the FP8 MoE kernels.

Why: `moe_tiles.quantize_row_groups` (its PyTorch reference, and the CPU path) is some eight elementwise and
reduction launches; the FP8 MoE quantizes twice a layer (its input, then the SwiGLU output), so at decode sizes
inside a CUDA graph those launches cost about what the weights the layer reads at one token do (FP8 experts at one
token: 0.063 ms a layer against bf16's 0.037). Here one program per (row, group) loads the group, takes its amax
and writes the e4m3 values and the fp32 scale, computed as the reference computes them (fp32 amax, `amax / 448`,
round-to-nearest division, round-to-nearest-even conversion), so that the bits agree; only on a GPU: Triton's CPU
interpreter converts fp32 to e4m3 wrongly (126.2 became 64), so the CPU test stops before the cast
(tests/kernels/test_kernel_moe_fp8.py).

`quantize_rows` is what the kernels call: this launch on a GPU (bit for bit the reference there,
tests/e2e/test_kernel_moe_fp8_gpu.py), the reference elsewhere. On one H200 the FP8 experts at one token went from
0.063 to 0.033 ms a layer (bf16: 0.036; docs/performance.md, "FP8 against bf16").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from afd.kernels import moe_tiles
from afd.kernels.moe_tiles import FP8_DTYPE, FP8_MAX


@triton.jit
def _quantize_kernel(
    x_ptr,  # [N, K] 16/32-bit rows
    q_ptr,  # [N, K] float8_e4m3fn out
    s_ptr,  # [N, ceil(K / GROUP)] fp32 out
    rows,
    width,
    stride_xm,
    stride_qm,
    stride_sm,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,  # GROUP rounded up to a power of two
    ROWS: tl.constexpr,  # rows per program
    FMAX: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [R]
    g = tl.program_id(1)
    lane = tl.arange(0, BLOCK)
    cols = g * GROUP + lane  # [B]
    mask = (row < rows)[:, None] & ((lane < GROUP) & (cols < width))[None, :]  # [R, B]
    x = tl.load(x_ptr + row[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)  # [R]
    scale = tl.where(amax > 0, amax / FMAX, 1.0)
    q = tl.clamp(tl.math.div_rn(x, scale[:, None]), -FMAX, FMAX)
    tl.store(q_ptr + row[:, None] * stride_qm + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_sm + g, scale, mask=row < rows)


def _rows_per_program(rows: int) -> int:
    """One row a program up to 256 rows (decode: as many programs as rows), 16 past it: a program of one 128-wide
    group moves too few bytes to cover its launch at prefill sizes."""
    return 1 if rows <= 256 else 16


def quantize_row_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe_tiles.quantize_row_groups` in one launch, rows `x [N, K]` on a GPU: `(x_fp8 [N, K], scale [N,
    ceil(K/group)] fp32)`. Shapes only: capturable in a CUDA graph."""
    rows, width = x.shape
    num_groups = -(-width // group)
    q = torch.empty(rows, width, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(rows, num_groups, dtype=torch.float32, device=x.device)
    if rows and width:
        x = x if x.stride(1) == 1 else x.contiguous()
        per = _rows_per_program(rows)
        _quantize_kernel[(triton.cdiv(rows, per), num_groups)](
            x, q, scale, rows, width, x.stride(0), q.stride(0), scale.stride(0),
            GROUP=group, BLOCK=triton.next_power_of_2(group), ROWS=per, FMAX=FP8_MAX,
        )  # fmt: skip
    return q, scale


def quantize_rows(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(x_fp8, scale)` of rows `x [N, K]` per row and group of `group` columns: `quantize_row_groups` (one launch)
    on a GPU, `moe_tiles.quantize_row_groups` (the PyTorch reference, the same bits) elsewhere."""
    return quantize_row_groups(x, group) if x.is_cuda else moe_tiles.quantize_row_groups(x, group)
