"""The combine after the expert GEMMs: each token's fp32 sum over its local (t, k) pairs, k in order.

A fixed summation order and no atomics: the same bits every run. `combine_pairs` reads outputs already in pair
order (decode, after `expert_down` stored by destination); `combine_sorted_pairs` reads them in expert-sorted
order and weighs them on the way (prefill, after a grouped GEMM).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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


def combine_pairs(
    by_pair: torch.Tensor, topk_ids: torch.Tensor, out: torch.Tensor, expert_start: int, num_local: int
) -> torch.Tensor:
    """`out[t] = sum_k by_pair[t*K + k]` over the pairs whose expert is one of `[expert_start, expert_start +
    num_local)`: by_pair [T*K, H] fp32 (rows of non-local pairs never read), topk_ids [T, K] int, out [T, H] fp32
    (written in place and returned)."""
    num_tokens, top_k = topk_ids.shape
    hidden = out.shape[1]
    block_h = min(1024, triton.next_power_of_2(hidden))
    _combine_kernel[(num_tokens, triton.cdiv(hidden, block_h))](
        by_pair,
        topk_ids.reshape(-1).contiguous(),
        out,
        hidden,
        expert_start,
        num_local,
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
