"""Pure dispatch planning and combine of the `async` connector (wire version 3).

One row per (token, destination FFN rank): a token travels once to every FFN rank that owns at
least one of its top-k experts, with its whole top-k in band; that rank computes its own experts
for the token and answers one weighted partial sum. The shared experts of each token run on
exactly one of the ranks it already goes to — the first of them at or cyclically after `t % F`
(today's round robin wherever the token goes there anyway) — so they never cost an extra row.

Planning is one stable argsort over a (destination, shared-first) key of the `[F, T]` membership
matrix: each rank's rows form one contiguous segment, its shared rows leading, tokens ascending.
The counts (`2F` integers) are the only device→host copy of a send; with one FFN rank they are
known without it (every token goes there, shared experts included), so that send never waits on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertMap:
    """Which FFN rank owns each routed expert (contiguous ranges, `afd.topology.expert_ranges`)."""

    owner: torch.Tensor  # [E] int64: FFN rank of expert e
    starts: tuple[int, ...]  # first global expert id of each FFN rank
    num_local: tuple[int, ...]  # experts held by each FFN rank

    @classmethod
    def from_ranges(cls, ranges: list[range], device: torch.device | str = "cpu") -> ExpertMap:
        owner: list[int] = []
        for f, r in enumerate(ranges):
            if r.start != len(owner):
                raise ValueError(f"expert ranges must be contiguous from 0, got {ranges}")
            owner += [f] * len(r)
        return cls(
            owner=torch.tensor(owner, dtype=torch.int64, device=device),
            starts=tuple(r.start for r in ranges),
            num_local=tuple(len(r) for r in ranges),
        )

    @property
    def num_ffn(self) -> int:
        return len(self.num_local)


@dataclass(frozen=True)
class DispatchPlan:
    """Which token each row of each FFN rank's message is. Tensors on the routing device."""

    num_tokens: int
    token_index: torch.Tensor  # [N] int64: token of every row, FFN rank by rank (segments), shared rows first
    rows: tuple[int, ...]  # rows per FFN rank (tokens that own at least one of its experts)
    shared_rows: tuple[int, ...]  # leading rows of each segment whose shared experts run there
    offsets: tuple[int, ...]  # segment starts, len F + 1

    def segment(self, ffn_rank: int) -> slice:
        return slice(self.offsets[ffn_rank], self.offsets[ffn_rank + 1])

    def dest_ranks(self) -> list[int]:
        """FFN ranks that get at least one row: the only ones to send to and wait on."""
        return [f for f, n in enumerate(self.rows) if n]


def destinations(topk_ids: torch.Tensor, owner: torch.Tensor, num_ffn: int) -> torch.Tensor:
    """is_dest [T, F] bool: whether FFN rank f owns at least one of token t's experts."""
    num_tokens = topk_ids.shape[0]
    is_dest = torch.zeros(num_tokens, num_ffn, dtype=torch.bool, device=topk_ids.device)
    return is_dest.scatter_(1, owner[topk_ids], True)


def shared_owner(is_dest: torch.Tensor) -> torch.Tensor:
    """[T] int64: the FFN rank computing token t's shared experts — the first destination of t at or
    cyclically after `t % F`. is_dest: [T, F] bool with at least one True per row."""
    num_tokens, num_ffn = is_dest.shape
    start = torch.arange(num_tokens, device=is_dest.device) % num_ffn  # [T]
    rotation = (start[:, None] + torch.arange(num_ffn, device=is_dest.device)) % num_ffn  # [T, F]
    first = is_dest.gather(1, rotation).to(torch.int32).argmax(1, keepdim=True)  # [T, 1]: first True
    return rotation.gather(1, first).squeeze(1)


def plan_dispatch(
    topk_ids: torch.Tensor,
    expert_map: ExpertMap,
    *,
    counts_host: torch.Tensor | None = None,
    shared_on_ffn: bool = True,
    row_index: torch.Tensor | None = None,
) -> DispatchPlan:
    """Plan one send. topk_ids: [T, K] int64 global expert ids.

    counts_host: optional [2F] int64 host buffer (pinned on CUDA) for the one device→host copy;
    without it `.tolist()` is used. shared_on_ffn=False: the attention rank runs the shared experts
    itself, so no row is a shared row (every `shared_rows` is 0). row_index: `arange(n)` on the routing device
    with n >= T, sliced for the one-FFN-rank plan instead of a new arange per send.
    """
    num_tokens = topk_ids.shape[0]
    num_ffn, device = expert_map.num_ffn, topk_ids.device
    if num_ffn == 1:  # every token goes to the one FFN rank, shared experts included: no count to read back
        token_index = row_index[:num_tokens] if row_index is not None else torch.arange(num_tokens, device=device)
        shared = num_tokens if shared_on_ffn else 0
        return DispatchPlan(num_tokens, token_index, (num_tokens,), (shared,), (0, num_tokens))
    is_dest = destinations(topk_ids, expert_map.owner, num_ffn)  # [T, F]
    ranks = torch.arange(num_ffn, device=device)  # [F]
    if shared_on_ffn:
        is_shared = ranks[None, :] == shared_owner(is_dest)[:, None]  # [T, F]
    else:
        is_shared = torch.zeros_like(is_dest)
    # key per (f, t): 2f for a shared row, 2f + 1 for another row of f, 2F for no row; f-major order
    key = torch.where(is_dest, 2 * ranks[None, :] + (~is_shared).long(), 2 * num_ffn).t().reshape(-1)  # [F*T]
    order = torch.argsort(key, stable=True)  # [F*T]: flat index f*T + t
    # counts by scatter_add_ (a CUDA bincount reads its maximum back to the host)
    counts = torch.zeros(2 * num_ffn + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    if counts_host is not None and counts.is_cuda:
        counts_host.copy_(counts[: 2 * num_ffn], non_blocking=True)
        torch.cuda.current_stream(device).synchronize()
        counts_list = counts_host.tolist()
    else:
        counts_list = counts[: 2 * num_ffn].tolist()  # the one device→host copy of this send
    shared = tuple(counts_list[0::2])
    rows = tuple(s + o for s, o in zip(shared, counts_list[1::2], strict=True))
    offsets = [0]
    for n in rows:
        offsets.append(offsets[-1] + n)
    token_index = order[: offsets[-1]] % max(num_tokens, 1)  # [N]
    return DispatchPlan(num_tokens, token_index, rows, shared, tuple(offsets))


def combine_scatter(acc: torch.Tensor, rows: torch.Tensor, token_index: torch.Tensor) -> torch.Tensor:
    """acc[token_index[i]] += rows[i] in fp32, in place. acc: [T, H] fp32; rows: [N, H] any float dtype;
    token_index: [N] int64 without repeats (one row per token and FFN rank), so the sum into each
    token is in call order: call it FFN rank by rank for the same bits on every run."""
    if rows.shape[0] == 0:
        return acc
    return acc.index_add_(0, token_index, rows.float())
