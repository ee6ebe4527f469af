"""Topology arithmetic for both connectors: pure functions, no torch.distributed.

`p2p` (DESIGN.md §1.1): world ranks FFN-first, `G = min(A, F)` sync groups, attention
rank `a` in group `a*G//A`, FFN rank `f` in group `f*G//F`. The smaller role has one
member per group (the hub); the others are spokes.

`async` (DESIGN.md §1.2): world ranks attention-first, `num_regions = max(A, F)`,
routed experts owned in contiguous ranges per FFN rank, shared-expert rows round-robin.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Literal

Role = Literal["attention", "ffn"]
ROLES: tuple[Role, ...] = ("attention", "ffn")


def even_split(total: int, parts: int) -> list[int]:
    """Sizes as even as possible; earlier parts take the remainder."""
    if parts < 1:
        raise ValueError(f"cannot split into {parts} parts; need at least 1")
    if total < 0:
        raise ValueError(f"cannot split a negative count ({total})")
    return [total // parts + (i < total % parts) for i in range(parts)]


def _check_sizes(num_attention: int, num_ffn: int) -> None:
    for name, value in (("num_attention_ranks", num_attention), ("num_ffn_ranks", num_ffn)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class SyncGroup:
    """One p2p sync group: role ranks in ascending order."""

    index: int
    attn_ranks: tuple[int, ...]
    ffn_ranks: tuple[int, ...]

    @property
    def hub_role(self) -> Role:
        """The role with exactly one member in every group (FFN when A >= F)."""
        return "ffn" if len(self.ffn_ranks) == 1 else "attention"


@dataclass(frozen=True)
class SyncTopology:
    """The `p2p` layout of A attention and F FFN ranks."""

    num_attention: int
    num_ffn: int

    def __post_init__(self) -> None:
        _check_sizes(self.num_attention, self.num_ffn)

    @property
    def num_groups(self) -> int:
        return min(self.num_attention, self.num_ffn)

    @property
    def world_size(self) -> int:
        return self.num_attention + self.num_ffn

    def group_of_attn(self, attn_rank: int) -> int:
        return attn_rank * self.num_groups // self.num_attention

    def group_of_ffn(self, ffn_rank: int) -> int:
        return ffn_rank * self.num_groups // self.num_ffn

    def group_of(self, role: Role, role_rank: int) -> int:
        return self.group_of_attn(role_rank) if role == "attention" else self.group_of_ffn(role_rank)

    @cached_property
    def groups(self) -> list[SyncGroup]:
        return [
            SyncGroup(
                index=g,
                attn_ranks=tuple(a for a in range(self.num_attention) if self.group_of_attn(a) == g),
                ffn_ranks=tuple(f for f in range(self.num_ffn) if self.group_of_ffn(f) == g),
            )
            for g in range(self.num_groups)
        ]

    def group(self, role: Role, role_rank: int) -> SyncGroup:
        return self.groups[self.group_of(role, role_rank)]

    def world_rank(self, role: Role, role_rank: int) -> int:
        """FFN ranks first, then attention ranks."""
        return role_rank if role == "ffn" else self.num_ffn + role_rank

    def role_of_world(self, world_rank: int) -> tuple[Role, int]:
        if world_rank < self.num_ffn:
            return "ffn", world_rank
        return "attention", world_rank - self.num_ffn

    def group_world_ranks(self, group: SyncGroup) -> list[int]:
        """World ranks of a group in world order (FFN members first)."""
        return [self.world_rank("ffn", f) for f in group.ffn_ranks] + [
            self.world_rank("attention", a) for a in group.attn_ranks
        ]

    def peers(self, role: Role, role_rank: int) -> tuple[int, ...]:
        """Role ranks of the opposite role that this rank exchanges rows with."""
        group = self.group(role, role_rank)
        return group.ffn_ranks if role == "attention" else group.attn_ranks

    def splits(self, attn_rank: int, num_tokens: int) -> list[int]:
        """Token counts an attention rank sends to each FFN member of its group (ascending FFN rank)."""
        return even_split(num_tokens, len(self.group("attention", attn_rank).ffn_ranks))

    def to_json(self, num_tokens: int | None = None) -> dict:
        out: dict = {
            "attention": self.num_attention,
            "ffn": self.num_ffn,
            "groups": [{"attention": list(g.attn_ranks), "ffn": list(g.ffn_ranks)} for g in self.groups],
        }
        if num_tokens is not None:
            out["splits"] = {str(a): self.splits(a, num_tokens) for a in range(self.num_attention)}
        return out


def expert_ranges(num_experts: int, num_ffn: int) -> list[range]:
    """Contiguous routed-expert ranges per FFN rank; earlier ranks take one extra when F does not divide E.

    Used by both connectors, so an FFN rank owns the same experts whichever carries the rows.
    """
    sizes = even_split(num_experts, num_ffn)
    starts = [sum(sizes[:i]) for i in range(num_ffn)]
    return [range(s, s + n) for s, n in zip(starts, sizes, strict=True)]


@dataclass(frozen=True)
class AsyncTopology:
    """The `async` layout: attention-first world ranks, one window region per sender role rank."""

    num_attention: int
    num_ffn: int
    num_experts: int

    def __post_init__(self) -> None:
        _check_sizes(self.num_attention, self.num_ffn)
        if self.num_experts < self.num_ffn:
            raise ValueError(
                f"{self.num_experts} routed experts cannot be spread over {self.num_ffn} FFN ranks; "
                f"use at most {self.num_experts} FFN ranks"
            )

    @property
    def world_size(self) -> int:
        return self.num_attention + self.num_ffn

    @property
    def num_regions(self) -> int:
        return max(self.num_attention, self.num_ffn)

    def world_rank(self, role: Role, role_rank: int) -> int:
        """Attention ranks first, then FFN ranks (== NVSHMEM PE)."""
        return role_rank if role == "attention" else self.num_attention + role_rank

    def role_of_world(self, world_rank: int) -> tuple[Role, int]:
        if world_rank < self.num_attention:
            return "attention", world_rank
        return "ffn", world_rank - self.num_attention

    @property
    def expert_ranges(self) -> list[range]:
        return expert_ranges(self.num_experts, self.num_ffn)

    @property
    def experts_per_rank(self) -> int:
        """Largest local expert count: sizes the header's expert_counts field."""
        return -(-self.num_experts // self.num_ffn)



def gpu_placement(connector: str, num_attention: int, num_ffn: int, num_gpus: int) -> list[int]:
    """GPU of each world rank. One GPU per rank when there are enough; otherwise pack ranks so that no
    NCCL communicator holds two ranks of one GPU (NCCL refuses that), which p2p needs and async does not.

    p2p packing: FFN rank f on GPU f % n; the members of a sync group other than its FFN hub on the
    GPUs after the hub's. Raises ValueError when the layout cannot avoid a shared GPU in a communicator.
    """
    if num_gpus < 1:
        raise ValueError("no GPU is visible; use --device cpu")
    world_size = num_attention + num_ffn
    if connector == "async" and world_size > num_gpus and world_size % num_gpus:
        raise ValueError(
            f"async {num_attention}A{num_ffn}F puts {world_size} NVSHMEM PEs on {num_gpus} GPUs; NVSHMEM needs the "
            f"same number on every GPU (unbalanced placement hangs in its init): use a multiple of {num_gpus} ranks"
        )
    if num_gpus >= world_size or connector == "async":
        return [r % num_gpus for r in range(world_size)]  # async: attention-first order, PEs spread evenly
    topo = SyncTopology(num_attention, num_ffn)
    gpu = [0] * world_size
    for f in range(num_ffn):
        gpu[topo.world_rank("ffn", f)] = f % num_gpus
    for group in topo.groups:
        base = group.ffn_ranks[0] % num_gpus
        for i, a in enumerate(group.attn_ranks):
            gpu[topo.world_rank("attention", a)] = (base + len(group.ffn_ranks) + i) % num_gpus
    communicators = [topo.group_world_ranks(g) for g in topo.groups] + [list(range(num_ffn))]
    needed = max(len(c) for c in communicators)
    for ranks in communicators:
        used = [gpu[r] for r in ranks]
        if len(set(used)) != len(used):
            raise ValueError(
                f"p2p {num_attention}A{num_ffn}F needs more than {num_gpus} GPUs: NCCL cannot hold two ranks of one "
                f"communicator on one GPU; use {needed} or more GPUs, or the async connector"
            )
    return gpu
