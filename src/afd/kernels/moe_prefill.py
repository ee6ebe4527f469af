"""FP8 routed experts at prefill sizes: tiles of rows on the MMA's M side, every expert's rows in one grid.

At prefill sizes (thousands of tokens, hundreds of rows per expert) the routed experts are bound by the matmuls,
not by streaming the weights. The decode kernels (`moe_gate_up`, `moe_down`) give each (expert, column tile) one
program that walks the expert's rows in small chunks with the weight tile on the MMA's M side; here every program
takes one `BLOCK_M`-row tile of one expert's rows against one column tile, so large fp8 x fp8 MMAs run on many
programs at once. The grid is an upper bound on the row tiles (`max_row_tiles`: `ceil(N / BLOCK_M) + E`) times the
column tiles; each program finds its expert from `offs` on the device (`_row_tile`), and programs past the last
tile return at once. Nothing is read back to the host, so a CUDA graph captures it; no atomics, so every run gives
the same bits. Consecutive programs share a row tile (column tiles vary fastest), so a row tile is read from
memory once and an expert's weights, a few MB, stay in L2 while its rows pass.

The arithmetic is the decode kernels': both operands fp8 (the rows quantized per row in groups of `b1`, as
`fp8_quant.quantize_rows` does), each K step one fp8 MMA inside one scale block, its fp32 result times the weight
rows' and the rows' scales, fp32 accumulation. `gate_up_rows` quantizes its SwiGLU output for the down projection
in its epilogue when a column tile is one scale group wide (the values and bits of `quantize_rows` on the bf16
output), so the down projection's rows need no launch of their own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from afd.kernels.moe_tiles import FP8_DTYPE, FP8_MAX, FP8_MIN_BLOCK_K, load_2d, scaled_block_k


@dataclass(frozen=True)
class RowTileConfig:
    """Launch shape of `gate_up_rows` / `down_rows`: rows per tile (block_m), output columns per tile (block_n),
    reduction step (block_k, cut to the scale block's width), warps and software-pipeline stages."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 128
    num_warps: int = 8
    num_stages: int = 3


GATE_UP_TILE = RowTileConfig(64, 128, 128, num_warps=8, num_stages=3)
DOWN_TILE = RowTileConfig(128, 128, 128, num_warps=8, num_stages=3)


def max_row_tiles(num_rows: int, num_experts: int, block_m: int) -> int:
    """An upper bound on `sum_e ceil(rows_e / block_m)` over experts whose rows add up to `num_rows`, from the
    shapes alone (each expert wastes less than one tile)."""
    return triton.cdiv(num_rows, block_m) + num_experts


@triton.jit
def _row_tile(offs_ptr, num_experts, pid_m, BLOCK_M: tl.constexpr, E_POW2: tl.constexpr):
    """(expert, first row, end of the expert's rows) of row tile `pid_m`, the experts' rows cut into BLOCK_M
    tiles in expert order; the expert is `num_experts` or more past the last tile."""
    e_idx = tl.arange(0, E_POW2)
    in_e = e_idx < num_experts
    ends = tl.load(offs_ptr + e_idx, mask=in_e, other=0)
    starts = tl.load(offs_ptr + e_idx - 1, mask=in_e & (e_idx > 0), other=0)
    tiles = tl.where(in_e, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)  # [E] row tiles per expert
    e = tl.sum((tl.cumsum(tiles, axis=0) <= pid_m).to(tl.int32), axis=0)
    first_tile = tl.sum(tl.where(e_idx < e, tiles, 0), axis=0)
    start = tl.sum(tl.where(e_idx == e, starts, 0), axis=0)
    end = tl.sum(tl.where(e_idx == e, ends, 0), axis=0)
    return e, start + (pid_m - first_tile) * BLOCK_M, end


@triton.jit
def _gate_up_rows_kernel(
    x_ptr,  # [T, H] fp8 rows (gathered through token_ptr when HAS_TOKEN_IDX)
    x_scale_ptr,  # [T, ceil(H/SCALE_K)] fp32
    token_ptr,  # [N] int row of x for each grouped row
    offs_ptr,  # [E] int32 cumulative group ends
    w_ptr,  # [E, 2I, H] fp8: gate rows then up rows
    scale_ptr,  # [E, 2 * ceil(I/SCALE_N), ceil(H/SCALE_K)] fp32: gate's rows from 0, up's from up_scale_row
    act_ptr,  # [N, I] out: the rows' 16/32-bit dtype, or fp8 when QUANT_OUT
    act_scale_ptr,  # [N, ceil(I/BLOCK_N)] fp32 out (QUANT_OUT)
    num_experts,
    inter,
    hidden,
    stride_xm,
    stride_xsm,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_sk,
    stride_am,
    stride_asm,
    up_scale_row,
    HAS_TOKEN_IDX: tl.constexpr,
    QUANT_OUT: tl.constexpr,
    ROUND_BF16: tl.constexpr,  # QUANT_OUT: quantize the SwiGLU output as rounded to bf16 (else as fp32)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    E_POW2: tl.constexpr,
    SCALE_N: tl.constexpr,
    SCALE_K: tl.constexpr,
    ONE_SCALE_ROW: tl.constexpr,  # BLOCK_N divides SCALE_N: a column tile lies inside one scale block
    FMAX: tl.constexpr,
):
    num_n = tl.cdiv(inter, BLOCK_N)
    pid_m = tl.program_id(0) // num_n
    pid_n = tl.program_id(0) % num_n
    e, m0, end = _row_tile(offs_ptr, num_experts, pid_m, BLOCK_M, E_POW2)
    if e >= num_experts:
        return
    rows = m0 + tl.arange(0, BLOCK_M)  # [BM]
    r_mask = rows < end
    if HAS_TOKEN_IDX:
        src = tl.load(token_ptr + rows, mask=r_mask, other=0).to(tl.int64)
    else:
        src = rows.to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] columns of act = rows of w_gate / w_up
    n_mask = n < inter
    k = tl.arange(0, BLOCK_K)  # [BK]
    x_tile = x_ptr + src[:, None] * stride_xm + k[None, :]  # [BM, BK] pointers
    w_gate = w_ptr + e.to(tl.int64) * stride_we + n[:, None].to(tl.int64) * stride_wn + k[None, :]  # [BN, BK]
    w_up = w_gate + inter * stride_wn
    if ONE_SCALE_ROW:  # the tile's columns share one scale block: one weight scale per K step
        s_gate = scale_ptr + e.to(tl.int64) * stride_se + (pid_n * BLOCK_N // SCALE_N) * stride_sn
    else:
        s_gate = scale_ptr + e.to(tl.int64) * stride_se + (n // SCALE_N) * stride_sn  # [BN]
    s_up = s_gate + up_scale_row * stride_sn
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_mask = k0 + k < hidden
        xt = load_2d(x_tile + k0, r_mask, k_mask, False, EVEN_K)  # [BM, BK]
        wg = load_2d(w_gate + k0, n_mask, k_mask, EVEN_N, EVEN_K)  # [BN, BK]
        wu = load_2d(w_up + k0, n_mask, k_mask, EVEN_N, EVEN_K)
        s_k = k0 // SCALE_K
        sx = tl.load(x_scale_ptr + src * stride_xsm + s_k, mask=r_mask, other=0.0)  # [BM]
        if ONE_SCALE_ROW:
            acc_gate += tl.dot(xt, tl.trans(wg)) * (sx * tl.load(s_gate + s_k * stride_sk))[:, None]  # [BM, BN]
            acc_up += tl.dot(xt, tl.trans(wu)) * (sx * tl.load(s_up + s_k * stride_sk))[:, None]
        else:
            sg = tl.load(s_gate + s_k * stride_sk, mask=n_mask, other=0.0)  # [BN]
            su = tl.load(s_up + s_k * stride_sk, mask=n_mask, other=0.0)
            acc_gate += tl.dot(xt, tl.trans(wg)) * sx[:, None] * sg[None, :]  # [BM, BN] fp32
            acc_up += tl.dot(xt, tl.trans(wu)) * sx[:, None] * su[None, :]
    act = acc_gate * tl.sigmoid(acc_gate) * acc_up  # [BM, BN] SwiGLU in fp32
    out = act_ptr + rows[:, None].to(tl.int64) * stride_am + n[None, :]
    mask = r_mask[:, None] & n_mask[None, :]
    if QUANT_OUT:  # this tile is one scale group of each row: quantize it as fp8_quant does the stored rows
        a = act.to(tl.bfloat16).to(tl.float32) if ROUND_BF16 else act
        amax = tl.max(tl.abs(a), axis=1)  # [BM]
        scale = tl.where(amax > 0, amax / FMAX, 1.0)
        q = tl.clamp(tl.math.div_rn(a, scale[:, None]), -FMAX, FMAX)
        tl.store(out, q.to(act_ptr.dtype.element_ty), mask=mask)
        tl.store(act_scale_ptr + rows.to(tl.int64) * stride_asm + pid_n, scale, mask=r_mask)
    else:
        tl.store(out, act.to(act_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _down_rows_kernel(
    act_ptr,  # [N, I] fp8 grouped rows
    act_scale_ptr,  # [N, ceil(I/SCALE_K)] fp32
    offs_ptr,  # [E] int32 cumulative group ends
    w_ptr,  # [E, H, I] fp8
    scale_ptr,  # [E, ceil(H/SCALE_N), ceil(I/SCALE_K)] fp32
    out_ptr,  # [P, H] out (row dest[r], or r without HAS_DEST)
    dest_ptr,  # [N] int destination row of each grouped row
    weight_ptr,  # [P] fp32 weight of each destination row
    num_experts,
    hidden,
    inter,
    stride_am,
    stride_asm,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_sk,
    stride_om,
    HAS_DEST: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    E_POW2: tl.constexpr,
    SCALE_N: tl.constexpr,
    SCALE_K: tl.constexpr,
    ONE_SCALE_ROW: tl.constexpr,
):
    num_n = tl.cdiv(hidden, BLOCK_N)
    pid_m = tl.program_id(0) // num_n
    pid_n = tl.program_id(0) % num_n
    e, m0, end = _row_tile(offs_ptr, num_experts, pid_m, BLOCK_M, E_POW2)
    if e >= num_experts:
        return
    rows = m0 + tl.arange(0, BLOCK_M)  # [BM]
    r_mask = rows < end
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output columns = rows of w2[e]
    n_mask = n < hidden
    k = tl.arange(0, BLOCK_K)
    a_tile = act_ptr + rows[:, None].to(tl.int64) * stride_am + k[None, :]  # [BM, BK]
    w_tile = w_ptr + e.to(tl.int64) * stride_we + n[:, None].to(tl.int64) * stride_wn + k[None, :]  # [BN, BK]
    if ONE_SCALE_ROW:  # as in gate/up
        s_row = scale_ptr + e.to(tl.int64) * stride_se + (pid_n * BLOCK_N // SCALE_N) * stride_sn
    else:
        s_row = scale_ptr + e.to(tl.int64) * stride_se + (n // SCALE_N) * stride_sn  # [BN]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_mask = k0 + k < inter
        a = load_2d(a_tile + k0, r_mask, k_mask, False, EVEN_K)  # [BM, BK]
        w = load_2d(w_tile + k0, n_mask, k_mask, EVEN_N, EVEN_K)  # [BN, BK]
        s_k = k0 // SCALE_K
        sa = tl.load(act_scale_ptr + rows * stride_asm + s_k, mask=r_mask, other=0.0)  # [BM]
        if ONE_SCALE_ROW:
            acc += tl.dot(a, tl.trans(w)) * (sa * tl.load(s_row + s_k * stride_sk))[:, None]  # [BM, BN] fp32
        else:
            sw = tl.load(s_row + s_k * stride_sk, mask=n_mask, other=0.0)  # [BN]
            acc += tl.dot(a, tl.trans(w)) * sa[:, None] * sw[None, :]
    if HAS_DEST:
        dst = tl.load(dest_ptr + rows, mask=r_mask, other=0).to(tl.int64)  # [BM]
    else:
        dst = rows.to(tl.int64)
    if HAS_WEIGHT:
        acc = acc * tl.load(weight_ptr + dst, mask=r_mask, other=0.0)[:, None]
    out = out_ptr + dst[:, None] * stride_om + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=r_mask[:, None] & n_mask[None, :])


def _check_k_contiguous(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError(f"a {tuple(t.shape)} operand must be contiguous along its last dimension")


def gate_up_rows(
    x: torch.Tensor,
    x_scale: torch.Tensor,
    offs: torch.Tensor,
    w13: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    *,
    token_idx: torch.Tensor | None = None,
    quantize_group: int | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    config: RowTileConfig = GATE_UP_TILE,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """SwiGLU of grouped fp8 rows, as `moe_gate_up.expert_gate_up` with FP8 weights computes it:
    `act[r] = silu(x[src] @ w_gate[e].T) * (x[src] @ w_up[e].T)` in `out_dtype` (bf16 or fp32).

    x: [T, H] float8_e4m3fn with `x_scale [T, ceil(H/b1)]`; offs: [E] int32 cumulative group ends; w13: [E, 2I,
    H] float8_e4m3fn with `scale [E, 2 * ceil(I/b0), ceil(H/b1)]` in `block = (b0, b1)`; token_idx: [N] int, the
    row of x of each grouped row (None: `src = r`). Returns `(act [N, I] out_dtype, None)`, or with
    `quantize_group` equal to the tile's columns `(act [N, I] float8_e4m3fn, act_scale [N, ceil(I/group)] fp32)`:
    the `out_dtype` values quantized per row in groups of `quantize_group`, the bits `fp8_quant.quantize_rows`
    gives them on a GPU (Triton's CPU interpreter converts to e4m3 wrongly, so not there). Rows at and past
    `offs[-1]` are not written.
    """
    num_experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    num_rows = x.shape[0] if token_idx is None else token_idx.shape[0]
    quant_out = quantize_group is not None
    if quant_out and quantize_group != config.block_n:
        raise ValueError(f"quantizing in groups of {quantize_group} needs tiles of as many columns")
    _check_k_contiguous(x, w13)
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"SwiGLU output {out_dtype}: need bfloat16 or float32")
    act = x.new_empty(num_rows, inter, dtype=FP8_DTYPE if quant_out else out_dtype)
    act_scale = torch.empty(num_rows, triton.cdiv(inter, config.block_n), dtype=torch.float32, device=x.device)
    if num_rows and num_experts:
        block_k = scaled_block_k(config.block_k, block[1], FP8_MIN_BLOCK_K)
        grid = (max_row_tiles(num_rows, num_experts, config.block_m) * triton.cdiv(inter, config.block_n),)
        _gate_up_rows_kernel[grid](
            x, x_scale, token_idx if token_idx is not None else offs, offs, w13, scale, act, act_scale,
            num_experts, inter, hidden,
            x.stride(0), x_scale.stride(0), w13.stride(0), w13.stride(1),
            scale.stride(0), scale.stride(1), scale.stride(2), act.stride(0), act_scale.stride(0), scale.shape[1] // 2,
            HAS_TOKEN_IDX=token_idx is not None, QUANT_OUT=quant_out, ROUND_BF16=out_dtype == torch.bfloat16,
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=block_k,
            EVEN_N=inter % config.block_n == 0, EVEN_K=hidden % block_k == 0,
            E_POW2=triton.next_power_of_2(num_experts), SCALE_N=block[0], SCALE_K=block[1],
            ONE_SCALE_ROW=block[0] % config.block_n == 0, FMAX=FP8_MAX,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )  # fmt: skip
    return act, (act_scale if quant_out else None)


def down_rows(
    act: torch.Tensor,
    act_scale: torch.Tensor,
    offs: torch.Tensor,
    w2: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    out: torch.Tensor,
    *,
    dest_idx: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    config: RowTileConfig = DOWN_TILE,
) -> torch.Tensor:
    """Down projection of grouped fp8 rows, as `moe_down.expert_down` with FP8 weights computes it:
    `out[dest[r]] = weights[dest[r]] * (act[r] @ w2[e].T)` in fp32, stored in out's dtype.

    act: [N, I] float8_e4m3fn with `act_scale [N, ceil(I/b1)]`; w2: [E, H, I] float8_e4m3fn with `scale [E,
    ceil(H/b0), ceil(I/b1)]`; dest_idx: [N] int (None: `dest[r] = r`); weights: [P] fp32 by destination (None:
    unweighted); out: [P, H]. Only destinations of rows in a group are written.
    """
    num_experts, hidden, inter = w2.shape
    _check_k_contiguous(act, w2, out)
    if act.shape[0] and num_experts:
        block_k = scaled_block_k(config.block_k, block[1], FP8_MIN_BLOCK_K)
        grid = (max_row_tiles(act.shape[0], num_experts, config.block_m) * triton.cdiv(hidden, config.block_n),)
        _down_rows_kernel[grid](
            act, act_scale, offs, w2, scale, out,
            dest_idx if dest_idx is not None else offs, weights if weights is not None else out,
            num_experts, hidden, inter,
            act.stride(0), act_scale.stride(0), w2.stride(0), w2.stride(1),
            scale.stride(0), scale.stride(1), scale.stride(2), out.stride(0),
            HAS_DEST=dest_idx is not None, HAS_WEIGHT=weights is not None,
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=block_k,
            EVEN_N=hidden % config.block_n == 0, EVEN_K=inter % block_k == 0,
            E_POW2=triton.next_power_of_2(num_experts), SCALE_N=block[0], SCALE_K=block[1],
            ONE_SCALE_ROW=block[0] % config.block_n == 0,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )  # fmt: skip
    return out
