"""The rendezvous of a world: each rank claims its world rank, publishes who it is, and waits, bounded, for the
others; a rank that never arrives is named, and so is one started with different sizes."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Literal

import torch.distributed as dist

from afd.distributed.store import RendezvousError, RunKeys, read_record
from afd.topology import Role

WorldOrder = Literal["ffn_first", "attention_first"]


def role_of_world(world_rank: int, num_attention: int, num_ffn: int, world_order: WorldOrder) -> tuple[Role, int]:
    """(role, role rank) of a world rank under a world order."""
    first: Role = "ffn" if world_order == "ffn_first" else "attention"
    second: Role = "attention" if first == "ffn" else "ffn"
    num_first = num_ffn if first == "ffn" else num_attention
    return (first, world_rank) if world_rank < num_first else (second, world_rank - num_first)


@dataclass(frozen=True)
class RankInfo:
    """What a rank publishes at rendezvous."""

    world_rank: int
    role: Role
    role_rank: int
    num_attention: int
    num_ffn: int
    world_order: WorldOrder
    host: str
    pid: int
    dtype: str | None = None  # an attention rank's compute dtype: the FFN ranks take it

    @property
    def name(self) -> str:
        return f"world rank {self.world_rank} ({self.role} {self.role_rank})"

    def sizes(self) -> tuple[int, int, str]:
        return self.num_attention, self.num_ffn, self.world_order


def rendezvous(
    store: dist.Store,
    keys: RunKeys,
    me: RankInfo,
    world_size: int,
    timeout: float,
    is_host: bool,
    rejoin: bool = False,
) -> dict[int, RankInfo]:
    """Publish `arrived/{rank}` and collect every other rank's, checking they agree on the sizes. `rejoin`: this
    process restarts a rank of a running world (its earlier claim is the dead incarnation's)."""
    if int(store.add(f"claim/{me.world_rank}", 1)) > 1 and not rejoin:
        raise RendezvousError(f"two processes were started as {me.name}; each world rank must be started once")
    key = f"arrived/{me.world_rank}"
    store.set(key, keys.sign(key, json.dumps(asdict(me))))
    peers = {me.world_rank: me}
    # The store host gives up last, so the others can still read the store when they give up.
    deadline = time.monotonic() + timeout + (1.0 if is_host else 0.0)
    while True:
        _collect_arrivals(store, keys, me, world_size, peers)  # a store error: init_world names the host
        if len(peers) == world_size:
            return peers
        if time.monotonic() >= deadline:
            raise RendezvousError(
                f"{me.name}: {_missing(me, world_size, peers)} did not arrive within {timeout:.1f}s at the AFD "
                "world store; start them, or check their host, port, sizes and AFD_SECRET"
            )
        time.sleep(0.02)


def _collect_arrivals(
    store: dist.Store, keys: RunKeys, me: RankInfo, world_size: int, peers: dict[int, RankInfo]
) -> None:
    for r in range(world_size):
        if r in peers:
            continue
        body = read_record(store, keys, f"arrived/{r}")
        if body is None:
            continue
        info = RankInfo(**json.loads(body))
        if info.sizes() != me.sizes():
            raise RendezvousError(
                f"{info.name} (pid {info.pid} on {info.host}) was started with num_attention="
                f"{info.num_attention}, num_ffn={info.num_ffn}, world order {info.world_order}, but "
                f"{me.name} with num_attention={me.num_attention}, num_ffn={me.num_ffn}, world order "
                f"{me.world_order}; start every rank with the same sizes"
            )
        peers[r] = info


def _missing(me: RankInfo, world_size: int, peers: dict[int, RankInfo]) -> str:
    return ", ".join(
        "world rank {} ({} {})".format(r, *role_of_world(r, me.num_attention, me.num_ffn, me.world_order))
        for r in range(world_size)
        if r not in peers
    )
