"""What the `p2p` connector moves, pure: who sends how many rows to whom, the fused row payload, and
the FFN role's expert all-to-all plan. No process groups here, so all of it is tested without processes.

Per boundary layer an attention rank sends each FFN member of its sync group ONE message: the rows'
top-k weights, ids and hidden states packed into one byte buffer (`RowPayload`). Its layout has no
header: both sides know the row count from the step's control message and the shapes from the model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache

import torch

from afd.topology import SyncTopology, even_split, expert_ranges


# ---------------------------------------------------------------------------------------------
# Wiring: who sends how many rows to whom. The connector uses exactly these.
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RowSend:
    """One attention -> FFN transfer of a layer (the result comes back on the same path)."""

    attn_rank: int
    ffn_rank: int
    num_rows: int
    attn_offset: int  # first row in the attention rank's batch
    ffn_offset: int  # first row in the FFN rank's concatenated input


def attn_sends(topology: SyncTopology, attn_rank: int, num_tokens: int) -> list[RowSend]:
    """Transfers from one attention rank with `num_tokens` rows, ascending FFN rank (zero rows kept)."""
    group = topology.group("attention", attn_rank)
    if len(group.ffn_ranks) == 1:  # A >= F: everything to the FFN hub, after the lower spokes' rows
        raise ValueError("attn_sends needs every spoke's count when A >= F; use plan_layer")
    sizes = even_split(num_tokens, len(group.ffn_ranks))
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    return [RowSend(attn_rank, f, n, o, 0) for f, n, o in zip(group.ffn_ranks, sizes, offsets, strict=True)]


def ffn_recvs(topology: SyncTopology, ffn_rank: int, attn_tokens: Mapping[int, int]) -> list[RowSend]:
    """Transfers into one FFN rank, ascending attention rank; `attn_tokens` has its peers' step counts."""
    group = topology.group("ffn", ffn_rank)
    if len(group.ffn_ranks) == 1:
        sends, offset = [], 0
        for a in group.attn_ranks:
            sends.append(RowSend(a, ffn_rank, attn_tokens[a], 0, offset))
            offset += attn_tokens[a]
        return sends
    (hub,) = group.attn_ranks
    return [s for s in attn_sends(topology, hub, attn_tokens[hub]) if s.ffn_rank == ffn_rank]


def plan_layer(topology: SyncTopology, attn_tokens: Sequence[int]) -> list[RowSend]:
    """Every transfer of one boundary layer, given each attention rank's step token count."""
    counts = dict(enumerate(attn_tokens))
    if len(counts) != topology.num_attention:
        raise ValueError(f"need {topology.num_attention} token counts, got {len(counts)}")
    return [s for f in range(topology.num_ffn) for s in ffn_recvs(topology, f, counts)]


def ffn_rows(topology: SyncTopology, attn_tokens: Sequence[int]) -> list[int]:
    """Rows each FFN rank holds in a layer: its summed count entering the expert all-to-all."""
    rows = [0] * topology.num_ffn
    for s in plan_layer(topology, attn_tokens):
        rows[s.ffn_rank] += s.num_rows
    return rows


