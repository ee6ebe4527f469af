"""`sort_pairs`: the (token, k) pairs of a routing grouped by local expert, in one launch.

A counting sort: a pair's slot is `#(pairs with a smaller key) + #(earlier pairs with the same key)`, so ties
keep pair order (stable) and non-local pairs (key = sentinel) sort last, exactly like
`afd.routing.sort_pairs_by_expert`. No atomics, no read back to the host: capturable, the same bits every run.
Every program scans all the keys, so its work grows with the square of the pairs: past
`COUNTING_SORT_MAX_PAIRS` (prefill sizes) `sort_pairs` takes `sort_pairs_by_expert`'s stable argsort instead, the
same order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from afd.routing import sort_pairs_by_expert

PAIR_BLOCK = 16  # pairs placed (or group ends computed) per program
# The most pairs the counting sort takes. H200, top-6 of 64 experts, ms per sort, counting / argsort
# (`scripts/gpu_moe_fp8.py --sort`): 2,048 tokens (12,288 pairs) 0.058 / 0.098, 4,096 tokens 0.217 / 0.091.
COUNTING_SORT_MAX_PAIRS = 16384


def pair_tile(num_pairs: int) -> int:
    """Keys each program scans per step: every pair in one step up to 1024 pairs."""
    return min(1024, max(16, triton.next_power_of_2(num_pairs)))


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


def sort_pairs(
    topk_ids: torch.Tensor, expert_start: int, num_local: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`afd.routing.sort_pairs_by_expert` as int32: `(pair_idx [P] int32, token_idx [P] int32, offs [E] int32)` for
    `topk_ids [T, K]`, P = T*K, E = num_local; same order (stable, non-local pairs last). The counting sort (one
    launch) up to `COUNTING_SORT_MAX_PAIRS`, the argsort past it."""
    if topk_ids.numel() <= COUNTING_SORT_MAX_PAIRS:
        return counting_sort_pairs(topk_ids, expert_start, num_local)
    pairs = sort_pairs_by_expert(topk_ids, expert_start, expert_start + num_local)
    return pairs.pair_idx.int(), pairs.token_idx.int(), pairs.offs


def counting_sort_pairs(
    topk_ids: torch.Tensor, expert_start: int, num_local: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`sort_pairs` in one launch of the counting sort, at any size."""
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    ids = topk_ids.reshape(-1).contiguous()  # [P]
    pair_idx = torch.empty(num_pairs, dtype=torch.int32, device=ids.device)
    token_idx = torch.empty(num_pairs, dtype=torch.int32, device=ids.device)
    offs = torch.empty(num_local, dtype=torch.int32, device=ids.device)
    pair_blocks = triton.cdiv(num_pairs, PAIR_BLOCK)
    num_programs = pair_blocks + triton.cdiv(num_local, PAIR_BLOCK)
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
        BLOCK_I=PAIR_BLOCK,
        BLOCK_J=pair_tile(num_pairs),
    )
    return pair_idx, token_idx, offs
