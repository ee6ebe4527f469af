"""Decode-shaped routed experts: few rows per expert, each touched expert's weights streamed once.

At decode sizes (1..256 tokens, top-6 of 64 experts: 0..~40 rows per expert) the routed experts are bound by
reading the weights, not by the matmuls, and `torch._grouped_mm` streams them at about half the copy rate with
~10 small kernels around it. Here a MoE layer is four launches, none of which reads anything back to the host
(so a CUDA graph captures them) and none of which uses atomics (so every run gives the same bits):

1. `sort_pairs`: a counting sort of the T*K (token, k) pairs by local expert in one kernel; a pair's slot is
   `#(pairs with a smaller key) + #(earlier pairs with the same key)`, so ties keep pair order (stable) and
   non-local pairs (key = sentinel) sort last, exactly like `afd.model.moe.sort_pairs_by_expert`.
2. `expert_gate_up`: grid (expert, tile of I). A program reads its expert's row range from `offs` (an expert
   with no rows runs zero loop iterations and reads no weights), then for each BLOCK_M chunk of its rows streams
   the gate rows and the up rows of the same I columns of `w13[e]` (once per chunk; one chunk at decode) and
   keeps SwiGLU in registers: `act = silu(x @ w_gate.T) * (x @ w_up.T)`. The weight tile is the MMA's M side
   and the rows its N side ("swap AB"), so 1..16 rows still fill a tensor-core tile. fp32 accumulation.
3. `expert_down`: grid (expert, tile of H), `y = act @ w2[e].T` in fp32, optionally times a per-destination
   weight and stored to a per-row destination index: the result lands in (t, k) pair order.
4. `_combine_kernel`: `out[t] = sum_k y[t, k]` over the local pairs only, k in order (fixed summation order).

The eager PyTorch code in `afd.model.moe` stays the CPU path and the oracle of the tests (`tests/test_kernel_moe.py`).
Block sizes come from a small fixed table by rows per expert (no autotuning at run time: deterministic and
capturable).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from afd.kernels import int_kind

logger = logging.getLogger(__name__)

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class TileConfig:
    """Launch shape of `expert_gate_up` / `expert_down`: rows per chunk (block_m), weight rows per program
    (block_n), reduction step (block_k), warps and software-pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4


# By rows per expert (upper bound of the usual count, see `rows_per_expert_hint`). Chosen on one H200
# (2026-11-30, bf16, V2-Lite shapes, 26 layers of distinct weights in a CUDA graph, the device-to-device copy
# at 4.27 TB/s in the same run; `python tests/test_kernel_moe.py --sweep`): the best of 9 tile shapes per row,
# within ~3% of each other except where noted. Alone, gate/up streamed 3.39 / 4.35 / 4.29 / 3.98 TB/s and down
# 2.85 / 4.06 / 3.95 / 3.51 TB/s at T = 1 / 8 / 64 / 256. A gate/up stage holds two 64x128 weight tiles (gate
# and up, 32 KiB) plus the rows. At block_m 64 the down projection wants 128x64 tiles (3.51 TB/s; 64x128 with
# 4 stages: 2.64).
_GATE_UP_CONFIGS = {
    16: TileConfig(16, 64, 128, num_warps=4, num_stages=3),
    32: TileConfig(32, 64, 128, num_warps=4, num_stages=4),
    64: TileConfig(64, 64, 128, num_warps=4, num_stages=4),
}
_DOWN_CONFIGS = {
    16: TileConfig(16, 64, 128, num_warps=4, num_stages=3),
    32: TileConfig(32, 64, 128, num_warps=4, num_stages=4),
    64: TileConfig(64, 128, 64, num_warps=4, num_stages=4),
}


def _bucket(rows: int) -> int:
    """Smallest block_m of the tables (16, 32, 64) that covers `rows` (64 above: larger groups loop)."""
    return 16 if rows <= 16 else 32 if rows <= 32 else 64


