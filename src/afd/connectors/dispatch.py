"""Pure token-level dispatch planning and the weighted combine of the `async` connector.

One stable argsort over the key `dest_ffn_rank * experts_per_rank + local_expert` orders every
(token, k) partial so that each FFN rank's rows are one contiguous segment, already grouped by
local expert — exactly what the receiver computes as a top-1 grouped problem. `bincount` gives
the group lists, a host prefix sum the segment offsets; the counts are the only device→host copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertMap:
    """Which FFN rank owns each routed expert and its index there (contiguous ranges)."""

    owner: torch.Tensor  # [E] int64: FFN rank of expert e
    local: torch.Tensor  # [E] int64: local expert index of e on its owner
    num_local: tuple[int, ...]  # experts held by each FFN rank
    experts_per_rank: int  # max(num_local): sizes the header's expert_counts

    @classmethod
    def from_ranges(cls, ranges: list[range], device: torch.device | str = "cpu") -> ExpertMap:
        owner: list[int] = []
        local: list[int] = []
        for f, r in enumerate(ranges):
            if owner and r.start != len(owner):
                raise ValueError(f"expert ranges must be contiguous from 0, got {ranges}")
            owner += [f] * len(r)
            local += list(range(len(r)))
        return cls(
            owner=torch.tensor(owner, dtype=torch.int64, device=device),
            local=torch.tensor(local, dtype=torch.int64, device=device),
            num_local=tuple(len(r) for r in ranges),
            experts_per_rank=max(len(r) for r in ranges),
        )

    @property
    def num_ffn(self) -> int:
        return len(self.num_local)


@dataclass(frozen=True)
class DispatchPlan:
    """Where every (token, k) partial of one send goes. Tensors on the routing device."""

    num_tokens: int
    topk: int
    order: torch.Tensor  # [T*K] int64: flat (t*K + k) partial index, sorted by (dest, local expert)
    token_index: torch.Tensor  # [T*K] int64: token of each sorted partial (order // K)
    dest_counts: list[int]  # routed rows per FFN rank
    dest_offsets: list[int]  # start of each FFN rank's segment in `order` (len F + 1)
    group_sizes: list[list[int]]  # per FFN rank: rows per local expert (len num_local[f])
    shared_counts: list[int]  # shared-expert rows per FFN rank (round robin)

    def segment(self, ffn_rank: int) -> slice:
        return slice(self.dest_offsets[ffn_rank], self.dest_offsets[ffn_rank + 1])

    def dest_ranks(self) -> list[int]:
        """FFN ranks that get at least one routed or shared row: the only ones to send to / wait on."""
        return [f for f, (r, s) in enumerate(zip(self.dest_counts, self.shared_counts, strict=True)) if r or s]


def shared_token_index(ffn_rank: int, num_tokens: int, num_ffn: int, device: torch.device | str) -> torch.Tensor:
    """Tokens whose shared-expert rows go to `ffn_rank`: arange(f, T, F) → [ceil((T-f)/F)] int64."""
    return torch.arange(min(ffn_rank, num_tokens), num_tokens, num_ffn, dtype=torch.int64, device=device)


def plan_dispatch(
    topk_ids: torch.Tensor, expert_map: ExpertMap, *, counts_host: torch.Tensor | None = None
) -> DispatchPlan:
    """Plan one send. topk_ids: [T, K] int64 global expert ids.

    counts_host: optional [F * experts_per_rank] int64 host buffer (pinned on CUDA) for the one
    device→host copy; without it `.cpu()` is used.
    """
    num_tokens, topk = topk_ids.shape
    num_ffn, per_rank = expert_map.num_ffn, expert_map.experts_per_rank
    flat = topk_ids.reshape(-1)  # [T*K]
    key = expert_map.owner[flat] * per_rank + expert_map.local[flat]  # [T*K]
    order = torch.argsort(key, stable=True)  # [T*K]
    counts = torch.bincount(key, minlength=num_ffn * per_rank)  # [F*Er]
    if counts_host is not None and counts.is_cuda:
        counts_host.copy_(counts, non_blocking=True)
        torch.cuda.current_stream(counts.device).synchronize()
        counts_list = counts_host.tolist()
    else:
        counts_list = counts.tolist()  # the one device→host copy of this send
    group_sizes = [counts_list[f * per_rank : f * per_rank + expert_map.num_local[f]] for f in range(num_ffn)]
    dest_counts = [sum(g) for g in group_sizes]
    offsets = [0]
    for c in dest_counts:
        offsets.append(offsets[-1] + c)
    return DispatchPlan(
        num_tokens=num_tokens,
        topk=topk,
        order=order,
        token_index=order // topk,
        dest_counts=dest_counts,
        dest_offsets=offsets,
        group_sizes=group_sizes,
        shared_counts=[len(range(f, num_tokens, num_ffn)) for f in range(num_ffn)],
    )


def combine_scatter(
    acc: torch.Tensor, rows: torch.Tensor, token_index: torch.Tensor, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """acc[token_index[i]] += weights[i] * rows[i], in fp32, in place.

    acc: [T, H] fp32; rows: [N, H] any float dtype; token_index: [N] int64; weights: [N] fp32 or
    None (shared rows: unit weight).
    """
    if rows.shape[0] == 0:
        return acc
    src = rows.float()  # [N, H]
    if weights is not None:
        src = src * weights.to(torch.float32).unsqueeze(1)
    return acc.index_add_(0, token_index, src)
