"""`expert_gate_up`: the grouped gate/up projection with SwiGLU, each touched expert's weights streamed once.

Grid (expert, tile of I). A program reads its expert's row range from `offs` (an expert with no rows runs zero
loop iterations and reads no weights), then for each BLOCK_M chunk of its rows streams the gate rows and the up
rows of the same I columns of `w13[e]` (once per chunk; one chunk at decode) and keeps SwiGLU in registers:
`act = silu(x @ w_gate.T) * (x @ w_up.T)`. The weight tile is the MMA's M side and the rows its N side
("swap AB"), so 1..16 rows still fill a tensor-core tile. fp32 accumulation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from afd.kernels.moe_tiles import (
    DTYPES,
    TileConfig,
    dot_precision,
    fit_dtype,
    gate_up_config,
    load_2d,
    rows_per_expert_hint,
)


@triton.jit
def _gate_up_kernel(
    x_ptr,  # [T, H] rows (gathered through token_ptr when HAS_TOKEN_IDX)
    token_ptr,  # [N] int row of x for each grouped row
    offs_ptr,  # [E] int32 cumulative group ends
    w_ptr,  # [E, 2I, H] gate rows then up rows
    act_ptr,  # [N, I] out
    inter,
    hidden,
    stride_xm,
    stride_xk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_am,
    stride_an,
    HAS_TOKEN_IDX: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    e = tl.program_id(0)
    pid_n = tl.program_id(1)
    end = tl.load(offs_ptr + e)
    start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] columns of act = rows of w_gate / w_up
    n_mask = n < inter
    k = tl.arange(0, BLOCK_K)  # [BK]
    w_gate = w_ptr + e.to(tl.int64) * stride_we + n[:, None].to(tl.int64) * stride_wn + k[None, :] * stride_wk
    w_up = w_gate + inter * stride_wn  # [BN, BK] pointers each
    for m0 in range(start, end, BLOCK_M):  # one chunk at decode sizes; none for an expert without rows
        rows = m0 + tl.arange(0, BLOCK_M)  # [BM]
        r_mask = rows < end
        if HAS_TOKEN_IDX:
            src = tl.load(token_ptr + rows, mask=r_mask, other=0).to(tl.int64)
        else:
            src = rows.to(tl.int64)
        x_tile = x_ptr + src[:, None] * stride_xm + k[None, :] * stride_xk  # [BM, BK] pointers
        acc_gate = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k_mask = k0 + k < hidden
            xt = load_2d(x_tile + k0 * stride_xk, r_mask, k_mask, False, EVEN_K)  # [BM, BK]
            wg = load_2d(w_gate + k0 * stride_wk, n_mask, k_mask, EVEN_N, EVEN_K)  # [BN, BK]
            wu = load_2d(w_up + k0 * stride_wk, n_mask, k_mask, EVEN_N, EVEN_K)  # [BN, BK]
            xt_t = tl.trans(xt)  # [BK, BM]
            acc_gate = tl.dot(wg, xt_t, acc_gate, input_precision=PRECISION)  # [BN, BM]
            acc_up = tl.dot(wu, xt_t, acc_up, input_precision=PRECISION)
        act = acc_gate * tl.sigmoid(acc_gate) * acc_up  # [BN, BM] SwiGLU in fp32
        out = act_ptr + rows[None, :].to(tl.int64) * stride_am + n[:, None] * stride_an
        tl.store(out, act.to(act_ptr.dtype.element_ty), mask=r_mask[None, :] & n_mask[:, None])


def check_gate_up(x: torch.Tensor, w13: torch.Tensor) -> tuple[int, int, int]:
    """(E, H, I) of stacked gate/up weights `w13 [E, 2I, H]`, checked against rows `x [., H]`."""
    if x.dtype not in DTYPES or w13.dtype != x.dtype:
        raise ValueError(f"rows {x.dtype}, w13 {w13.dtype}: need one dtype of {DTYPES}")
    num_experts, two_inter, hidden = w13.shape
    if x.shape[-1] != hidden or two_inter % 2:
        raise ValueError(f"x {tuple(x.shape)} and w13 {tuple(w13.shape)} do not fit together")
    return num_experts, hidden, two_inter // 2


def expert_gate_up(
    x: torch.Tensor,
    offs: torch.Tensor,
    w13: torch.Tensor,
    *,
    token_idx: torch.Tensor | None = None,
    rows_hint: int | None = None,
    config: TileConfig | None = None,
) -> torch.Tensor:
    """SwiGLU of grouped rows: `act[r] = silu(x[src] @ w13[e, :I].T) * (x[src] @ w13[e, I:].T)`.

    x: [T, H]; offs: [E] int32 cumulative group ends on x's device (row r belongs to expert e when
    `offs[e-1] <= r < offs[e]`); w13: [E, 2I, H]; token_idx: [N] int, the row of x of each grouped row
    (None: x is already grouped, `src = r`, N = T). Returns act [N, I] in x.dtype; rows at and past `offs[-1]`
    are not written. `rows_hint`: expected largest group (picks the tile table's row), default N / E based.
    """
    num_experts, hidden, inter = check_gate_up(x, w13)
    num_rows = x.shape[0] if token_idx is None else token_idx.shape[0]
    act = x.new_empty(num_rows, inter)  # [N, I]
    if num_rows == 0 or num_experts == 0:
        return act
    cfg = config or fit_dtype(gate_up_config(rows_hint or rows_per_expert_hint(num_rows, 1, num_experts)), x.dtype)
    grid = (num_experts, triton.cdiv(inter, cfg.block_n))
    _gate_up_kernel[grid](
        x,
        token_idx if token_idx is not None else offs,  # unused without HAS_TOKEN_IDX
        offs,
        w13,
        act,
        inter,
        hidden,
        x.stride(0),
        x.stride(1),
        w13.stride(0),
        w13.stride(1),
        w13.stride(2),
        act.stride(0),
        act.stride(1),
        HAS_TOKEN_IDX=token_idx is not None,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        EVEN_N=inter % cfg.block_n == 0,
        EVEN_K=hidden % cfg.block_k == 0,
        PRECISION=dot_precision(x.dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return act