# ---------------------------------------------------------------------------------------------
# The fused row payload: one message per (peer, layer) instead of one per tensor.
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RowPayload:
    """Byte layout of `n` rows in one uint8 buffer: `[weights n*K fp32 | ids n*K int32 | x n*H dtype]`.

    fp32 and int32 first keep every part aligned for its view whatever n, H and the dtype are. With
    `topk == 0` (the gate on FFN: no routing travels) the payload is the hidden states alone.
    """

    hidden_size: int
    topk: int
    dtype: torch.dtype

    def _split(self, num_rows: int) -> tuple[int, int, int]:
        routing = num_rows * self.topk * 4
        x = num_rows * self.hidden_size * torch.empty((), dtype=self.dtype).element_size()
        return routing, 2 * routing, 2 * routing + x

    def nbytes(self, num_rows: int) -> int:
        return self._split(num_rows)[2]

    def pack(
        self, x: torch.Tensor, topk_ids: torch.Tensor | None = None, topk_weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x: [n, H] dtype, topk_ids / topk_weights: [n, K] (any int / float dtype) -> [nbytes(n)] uint8."""
        num_rows = x.shape[0]
        buf = torch.empty(self.nbytes(num_rows), dtype=torch.uint8, device=x.device)
        x_view, ids_view, weights_view = self.unpack(buf, num_rows)
        x_view.copy_(x)
        if self.topk:
            if topk_ids is None or topk_weights is None:
                raise ValueError("a payload with routing needs topk_ids and topk_weights")
            ids_view.copy_(topk_ids)
            weights_view.copy_(topk_weights)
        return buf

    def unpack(self, buf: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[nbytes(n)] uint8 -> views (x [n, H] dtype, topk_ids [n, K] int32, topk_weights [n, K] fp32)."""
        w_end, ids_end, end = self._split(num_rows)
        if buf.numel() != end:
            raise ValueError(f"a payload of {num_rows} rows has {end} bytes, got {buf.numel()}")
        weights = buf[:w_end].view(torch.float32).view(num_rows, self.topk)
        ids = buf[w_end:ids_end].view(torch.int32).view(num_rows, self.topk)
        x = buf[ids_end:end].view(self.dtype).view(num_rows, self.hidden_size)
        return x, ids, weights


# ---------------------------------------------------------------------------------------------
# The FFN role's expert all-to-all
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EpDispatch:
    """How one FFN rank's (row, k) pairs leave for the expert owners.

    Pairs are sorted by global expert id, which sorts them by owner and, within an owner, by
    local expert; `counts[f, i]` pairs go to FFN rank f's local expert i.
    """

    order: torch.Tensor  # [P] int64: flat (t*K + k) index of each sorted pair
    token: torch.Tensor  # [P] int64: source row of each sorted pair
    weight: torch.Tensor  # [P] fp32: its top-k weight
    counts: torch.Tensor  # [F, max_local] int64

    @property
    def send_splits(self) -> list[int]:
        return self.counts.sum(1).tolist()


@cache
def _expert_slots(num_experts: int, num_ffn: int, device: torch.device) -> torch.Tensor:
    """[E] int64: the (owner, local expert) cell `f * max_local + local` of each expert; made once per
    device, not copied from the host every layer."""
    ranges = expert_ranges(num_experts, num_ffn)
    max_local = max(len(r) for r in ranges)
    cells = [f * max_local + e - r.start for f, r in enumerate(ranges) for e in r]
    return torch.tensor(cells, dtype=torch.long).to(device)


def plan_ep_dispatch(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, num_ffn: int) -> EpDispatch:
    """topk_ids: [T, K] integer, topk_weights: [T, K] -> the dispatch of the T*K pairs. No host sync on
    CUDA: counts by `scatter_add_` (a CUDA `bincount` reads its maximum back); a bad id there is a device
    assert, on CPU a ValueError."""
    num_tokens, topk = topk_ids.shape
    flat = topk_ids.reshape(-1).long()  # [P]
    if not flat.is_cuda and flat.numel() and not 0 <= int(flat.min()) <= int(flat.max()) < num_experts:
        raise ValueError(f"expert ids must lie in [0, {num_experts}), got {flat.min()}..{flat.max()}")
    order = torch.argsort(flat, stable=True)  # [P]
    max_local = -(-num_experts // num_ffn)  # the largest range of expert_ranges
    cells = _expert_slots(num_experts, num_ffn, flat.device)[flat]  # [P]
    counts = torch.zeros(num_ffn * max_local, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, cells, torch.ones_like(cells))
    return EpDispatch(
        order=order,
        token=order // topk,
        weight=topk_weights.reshape(-1)[order].float(),
        counts=counts.view(num_ffn, max_local),
    )


def ep_send_matrix(topk_ids_per_ffn: Sequence[torch.Tensor], num_experts: int) -> list[list[int]]:
    """`m[src][dst]`: (row, k) pairs FFN rank src sends to dst in the expert all-to-all."""
    num_ffn = len(topk_ids_per_ffn)
    return [plan_ep_dispatch(ids, torch.ones(ids.shape), num_experts, num_ffn).send_splits for ids in topk_ids_per_ffn]