def rows_per_expert_hint(num_tokens: int, top_k: int, num_local_experts: int) -> int:
    """A host-side guess of the largest group, from shapes only: a token picks an expert at most once, so never
    more than `num_tokens`; under even routing the mean is `T*K/E` (E counts local experts only, so a shard
    overestimates it, the safe side), and twice the mean plus 8 covers the usual maximum."""
    mean = -(-num_tokens * top_k // max(num_local_experts, 1))
    return max(1, min(num_tokens, 2 * mean + 8))


def routed_compile_key(num_tokens: int, top_k: int, num_local_experts: int) -> tuple:
    """What decides which compiled variants `fused_routed_experts` launches for `num_tokens` rows (the model's
    sizes fixed): the pair count and its block count (kinds of integer), the sort's pair tile, and the tile row
    of the expert GEMMs."""
    num_pairs = num_tokens * top_k
    pair_tile = min(1024, max(16, triton.next_power_of_2(num_pairs)))
    hint = rows_per_expert_hint(num_tokens, top_k, num_local_experts)
    return (int_kind(num_pairs), int_kind(triton.cdiv(num_pairs, 16)), pair_tile, _bucket(hint))


def warm_up_token_counts(top_k: int, num_local_experts: int, max_tokens: int) -> list[int]:
    """The fewest token counts up to `max_tokens` whose launches between them compile every variant a step of
    up to `max_tokens` rows can need (the first count of each `routed_compile_key`)."""
    first: dict[tuple, int] = {}
    for num_tokens in range(1, max_tokens + 1):
        first.setdefault(routed_compile_key(num_tokens, top_k, num_local_experts), num_tokens)
    return sorted(first.values())


def gate_up_config(rows_hint: int) -> TileConfig:
    return _GATE_UP_CONFIGS[_bucket(rows_hint)]


def down_config(rows_hint: int) -> TileConfig:
    return _DOWN_CONFIGS[_bucket(rows_hint)]


def _fit_dtype(cfg: TileConfig, dtype: torch.dtype) -> TileConfig:
    """The table is sized for 2-byte weights; fp32 tiles take half the reduction step, so the stages keep the
    same bytes of shared memory (the bf16 gate/up rows would not fit an SM's shared memory in fp32)."""
    if dtype.itemsize <= 2:
        return cfg
    return TileConfig(cfg.block_m, cfg.block_n, max(16, cfg.block_k // 2), cfg.num_warps, cfg.num_stages)


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs: full fp32 products (tl.dot would otherwise round them to tf32); bf16/fp16: the default.
    return "ieee" if dtype == torch.float32 else "tf32"


# ----------------------------------------------------------------------------------------------- kernels


@triton.jit
def _local_key(ids_ptr, idx, in_range, expert_start, num_local):
    """Local expert of pair `idx`; `num_local` (sorts last) for a non-local pair, `num_local + 1` (sorts after
    everything, counted nowhere) for a lane past the end."""
    expert = tl.load(ids_ptr + idx, mask=in_range, other=0)
    key = (expert - expert_start).to(tl.int32)
    key = tl.where((key >= 0) & (key < num_local), key, num_local)
    return tl.where(in_range, key, num_local + 1)


@triton.jit
def _sort_pairs_kernel(
    ids_ptr,  # [P] int64, flattened topk_ids
    pair_ptr,  # [P] int32 out: pair index of each sorted slot
    token_ptr,  # [P] int32 out: token (row of x) of each sorted slot
    offs_ptr,  # [E_local] int32 out: cumulative group ends
    num_pairs,
    top_k,
    expert_start,
    num_local,
    num_pair_blocks,
    BLOCK_I: tl.constexpr,
    BLOCK_J: tl.constexpr,
):
    """Programs [0, num_pair_blocks) place BLOCK_I pairs each; the rest compute BLOCK_I group ends each. Every
    program scans all P keys in BLOCK_J chunks (one or two at decode sizes), so no program waits on another."""
    pid = tl.program_id(0)
    if pid < num_pair_blocks:
        i = pid * BLOCK_I + tl.arange(0, BLOCK_I)  # [BI] this program's pairs
        in_i = i < num_pairs
        key_i = _local_key(ids_ptr, i, in_i, expert_start, num_local)  # [BI]
        slot = tl.zeros([BLOCK_I], dtype=tl.int32)
        for j0 in range(0, num_pairs, BLOCK_J):
            j = j0 + tl.arange(0, BLOCK_J)  # [BJ]
            key_j = _local_key(ids_ptr, j, j < num_pairs, expert_start, num_local)
            key_j, key_c = key_j[None, :], key_i[:, None]
            before = (key_j < key_c) | ((key_j == key_c) & (j[None, :] < i[:, None]))  # [BI, BJ]
            slot += tl.sum(before.to(tl.int32), axis=1)
        tl.store(pair_ptr + slot, i, mask=in_i)
        tl.store(token_ptr + slot, i // top_k, mask=in_i)
    else:
        e = (pid - num_pair_blocks) * BLOCK_I + tl.arange(0, BLOCK_I)  # [BI] local experts
        ends = tl.zeros([BLOCK_I], dtype=tl.int32)
        for j0 in range(0, num_pairs, BLOCK_J):
            j = j0 + tl.arange(0, BLOCK_J)
            key_j = _local_key(ids_ptr, j, j < num_pairs, expert_start, num_local)
            ends += tl.sum((key_j[None, :] <= e[:, None]).to(tl.int32), axis=1)  # pairs up to expert e
        tl.store(offs_ptr + e, ends, mask=e < num_local)


@triton.jit
def _load_2d(ptrs, row_mask, col_mask, EVEN_ROWS: tl.constexpr, EVEN_COLS: tl.constexpr):
    """A [R, C] tile, masked only along the dimensions that do not divide evenly (zeros outside)."""
    if EVEN_ROWS:
        if EVEN_COLS:
            return tl.load(ptrs)
        else:
            return tl.load(ptrs, mask=col_mask[None, :], other=0.0)
    else:
        if EVEN_COLS:
            return tl.load(ptrs, mask=row_mask[:, None], other=0.0)
        else:
            return tl.load(ptrs, mask=row_mask[:, None] & col_mask[None, :], other=0.0)


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
            xt = _load_2d(x_tile + k0 * stride_xk, r_mask, k_mask, False, EVEN_K)  # [BM, BK]
            wg = _load_2d(w_gate + k0 * stride_wk, n_mask, k_mask, EVEN_N, EVEN_K)  # [BN, BK]
            wu = _load_2d(w_up + k0 * stride_wk, n_mask, k_mask, EVEN_N, EVEN_K)  # [BN, BK]
            xt_t = tl.trans(xt)  # [BK, BM]
            acc_gate = tl.dot(wg, xt_t, acc_gate, input_precision=PRECISION)  # [BN, BM]
            acc_up = tl.dot(wu, xt_t, acc_up, input_precision=PRECISION)
        act = acc_gate * tl.sigmoid(acc_gate) * acc_up  # [BN, BM] SwiGLU in fp32
        out = act_ptr + rows[None, :].to(tl.int64) * stride_am + n[:, None] * stride_an
        tl.store(out, act.to(act_ptr.dtype.element_ty), mask=r_mask[None, :] & n_mask[:, None])


@triton.jit
def _down_kernel(
    act_ptr,  # [N, I] grouped rows
    offs_ptr,  # [E] int32 cumulative group ends
    w_ptr,  # [E, H, I]
    out_ptr,  # [P, H] out (row dest[r], or r without HAS_DEST)
    dest_ptr,  # [N] int destination row of each grouped row
    weight_ptr,  # [P] fp32 weight of each destination row
    hidden,
    inter,
    stride_am,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    HAS_DEST: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
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
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output columns = rows of w2[e]
    n_mask = n < hidden
    k = tl.arange(0, BLOCK_K)  # [BK]
    w_tile = w_ptr + e.to(tl.int64) * stride_we + n[:, None].to(tl.int64) * stride_wn + k[None, :] * stride_wk
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)  # [BM]
        r_mask = rows < end
        a_tile = act_ptr + rows[:, None].to(tl.int64) * stride_am + k[None, :] * stride_ak  # [BM, BK] pointers
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            k_mask = k0 + k < inter
            a = _load_2d(a_tile + k0 * stride_ak, r_mask, k_mask, False, EVEN_K)  # [BM, BK]
            w = _load_2d(w_tile + k0 * stride_wk, n_mask, k_mask, EVEN_N, EVEN_K)  # [BN, BK]
            acc = tl.dot(w, tl.trans(a), acc, input_precision=PRECISION)  # [BN, BM]
        if HAS_DEST:
            dst = tl.load(dest_ptr + rows, mask=r_mask, other=0).to(tl.int64)  # [BM]
        else:
            dst = rows.to(tl.int64)
        if HAS_WEIGHT:
            acc = acc * tl.load(weight_ptr + dst, mask=r_mask, other=0.0)[None, :]
        out = out_ptr + dst[None, :] * stride_om + n[:, None] * stride_on
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=r_mask[None, :] & n_mask[:, None])


@triton.jit
def _combine_kernel(
    pair_out_ptr,  # [T*K, H] fp32, rows of non-local pairs never written
    ids_ptr,  # [T*K] int64
    out_ptr,  # [T, H] fp32 out
    hidden,
    expert_start,
    num_local,
    TOP_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH]
    h_mask = h < hidden
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(TOP_K):  # k in order: the same bits every run
        expert = tl.load(ids_ptr + t * TOP_K + k)
        local = (expert >= expert_start) & (expert < expert_start + num_local)
        acc += tl.load(pair_out_ptr + (t * TOP_K + k) * hidden + h, mask=h_mask & local, other=0.0)
    tl.store(out_ptr + t * hidden + h, acc, mask=h_mask)


@triton.jit
def _combine_sorted_kernel(
    y_ptr,  # [P, H] expert outputs in expert-sorted order (x.dtype); rows at and past num_local undefined
    pos_ptr,  # [T*K] int64: where pair (t, k) sits in the sorted order
    w_ptr,  # [T*K] fp32 routing weights
    offs_ptr,  # [E] int32 cumulative group ends: the last one is the number of local pairs
    out_ptr,  # [T, H] fp32 out
    hidden,
    num_experts,
    TOP_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH]
    h_mask = h < hidden
    num_local = tl.load(offs_ptr + num_experts - 1)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(TOP_K):  # k in order: the same bits every run
        p = tl.load(pos_ptr + t * TOP_K + k)
        local = p < num_local
        w = tl.load(w_ptr + t * TOP_K + k)
        y = tl.load(y_ptr + p * hidden + h, mask=h_mask & local, other=0.0).to(tl.float32)
        acc += tl.where(local, w * y, 0.0)
    tl.store(out_ptr + t * hidden + h, acc, mask=h_mask)


# ----------------------------------------------------------------------------------------------- wrappers


def _check_gate_up(x: torch.Tensor, w13: torch.Tensor) -> tuple[int, int, int]:
    """(E, H, I) of stacked gate/up weights `w13 [E, 2I, H]`, checked against rows `x [., H]`."""
    if x.dtype not in DTYPES or w13.dtype != x.dtype:
        raise ValueError(f"rows {x.dtype}, w13 {w13.dtype}: need one dtype of {DTYPES}")
    num_experts, two_inter, hidden = w13.shape
    if x.shape[-1] != hidden or two_inter % 2:
        raise ValueError(f"x {tuple(x.shape)} and w13 {tuple(w13.shape)} do not fit together")
    return num_experts, hidden, two_inter // 2


def _check_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> tuple[int, int, int]:
    """(E, H, I) of stacked experts `w13 [E, 2I, H]`, `w2 [E, H, I]`, checked against rows `x [., H]`."""
    num_experts, hidden, inter = _check_gate_up(x, w13)
    if w2.dtype != x.dtype or tuple(w2.shape) != (num_experts, hidden, inter):
        raise ValueError(f"w2 {tuple(w2.shape)} {w2.dtype} does not fit w13 {tuple(w13.shape)} {w13.dtype}")
    return num_experts, hidden, inter


def sort_pairs(
    topk_ids: torch.Tensor, expert_start: int, num_local: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`afd.model.moe.sort_pairs_by_expert` in one launch: `(pair_idx [P] int32, token_idx [P] int32, offs [E] int32)`
    for `topk_ids [T, K]`, P = T*K, E = num_local; same order (stable, non-local pairs last)."""
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    ids = topk_ids.reshape(-1).contiguous()  # [P]
    pair_idx = torch.empty(num_pairs, dtype=torch.int32, device=ids.device)
    token_idx = torch.empty(num_pairs, dtype=torch.int32, device=ids.device)
    offs = torch.empty(num_local, dtype=torch.int32, device=ids.device)
    block_i = 16
    pair_blocks = triton.cdiv(num_pairs, block_i)
    num_programs = pair_blocks + triton.cdiv(num_local, block_i)
    if num_programs == 0:
        return pair_idx, token_idx, offs
    _sort_pairs_kernel[(num_programs,)](
        ids,
        pair_idx,
        token_idx,
        offs,
        num_pairs,
        top_k,
        expert_start,
        num_local,
        pair_blocks,
        BLOCK_I=block_i,
        BLOCK_J=min(1024, max(16, triton.next_power_of_2(num_pairs))),
    )
    return pair_idx, token_idx, offs


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
    num_experts, hidden, inter = _check_gate_up(x, w13)
    num_rows = x.shape[0] if token_idx is None else token_idx.shape[0]
    act = x.new_empty(num_rows, inter)  # [N, I]
    if num_rows == 0 or num_experts == 0:
        return act
    cfg = config or _fit_dtype(gate_up_config(rows_hint or rows_per_expert_hint(num_rows, 1, num_experts)), x.dtype)
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
        PRECISION=_dot_precision(x.dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return act


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
) -> torch.Tensor:
    """Down projection of grouped rows: `out[dest[r]] = weights[dest[r]] * (act[r] @ w2[e].T)`.

    act: [N, I] grouped as `offs` [E] int32 says; w2: [E, H, I]; dest_idx: [N] int (None: `dest[r] = r`);
    weights: [P] fp32 indexed by destination (None: no weighting); out: [P, H] (default a new [N, H] fp32).
    Accumulates in fp32 and stores in out's dtype. Only destinations of rows in a group are written.
    """
    num_experts, hidden, inter = w2.shape
    if act.dtype != w2.dtype or act.shape[-1] != inter:
        raise ValueError(f"act {tuple(act.shape)} {act.dtype} does not fit w2 {tuple(w2.shape)} {w2.dtype}")
    if out is None:
        out = torch.empty(act.shape[0], hidden, dtype=torch.float32, device=act.device)  # [N, H]
    if act.shape[0] == 0 or num_experts == 0:
        return out
    if weights is not None and weights.dtype != torch.float32:
        raise ValueError(f"weights must be float32, got {weights.dtype}")
    cfg = config or _fit_dtype(down_config(rows_hint or rows_per_expert_hint(act.shape[0], 1, num_experts)), act.dtype)
    grid = (num_experts, triton.cdiv(hidden, cfg.block_n))
    _down_kernel[grid](
        act,
        offs,
        w2,
        out,
        dest_idx if dest_idx is not None else offs,  # unused without HAS_DEST
        weights if weights is not None else out,  # unused without HAS_WEIGHT
        hidden,
        inter,
        act.stride(0),
        act.stride(1),
        w2.stride(0),
        w2.stride(1),
        w2.stride(2),
        out.stride(0),
        out.stride(1),
        HAS_DEST=dest_idx is not None,
        HAS_WEIGHT=weights is not None,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        EVEN_N=hidden % cfg.block_n == 0,
        EVEN_K=inter % cfg.block_k == 0,
        PRECISION=_dot_precision(act.dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


def fused_grouped_expert_mlp(
    x: torch.Tensor,
    offs: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    configs: tuple[TileConfig, TileConfig] | None = None,
) -> torch.Tensor:
    """`afd.model.moe.grouped_expert_mlp_offsets` in two launches: x [N, H] grouped by `offs` [E] int32 (device
    cumulative ends), w13 [E, 2I, H], w2 [E, H, I] -> [N, H] in x.dtype, unweighted; rows at and past
    `offs[-1]` are not written (undefined), as there."""
    num_experts, _, _ = _check_experts(x, w13, w2)
    hint = rows_per_expert_hint(x.shape[0], 1, num_experts)
    up_cfg, down_cfg = configs or (None, None)
    act = expert_gate_up(x, offs, w13, rows_hint=hint, config=up_cfg)  # [N, I]
    out = torch.empty_like(x)  # [N, H]
    return expert_down(act, offs, w2, out=out, rows_hint=hint, config=down_cfg)


def fused_routed_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    expert_start: int = 0,
    *,
    configs: tuple[TileConfig, TileConfig] | None = None,
) -> torch.Tensor:
    """`afd.model.moe.routed_experts` in four launches: x [T, H] -> fp32 [T, H], the sum over the (t, k) pairs whose
    expert is one of the stacked `[expert_start, expert_start + E)` of `topk_weights[t, k] * expert(x[t])`.

    topk_ids: [T, K] int; topk_weights: [T, K] fp32; w13: [E, 2I, H]; w2: [E, H, I]. No host sync and shapes
    that depend only on (T, K): capturable in a CUDA graph; no atomics: the same bits every run.
    """
    num_experts, hidden, inter = _check_experts(x, w13, w2)
    num_tokens, top_k = topk_ids.shape
    out = torch.empty(num_tokens, hidden, dtype=torch.float32, device=x.device)  # [T, H]
    if num_tokens == 0:
        return out
    if num_experts == 0:
        return out.zero_()
    pair_idx, token_idx, offs = sort_pairs(topk_ids, expert_start, num_experts)  # [P], [P], [E]
    hint = rows_per_expert_hint(num_tokens, top_k, num_experts)
    up_cfg, down_cfg = configs or (None, None)
    act = expert_gate_up(x, offs, w13, token_idx=token_idx, rows_hint=hint, config=up_cfg)  # [P, I]
    by_pair = torch.empty(num_tokens * top_k, hidden, dtype=torch.float32, device=x.device)  # [P, H]
    weights = topk_weights.reshape(-1).float().contiguous()  # [P]
    expert_down(act, offs, w2, out=by_pair, dest_idx=pair_idx, weights=weights, rows_hint=hint, config=down_cfg)
    block_h = min(1024, triton.next_power_of_2(hidden))
    _combine_kernel[(num_tokens, triton.cdiv(hidden, block_h))](
        by_pair,
        topk_ids.reshape(-1).contiguous(),
        out,
        hidden,
        expert_start,
        num_experts,
        TOP_K=top_k,
        BLOCK_H=block_h,
    )
    return out


def combine_sorted_pairs(
    y: torch.Tensor, pair_idx: torch.Tensor, topk_weights: torch.Tensor, offs: torch.Tensor
) -> torch.Tensor:
    """The weighted combine after a grouped GEMM over expert-sorted pairs, in one pass: y [P, H] (pair
    `pair_idx[p]` of the flattened [T*K] routing at row p; rows at and past `offs[-1]` are not local and never
    read), topk_weights [T, K] fp32, offs [E] int32 -> fp32 [T, H] = sum over local k, in k order, of
    `w[t, k] * y[row of (t, k)]`. Replaces weigh + select + scatter back to pair order + sum (four passes over
    a [P, H] fp32 tensor at prefill sizes). No host sync, no atomics."""
    num_tokens, top_k = topk_weights.shape
    hidden = y.shape[1]
    out = torch.empty(num_tokens, hidden, dtype=torch.float32, device=y.device)  # [T, H]
    if num_tokens == 0:
        return out
    if offs.numel() == 0:
        return out.zero_()
    pos = torch.empty_like(pair_idx)  # [P] the inverse permutation of pair_idx
    pos[pair_idx] = torch.arange(pair_idx.numel(), device=pair_idx.device)
    block_h = min(1024, triton.next_power_of_2(hidden))
    _combine_sorted_kernel[(num_tokens, triton.cdiv(hidden, block_h))](
        y,
        pos,
        topk_weights.reshape(-1).float().contiguous(),
        offs,
        out,
        hidden,
        offs.numel(),
        TOP_K=top_k,
        BLOCK_H=block_h,
    )
    return out
