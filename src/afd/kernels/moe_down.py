"""`expert_down`: the grouped down projection, weighted and stored straight to each row's destination.

Grid (expert, tile of H): `y = act @ w2[e].T` in fp32, optionally times a per-destination weight and stored to
a per-row destination index, so the result lands in (t, k) pair order. Same "swap AB" tiling as `moe_gate_up`,
and the same fp8 x fp8 MMAs for block-scaled FP8 weights with fp8 rows (`HAS_SCALE`).
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
    down_config,
    fit_dtype,
    load_2d,
    rows_per_expert_hint,
    scaled_block_k,
)


@triton.jit
def _down_kernel(
    act_ptr,  # [N, I] grouped rows, fp8 when HAS_SCALE
    offs_ptr,  # [E] int32 cumulative group ends
    w_ptr,  # [E, H, I]
    out_ptr,  # [P, H] out (row dest[r], or r without HAS_DEST)
    dest_ptr,  # [N] int destination row of each grouped row
    weight_ptr,  # [P] fp32 weight of each destination row
    scale_ptr,  # [E, ceil(H/SCALE_N), ceil(I/SCALE_K)] fp32 (HAS_SCALE)
    act_scale_ptr,  # [N, ceil(I/SCALE_K)] fp32 (HAS_SCALE): one scale per row of act and K block
    hidden,
    inter,
    stride_am,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    stride_se,
    stride_sn,
    stride_sk,
    stride_asm,
    stride_ask,
    HAS_DEST: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
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
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output columns = rows of w2[e]
    n_mask = n < hidden
    k = tl.arange(0, BLOCK_K)  # [BK]
    w_tile = w_ptr + e.to(tl.int64) * stride_we + n[:, None].to(tl.int64) * stride_wn + k[None, :] * stride_wk
    s_row = scale_ptr + e.to(tl.int64) * stride_se + (n // SCALE_N) * stride_sn  # [BN] (HAS_SCALE only)
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)  # [BM]
        r_mask = rows < end
        a_tile = act_ptr + rows[:, None].to(tl.int64) * stride_am + k[None, :] * stride_ak  # [BM, BK] pointers
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            k_mask = k0 + k < inter
            a = load_2d(a_tile + k0 * stride_ak, r_mask, k_mask, False, EVEN_K)  # [BM, BK]
            w = load_2d(w_tile + k0 * stride_wk, n_mask, k_mask, EVEN_N, EVEN_K)  # [BN, BK]
            if HAS_SCALE:  # as in moe_gate_up: fp8 x fp8, one scale per weight row and one per act row
                s_k = k0 // SCALE_K
                sw = tl.load(s_row + s_k * stride_sk, mask=n_mask, other=0.0)  # [BN] fp32
                sa = tl.load(act_scale_ptr + rows * stride_asm + s_k * stride_ask, mask=r_mask, other=0.0)  # [BM]
                acc += tl.dot(w, tl.trans(a)) * sw[:, None] * sa[None, :]  # [BN, BM] fp32
            else:
                acc = tl.dot(w, tl.trans(a), acc, input_precision=PRECISION)  # [BN, BM]
        if HAS_DEST:
            dst = tl.load(dest_ptr + rows, mask=r_mask, other=0).to(tl.int64)  # [BM]
        else:
            dst = rows.to(tl.int64)
        if HAS_WEIGHT:
            acc = acc * tl.load(weight_ptr + dst, mask=r_mask, other=0.0)[None, :]
        out = out_ptr + dst[None, :] * stride_om + n[:, None] * stride_on
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=r_mask[None, :] & n_mask[:, None])


def expert_down(
    act: torch.Tensor,
    offs: torch.Tensor,
    w2: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    dest_idx: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    rows_hint: int | None = None,
    config: TileConfig | None = None,
    scale: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
    act_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Down projection of grouped rows: `out[dest[r]] = weights[dest[r]] * (act[r] @ w2[e].T)`.

    act: [N, I] grouped as `offs` [E] int32 says; w2: [E, H, I]; dest_idx: [N] int (None: `dest[r] = r`);
    weights: [P] fp32 indexed by destination (None: no weighting); out: [P, H] (default a new [N, H] fp32).
    Accumulates in fp32 and stores in out's dtype. Only destinations of rows in a group are written.
    FP8 `w2` (float8_e4m3fn): `w2[e, i, j]` means `w2[e, i, j] * scale[e, i // b0, j // b1]`, `block = (b0, b1)`,
    and takes fp8 rows: `act` float8_e4m3fn with fp32 `act_scale [N, ceil(I/b1)]`, `act[r, j] * act_scale[r, j // b1]`.
    """
    num_experts, hidden, inter = w2.shape
    if act.shape[-1] != inter:
        raise ValueError(f"act {tuple(act.shape)} {act.dtype} does not fit w2 {tuple(w2.shape)} {w2.dtype}")
    has_scale = w2.dtype == FP8_DTYPE
    if has_scale:
        check_fp8_weight(w2, scale, block, -(-hidden // block[0]) if block else 0, FP8_MIN_BLOCK_K)
    check_rows(act, act_scale, w2, block)
    if out is None:
        out = torch.empty(act.shape[0], hidden, dtype=torch.float32, device=act.device)  # [N, H]
    if act.shape[0] == 0 or num_experts == 0:
        return out
    if weights is not None and weights.dtype != torch.float32:
        raise ValueError(f"weights must be float32, got {weights.dtype}")
    dtype = torch.bfloat16 if has_scale else act.dtype  # fp8 tiles fit bf16's table
    cfg = config or fit_dtype(down_config(rows_hint or rows_per_expert_hint(act.shape[0], 1, num_experts)), dtype)
    block_k = scaled_block_k(cfg.block_k, block[1], FP8_MIN_BLOCK_K) if has_scale else cfg.block_k
    scale_n, scale_k = block if has_scale else (1, 1)
    s, act_s = (scale, act_scale) if has_scale else (offs, offs)  # unused without HAS_SCALE
    s_strides = (s.stride(0), s.stride(1), s.stride(2)) if has_scale else (0, 0, 0)
    grid = (num_experts, triton.cdiv(hidden, cfg.block_n))
    _down_kernel[grid](
        act,
        offs,
        w2,
        out,
        dest_idx if dest_idx is not None else offs,  # unused without HAS_DEST
        weights if weights is not None else out,  # unused without HAS_WEIGHT
        s,
        act_s,
        hidden,
        inter,
        act.stride(0),
        act.stride(1),
        w2.stride(0),
        w2.stride(1),
        w2.stride(2),
        out.stride(0),
        out.stride(1),
        *s_strides,
        *(act_s.stride() if has_scale else (0, 0)),
        HAS_DEST=dest_idx is not None,
        HAS_WEIGHT=weights is not None,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=block_k,
        EVEN_N=hidden % cfg.block_n == 0,
        EVEN_K=inter % block_k == 0,
        PRECISION=dot_precision(act.dtype),
        HAS_SCALE=has_scale,
        SCALE_N=scale_n,
        SCALE_K=scale_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out
