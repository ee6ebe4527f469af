"""What both roles of the `async` connector share: the window, the geometry check, peer liveness and shutdown.

`AsyncEndpoint` is the base of the attention side (`afd.connectors.asynchronous.attention`) and of the FFN side
(`afd.connectors.asynchronous.ffn`); the window protocol itself is described in the attention module.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from afd.config import AsyncExtraConfig
from afd.connectors.asynchronous.dispatch import ExpertMap
from afd.connectors.asynchronous.liveness import is_alive, proc_info
from afd.connectors.asynchronous.window import Window
from afd.connectors.asynchronous.wire import SlotLayout, WindowGeometry
from afd.profiling.timeline import Timeline
from afd.topology import AsyncTopology, Role
from afd.transport.factory import default_heap_factory
from afd.transport.symm_heap import DEFAULT_TIMEOUT_S, HeapFactory, wait_keys

logger = logging.getLogger("afd.connectors.asynchronous.attention")


class ConnectorShutdown(Exception):
    """The opposite role announced shutdown: a normal exit, not an error."""


class RingExhausted(RuntimeError):
    """More messages in flight to one peer than ring_depth: a configuration error."""


class PeerDied(RuntimeError):
    """A peer process is gone without announcing shutdown."""


# ---------------------------------------------------------------------------------------------
# config


def as_async_config(extra_config: AsyncExtraConfig | Mapping[str, Any] | None) -> AsyncExtraConfig:
    if isinstance(extra_config, AsyncExtraConfig):
        return extra_config
    return AsyncExtraConfig.from_dict(dict(extra_config or {}))


# ---------------------------------------------------------------------------------------------
# common endpoint


class AsyncEndpoint:
    """Window, geometry check, peer bookkeeping and shutdown shared by both roles."""

    role: Role

    def __init__(
        self,
        store: dist.Store,
        topology: AsyncTopology,
        role_rank: int,
        *,
        hidden_size: int,
        topk: int,
        num_layers: int,
        dtype: torch.dtype,
        device: torch.device | str,
        max_num_batched_tokens: int,
        extra_config: AsyncExtraConfig | Mapping[str, Any] | None = None,
        heap_factory: HeapFactory | None = None,
        namespace: str = "afd_async",
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.config = as_async_config(extra_config)
        size = topology.num_attention if self.role == "attention" else topology.num_ffn
        if not 0 <= role_rank < size:
            raise ValueError(f"{self.role} rank {role_rank} outside 0..{size - 1}")
        if topk < 1 or topk > topology.num_experts:
            raise ValueError(f"topk={topk} must be between 1 and the {topology.num_experts} routed experts")
        self.topology = topology
        self.role_rank = role_rank
        self.world_rank = topology.world_rank(self.role, role_rank)
        self.hidden_size, self.topk, self.num_layers = hidden_size, topk, num_layers
        self.dtype = dtype
        self.device = torch.device(device)
        self.poll_timeout_s = self.config.recv_poll_timeout_ms / 1000
        self.timeout_s = timeout_s
        self.opposite: Role = "ffn" if self.role == "attention" else "attention"
        self.num_peers = topology.num_ffn if self.role == "attention" else topology.num_attention
        self.expert_map = ExpertMap.from_ranges(topology.expert_ranges, self.device)
        layout = SlotLayout.for_model(
            hidden_size=hidden_size,
            dtype=dtype,
            topk=topk,
            num_ffn=topology.num_ffn,
            max_num_batched_tokens=max_num_batched_tokens,
            routed_cap_multiplier=self.config.routed_cap_multiplier,
            shared_on_attention=self.config.shared_experts_on_attention,
        )
        geometry = WindowGeometry(layout, topology.num_regions, self.config.ring_depth)
        world = topology.world_size
        store.set(f"{namespace}/proc/{self.world_rank}", json.dumps(proc_info()))
        factory = heap_factory or default_heap_factory(store, self.world_rank, world, self.device, timeout_s)
        self.window = Window.create(
            store,
            self.world_rank,
            world,
            geometry,
            factory,
            namespace=namespace,
            timeout_s=timeout_s,
            identity={"num_experts": topology.num_experts, "num_layers": num_layers},
        )
        self._closed = False
        try:
            keys = [f"{namespace}/proc/{topology.world_rank(self.opposite, r)}" for r in range(self.num_peers)]
            wait_keys(store, keys, timeout_s, f"process info of the {self.opposite} ranks")
            self._peer_proc = [json.loads(store.get(k)) for k in keys]
        except BaseException:
            self._abandon()
            raise
        self.peers_closed: set[int] = set()  # opposite-role ranks that announced shutdown
        self.drop_dead_peers = False  # a dead peer: PeerDied (False) or counted as shut down (True)
        self._store, self._namespace = store, namespace
        self._peer_generation = [0] * self.num_peers  # restarts of each peer admitted so far
        self._rejoins_seen = 0
        if self.window.heap.generation:
            self._rejoin()
        self._last_liveness = time.monotonic()
        self.timeline = Timeline.from_env(f"async_{self.role}{role_rank}", self.device)  # AFD_TIMELINE=DIR

    def _abandon(self) -> None:
        """Release the window of an endpoint whose construction failed (no peer was told anything)."""
        self._closed = True
        self.window.close()

    # -- a restarted attention replica joins a running world (CPU shared memory; `afd.transport.shm`) ----
    def _rejoin(self) -> None:
        """Announce this restart and wait, bounded, until every opposite-role rank mapped its new window."""
        generation, ns = self.window.heap.generation, self._namespace
        self._store.set(f"{ns}/rejoin/{self.world_rank}", str(generation))
        self._store.add(f"{ns}/rejoins", 1)
        acks = [f"{ns}/rejoin_ack/{self.world_rank}/{generation}/{p}" for p in range(self.num_peers)]
        try:
            what = f"the {self.opposite} ranks to admit restart {generation} of {self.role} rank {self.role_rank}"
            wait_keys(self._store, acks, self.timeout_s, what)
        except BaseException:
            self._abandon()
            raise
        self.window.heap.release_name()
        logger.info("%s rank %d joined the running world (restart %d)", self.role, self.role_rank, generation)

    def admit_restarted_peers(self) -> None:
        """Take back every peer that restarted since the last look: its new process for liveness, its new window
        mapped, what its dead incarnation left in ours ignored; then tell it (one store read when none did)."""
        ns = self._namespace
        rejoins = int(self._store.add(f"{ns}/rejoins", 0))
        if rejoins == self._rejoins_seen:
            return
        self._rejoins_seen = rejoins
        for p in range(self.num_peers):
            world_rank = self.peer_world(p)
            key = f"{ns}/rejoin/{world_rank}"
            if not self._store.check([key]) or int(self._store.get(key)) <= self._peer_generation[p]:
                continue
            generation = int(self._store.get(key))
            self._peer_proc[p] = json.loads(self._store.get(f"{ns}/proc/{world_rank}"))
            self.window.reset_region(p)
            self.window.forget_peer(world_rank)
            self.window.heap.remap(world_rank, generation)
            self._peer_generation[p] = generation
            self.peers_closed.discard(p)
            self._store.set(f"{ns}/rejoin_ack/{world_rank}/{generation}/{self.role_rank}", "1")
            logger.warning("%s rank %d: %s rank %d is back (restart %d)", self.role, self.role_rank, self.opposite,
                           p, generation)  # fmt: skip

    def peer_world(self, peer: int) -> int:
        return self.topology.world_rank(self.opposite, peer)

    def check_peers_alive(self, peers: list[int] | None = None) -> None:
        """Raise PeerDied naming the first opposite-role rank whose process is gone; with `drop_dead_peers`, count
        it as shut down instead (a server's FFN rank outlives an attention replica that died alone), and raise
        ConnectorShutdown once no peer is left."""
        self._last_liveness = time.monotonic()
        if self.drop_dead_peers:
            self.admit_restarted_peers()
        for p in peers if peers is not None else range(self.num_peers):
            if p not in self.peers_closed and not is_alive(self._peer_proc[p]):
                if self.drop_dead_peers:
                    logger.warning(
                        "%s rank %d: %s rank %d died; serving the others", self.role, self.role_rank, self.opposite, p
                    )
                    self.peers_closed.add(p)
                    if len(self.peers_closed) == self.num_peers:
                        raise ConnectorShutdown(f"every {self.opposite} rank shut down or died")
                    continue
                raise PeerDied(
                    f"{self.opposite} rank {p} (world rank {self.peer_world(p)}, pid {self._peer_proc[p]['pid']}) "
                    f"died without announcing shutdown; {self.role} rank {self.role_rank} gives up"
                )

    @torch.inference_mode()
    def announce_shutdown(self) -> None:
        """Raise this rank's shutdown flag in every opposite-role peer still running; never raises.

        The flag is separate from the ring slots, so a message still in flight in any stage is left
        intact: the peer reads either that message or the shutdown, never a mix of both.
        """
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # earlier writes land before the shutdown flag
        for p in range(self.num_peers):
            if p in self.peers_closed:
                continue
            try:
                self.window.write_shutdown(self.peer_world(p), self.role_rank)
            except Exception:
                logger.warning(
                    "%s rank %d could not announce shutdown to %s rank %d",
                    self.role,
                    self.role_rank,
                    self.opposite,
                    p,
                    exc_info=True,
                )
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        """Announce shutdown, release the window. Never blocks on peers."""
        if self._closed:
            return
        self._closed = True
        self.announce_shutdown()
        self.window.close()
        if self.timeline is not None:
            self.timeline.dump()

    def __enter__(self) -> AsyncEndpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
