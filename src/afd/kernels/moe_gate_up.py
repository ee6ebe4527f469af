"""`expert_gate_up`: the grouped gate/up projection with SwiGLU, each touched expert's weights streamed once.

Grid (expert, tile of I). A program reads its expert's row range from `offs` (an expert with no rows runs zero
loop iterations and reads no weights), then for each BLOCK_M chunk of its rows streams the gate rows and the up
rows of the same I columns of `w13[e]` (once per chunk; one chunk at decode) and keeps SwiGLU in registers:
`act = silu(x @ w_gate.T) * (x @ w_up.T)`. The weight tile is the MMA's M side and the rows its N side
("swap AB"), so 1..16 rows still fill a tensor-core tile. fp32 accumulation.

FP8 (`HAS_SCALE`): `w13` float8_e4m3fn with fp32 block scales (gate's scale rows, then up's) and the rows fp8 too,
one fp32 scale per row and K block (`moe_tiles.quantize_row_groups`). Each K step (`moe_tiles.scaled_block_k` keeps
it inside one scale block) takes an fp8 x fp8 MMA and adds it times the weight rows' and the rows' scales, so only
fp8 bytes leave memory, no tile is converted and no dequantized weight is ever written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from afd.kernels.moe_tiles import (
    FP8_DTYPE,
    FP8_MIN_BLOCK_K,
    TileConfig,
    check_fp8_weight,
    check_rows,
    dot_precision,
    fit_dtype,
    gate_up_config,
    load_2d,
    rows_per_expert_hint,
    scaled_block_k,
)


@triton.jit
def _gate_up_kernel(
    x_ptr,  # [T, H] rows (gathered through token_ptr when HAS_TOKEN_IDX), fp8 when HAS_SCALE
    token_ptr,  # [N] int row of x for each grouped row
    offs_ptr,  # [E] int32 cumulative group ends
    w_ptr,  # [E, 2I, H] gate rows then up rows
    act_ptr,  # [N, I] out
    scale_ptr,  # [E, 2 * ceil(I/SCALE_N), ceil(H/SCALE_K)] fp32 (HAS_SCALE): gate's rows from 0, up's from up_scale_row
    x_scale_ptr,  # [T, ceil(H/SCALE_K)] fp32 (HAS_SCALE): one scale per row of x and K block
    inter,
    hidden,
    stride_xm,
    stride_xk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_am,
    stride_an,
    stride_se,
    stride_sn,
    stride_sk,
    stride_xsm,
    stride_xsk,
    up_scale_row,
    HAS_TOKEN_IDX: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    SCALE_N: tl.constexpr,
    SCALE_K: tl.constexpr,
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
    s_gate = scale_ptr + e.to(tl.int64) * stride_se + (n // SCALE_N) * stride_sn  # [BN] (HAS_SCALE only)
    s_up = s_gate + up_scale_row * stride_sn
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
            if HAS_SCALE:  # fp8 x fp8, times this K block's scales: one per weight row, one per x row
                s_k = k0 // SCALE_K
                sg = tl.load(s_gate + s_k * stride_sk, mask=n_mask, other=0.0)  # [BN] fp32
                su = tl.load(s_up + s_k * stride_sk, mask=n_mask, other=0.0)
                sx = tl.load(x_scale_ptr + src * stride_xsm + s_k * stride_xsk, mask=r_mask, other=0.0)  # [BM] fp32
                acc_gate += tl.dot(wg, xt_t) * sg[:, None] * sx[None, :]  # [BN, BM] fp32
                acc_up += tl.dot(wu, xt_t) * su[:, None] * sx[None, :]
            else:
                acc_gate = tl.dot(wg, xt_t, acc_gate, input_precision=PRECISION)  # [BN, BM]
                acc_up = tl.dot(wu, xt_t, acc_up, input_precision=PRECISION)
        act = acc_gate * tl.sigmoid(acc_gate) * acc_up  # [BN, BM] SwiGLU in fp32
        out = act_ptr + rows[None, :].to(tl.int64) * stride_am + n[:, None] * stride_an
        tl.store(out, act.to(act_ptr.dtype.element_ty), mask=r_mask[None, :] & n_mask[:, None])


def check_gate_up(
    x: torch.Tensor,
    w13: torch.Tensor,
    scale: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
    x_scale: torch.Tensor | None = None,
) -> tuple[int, int, int]:
    """(E, H, I) of stacked gate/up weights `w13 [E, 2I, H]`, checked against rows `x [., H]`: w13 in x's dtype,
    or float8_e4m3fn with fp32 `scale [E, 2 * ceil(I/b0), ceil(H/b1)]` in `block`s and fp8 rows with their
    `x_scale [., ceil(H/b1)]` (`moe_tiles.check_rows`)."""
    num_experts, two_inter, hidden = w13.shape
    if x.shape[-1] != hidden or two_inter % 2:
        raise ValueError(f"x {tuple(x.shape)} and w13 {tuple(w13.shape)} do not fit together")
    if w13.dtype == FP8_DTYPE:
        check_fp8_weight(w13, scale, block, 2 * -(-(two_inter // 2) // block[0]) if block else 0, FP8_MIN_BLOCK_K)
    check_rows(x, x_scale, w13, block)
    return num_experts, hidden, two_inter // 2


def expert_gate_up(
    x: torch.Tensor,
    offs: torch.Tensor,
    w13: torch.Tensor,
    *,
    token_idx: torch.Tensor | None = None,
    rows_hint: int | None = None,
    config: TileConfig | None = None,
    scale: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
    x_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """SwiGLU of grouped rows: `act[r] = silu(x[src] @ w13[e, :I].T) * (x[src] @ w13[e, I:].T)`.

    x: [T, H]; offs: [E] int32 cumulative group ends on x's device (row r belongs to expert e when
    `offs[e-1] <= r < offs[e]`); w13: [E, 2I, H]; token_idx: [N] int, the row of x of each grouped row
    (None: x is already grouped, `src = r`, N = T). Returns act [N, I] in `out_dtype` (default: x's dtype, bf16
    for fp8 rows); rows at and past `offs[-1]` are not written. `rows_hint`: expected largest group (picks the
    tile table's row), default N / E based.
    FP8 `w13` (float8_e4m3fn): `w13[e, i, j]` means `w13[e, i, j] * scale[e, r(i), j // b1]` with `block = (b0, b1)`,
    `r(i) = i // b0` for gate rows, `scale.shape[1] // 2 + (i - I) // b0` for up rows, and takes fp8 rows: `x`
    float8_e4m3fn with fp32 `x_scale [T, ceil(H/b1)]` (`quantize_row_groups(x, b1)`), `x[t, j]` meaning
    `x[t, j] * x_scale[t, j // b1]`.
    """
    num_experts, hidden, inter = check_gate_up(x, w13, scale, block, x_scale)
    num_rows = x.shape[0] if token_idx is None else token_idx.shape[0]
    out_dtype = out_dtype or (torch.bfloat16 if x.dtype == FP8_DTYPE else x.dtype)
    act = x.new_empty(num_rows, inter, dtype=out_dtype)  # [N, I]
    if num_rows == 0 or num_experts == 0:
        return act
    has_scale = w13.dtype == FP8_DTYPE
    dtype = torch.bfloat16 if has_scale else x.dtype  # fp8 tiles fit bf16's table, as in moe_down
    cfg = config or fit_dtype(gate_up_config(rows_hint or rows_per_expert_hint(num_rows, 1, num_experts)), dtype)
    block_k = scaled_block_k(cfg.block_k, block[1], FP8_MIN_BLOCK_K) if has_scale else cfg.block_k
    scale_n, scale_k = block if has_scale else (1, 1)
    s, xs = (scale, x_scale) if has_scale else (offs, offs)  # unused without HAS_SCALE
    s_strides = (s.stride(0), s.stride(1), s.stride(2), s.shape[1] // 2) if has_scale else (0, 0, 0, 0)
    grid = (num_experts, triton.cdiv(inter, cfg.block_n))
    _gate_up_kernel[grid](
        x,
        token_idx if token_idx is not None else offs,  # unused without HAS_TOKEN_IDX
        offs,
        w13,
        act,
        s,
        xs,
        inter,
        hidden,
        x.stride(0),
        x.stride(1),
        w13.stride(0),
        w13.stride(1),
        w13.stride(2),
        act.stride(0),
        act.stride(1),
        *s_strides[:3],
        *(xs.stride() if has_scale else (0, 0)),
        s_strides[3],
        HAS_TOKEN_IDX=token_idx is not None,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=block_k,
        EVEN_N=inter % cfg.block_n == 0,
        EVEN_K=hidden % block_k == 0,
        PRECISION=dot_precision(x.dtype),
        HAS_SCALE=has_scale,
        SCALE_N=scale_n,
        SCALE_K=scale_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return act
