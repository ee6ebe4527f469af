"""Topology arithmetic for both connectors: pure functions, no torch.distributed.

`p2p`: world ranks FFN-first, `G = min(A, F)` sync groups, attention
rank `a` in group `a*G//A`, FFN rank `f` in group `f*G//F`. The smaller role has one
member per group (the hub); the others are spokes.

`async`: world ranks attention-first, `num_regions = max(A, F)`,
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
        """Largest local expert count (`ceil(E / F)`: the first FFN ranks take the remainder)."""
        return -(-self.num_experts // self.num_ffn)


def gpu_placement(connector: str, num_attention: int, num_ffn: int, num_gpus: int) -> list[int]:
    """GPU of each world rank for `afd launch` on one host. One GPU per rank when there are enough;
    otherwise pack ranks so that every GPU is used before any is shared and no NCCL communicator holds
    two ranks of one GPU (NCCL refuses that), which p2p needs and async does not.

    p2p packing, in world order (FFN ranks first): each rank takes the least-loaded GPU (lowest index
    on ties) that no rank of a communicator it belongs to (its sync group, the FFN role's expert group)
    already holds. Raises ValueError when no such GPU is left.
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
    needed = max([num_ffn] + [len(topo.group_world_ranks(g)) for g in topo.groups])
    if needed > num_gpus:
        raise ValueError(
            f"p2p {num_attention}A{num_ffn}F needs more than {num_gpus} GPUs: NCCL cannot hold two ranks of one "
            f"communicator on one GPU; use {needed} or more GPUs, or the async connector"
        )
    # GPUs are interchangeable, so FFN rank f (the expert group needs them apart) takes GPU f. Then the
    # attention ranks: the lightest busiest-GPU load that a flow from groups to GPUs can carry.
    ffn_gpu = list(range(num_ffn))
    groups = [(sorted(g.attn_ranks), {ffn_gpu[f] for f in g.ffn_ranks}) for g in topo.groups]
    for cap in range(-(-world_size // num_gpus), world_size + 1):
        per_group = _spread_attention(groups, num_gpus, [cap - (g < num_ffn) for g in range(num_gpus)])
        if per_group is not None:
            break
    else:  # pragma: no cover - cap = world_size always fits once every communicator fits
        raise AssertionError("no placement found")
    gpu = ffn_gpu + [0] * num_attention
    for (attn, _), gpus in zip(groups, per_group, strict=True):
        for a, g in zip(attn, sorted(gpus), strict=True):
            gpu[topo.world_rank("attention", a)] = g
    # every GPU busy before any is shared: an attention rank may always move to an idle GPU
    for g in range(num_gpus):
        if g not in gpu:
            shared = next((r for r in range(num_ffn, world_size) if gpu.count(gpu[r]) > 1), None)
            if shared is None:
                break
            gpu[shared] = g
    return gpu


def _spread_attention(
    groups: list[tuple[list[int], set[int]]], num_gpus: int, room: list[int]
) -> list[set[int]] | None:
    """Max flow source → group (its attention ranks) → GPU (1 each, not its FFN ranks' GPUs) → sink (`room`).

    Returns the GPU set of each group's attention ranks, or None when they do not all fit."""
    flow: dict[tuple[int, int], int] = {}  # (group, gpu) -> 0/1
    used = [0] * num_gpus

    def augment(group: int, seen: set[int]) -> bool:
        for g in range(num_gpus):
            if g in groups[group][1] or flow.get((group, g)) or g in seen:
                continue
            seen.add(g)
            if used[g] < room[g]:
                used[g] += 1
                flow[(group, g)] = 1
                return True
            # reroute a group that uses g to another GPU, freeing g for this one
            for other in range(len(groups)):
                if flow.get((other, g)) and augment(other, seen):
                    flow[(other, g)] = 0
                    flow[(group, g)] = 1
                    return True
        return False

    for i, (attn, _) in enumerate(groups):
        for _ in attn:
            if not augment(i, set()):
                return None
    return [{g for g in range(num_gpus) if flow.get((i, g))} for i in range(len(groups))]


def local_gpu_index(device_index: int | None, local_rank: int | None, visible: list[str] | None, num_gpus: int) -> int:
    """Which local GPU a hand-started rank (`afd worker`) uses, by torchrun's conventions: an explicit
    `--device-index`, else LOCAL_RANK, else the only visible GPU. Raises ValueError saying what to pass."""
    if num_gpus < 1:
        raise ValueError("--device cuda was given but no CUDA device is visible; use --device cpu")
    for index, source in ((device_index, "--device-index"), (local_rank, "LOCAL_RANK")):
        if index is not None:
            if not 0 <= index < num_gpus:
                raise ValueError(f"{source}={index} is outside the {num_gpus} visible GPU(s) (0..{num_gpus - 1})")
            return index
    if num_gpus == 1:
        return 0
    shown = f" (CUDA_VISIBLE_DEVICES={','.join(visible)})" if visible is not None else ""
    raise ValueError(
        f"this rank sees {num_gpus} GPUs{shown} and cannot tell which is its own; pass --device-index N, "
        "set LOCAL_RANK, or make one GPU visible with CUDA_VISIBLE_DEVICES"
    )
