"""The AFD world: one TCPStore, prefixed subgroups, bounded waits, and failures that name a rank.

Every rank of a topology connects to ONE store at the configured `host:port`, hosted by
world rank 0 (`STORE_HOST_RANK`; with the `p2p` world order that is FFN rank 0). Every
subgroup (p2p sync groups, the FFN role's expert-parallel group, the attention role's wave
group, control channels) is a gloo/NCCL process group built on `PrefixStore(prefix, store)`:
no port other than the store's is ever opened by hand, so ranks on different hosts work
(DESIGN.md §1.1, §4).

Rendezvous: each rank claims `claim/{rank}`, publishes `arrived/{rank}` (its role, role rank,
A, F, world order, host, pid) and waits, bounded, for every other rank; a rank that never
arrives is named, and so is one started with different A/F.

Failures: a watchdog thread per rank bumps `alive/{rank}` every `heartbeat_s`. When a
communication op fails, the rank looks for ranks whose heartbeat stopped without a
`done/{rank}` and publishes one `first_failure` line naming them; the watchdogs of all other
ranks see it and end their process (fail-fast, like NCCL's watchdog), because a gloo op
blocked on a live-but-failed peer cannot be interrupted otherwise. Gloo timeouts bound the rest.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist

from afd.topology import Role

logger = logging.getLogger(__name__)

STORE_HOST_RANK = 0
WorldOrder = Literal["ffn_first", "attention_first"]
Backend = Literal["gloo", "nccl"]


class RendezvousError(RuntimeError):
    """The world could not be formed (missing rank, mismatched sizes, unreachable store)."""


class PeerFailure(RuntimeError):
    """A communication op failed; the message names the rank(s) that caused it."""


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

    @property
    def name(self) -> str:
        return f"world rank {self.world_rank} ({self.role} {self.role_rank})"

    def sizes(self) -> tuple[int, int, str]:
        return self.num_attention, self.num_ffn, self.world_order


def role_of_world(world_rank: int, num_attention: int, num_ffn: int, world_order: WorldOrder) -> tuple[Role, int]:
    """(role, role rank) of a world rank under a world order."""
    first: Role = "ffn" if world_order == "ffn_first" else "attention"
    second: Role = "attention" if first == "ffn" else "ffn"
    num_first = num_ffn if first == "ffn" else num_attention
    return (first, world_rank) if world_rank < num_first else (second, world_rank - num_first)


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.02) -> None:
    """Poll `predicate` until true; after `timeout_s` raise TimeoutError saying what was awaited."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"gave up after {timeout_s:.1f}s waiting for {what}")
        time.sleep(poll_s)


@dataclass
class Group:
    """One subgroup: a process group plus the world ranks it maps to (group rank i = world_ranks[i])."""

    name: str
    pg: dist.ProcessGroup
    world_ranks: tuple[int, ...]
    rank: int
    backend: Backend

    @property
    def size(self) -> int:
        return len(self.world_ranks)

    def group_rank(self, world_rank: int) -> int:
        return self.world_ranks.index(world_rank)


@dataclass
class World:
    """Handle of this rank in the AFD world. Build it with `init_world`; end it with `close`."""

    me: RankInfo
    world_size: int
    backend: Backend
    timeout: timedelta
    store: dist.Store
    store_addr: tuple[str, int]
    peers: dict[int, RankInfo]
    local_host: str | None = None
    heartbeat_s: float = 0.25
    groups: dict[str, Group] = field(default_factory=dict)
    _watchdog: _Watchdog | None = None
    _closed: bool = False

    @property
    def rank(self) -> int:
        return self.me.world_rank

    def name_of(self, world_rank: int) -> str:
        return self.peers[world_rank].name

    # -- subgroups ---------------------------------------------------------------------------
    def new_group(self, name: str, world_ranks: Sequence[int], backend: Backend | None = None) -> Group | None:
        """Create subgroup `name` over `world_ranks` (group rank order = that order).

        Collective over its members only; returns None on a non-member without blocking. Members
        must create their common groups in the same order.
        """
        ranks = tuple(world_ranks)
        if len(set(ranks)) != len(ranks) or not all(0 <= r < self.world_size for r in ranks):
            raise ValueError(f"group {name!r}: bad world ranks {ranks}")
        if self.rank not in ranks:
            return None
        if name in self.groups:
            raise ValueError(f"group {name!r} already exists on {self.me.name}")
        backend = backend or self.backend
        store = dist.PrefixStore(f"group/{name}/", self.store)
        rank = ranks.index(self.rank)
        if backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = self.timeout
            opts._devices = [self._gloo_device()]
            pg = dist.ProcessGroupGloo(store, rank, len(ranks), opts)
        elif backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            pg = dist.ProcessGroupNCCL(store, rank, len(ranks), opts)
        else:
            raise ValueError(f"unknown backend {backend!r}; use 'gloo' or 'nccl'")
        group = Group(name=name, pg=pg, world_ranks=ranks, rank=rank, backend=backend)
        self.groups[name] = group
        logger.debug("%s: group %s over world ranks %s (%s)", self.me.name, name, ranks, backend)
        return group

    def _gloo_device(self):
        if self.local_host:
            return dist.ProcessGroupGloo.create_device(hostname=self.local_host)
        return dist.ProcessGroupGloo.create_default_device()

    # -- bounded waits that name the culprit --------------------------------------------------
    def wait(self, work: dist.Work, what: str) -> None:
        """Wait for one op; on failure raise PeerFailure naming the rank(s) that caused it."""
        try:
            work.wait()
        except RuntimeError as exc:
            raise self.fail(f"{what} failed") from exc

    def wait_all(self, works: Sequence[tuple[dist.Work, str]]) -> None:
        for work, what in works:
            self.wait(work, what)

    def fail(self, what: str) -> PeerFailure:
        """Find who is to blame, publish it once for the whole world, and return the error to raise."""
        cause = self.diagnose()
        msg = f"{self.me.name}: {what}: {cause}"
        self._publish_failure(msg)
        logger.error("%s", msg)
        return PeerFailure(msg)

    def diagnose(self) -> str:
        """One sentence on why the world broke: an earlier published failure, or ranks gone silent."""
        try:
            first = self._first_failure()
            if first:
                return f"caused by an earlier failure: {first}"
            silent = self._silent_ranks()
        except Exception:  # noqa: BLE001 - any store error means the store host is gone
            return f"{self.name_of(STORE_HOST_RANK)} (the store host) is unreachable; it probably died"
        if silent:
            names = ", ".join(self.name_of(r) for r in silent)
            return f"{names} stopped without a word (killed or crashed)"
        return "no rank is known to have died (a peer may be hung, or the timeout is too short)"

    def _first_failure(self) -> str | None:
        if int(self.store.add("failures", 0)) == 0:
            return None
        key = "first_failure"
        wait_until(lambda: self.store.check([key]), 2.0, "the first failure's description")
        return self.store.get(key).decode()

    def _silent_ranks(self) -> list[int]:
        others = [r for r in range(self.world_size) if r != self.rank]
        before = {r: int(self.store.add(f"alive/{r}", 0)) for r in others}
        time.sleep(6 * self.heartbeat_s)
        return [
            r
            for r in others
            if int(self.store.add(f"alive/{r}", 0)) == before[r]
            and not self.store.check([f"done/{r}"])
            and not self.store.check([f"failed/{r}"])
        ]

    def _publish_failure(self, msg: str) -> None:
        if self._watchdog:
            self._watchdog.self_failed = True
        try:
            self.store.set(f"failed/{self.rank}", msg)
            if int(self.store.add("failures", 1)) == 1:
                self.store.set("first_failure", msg)
        except Exception:  # noqa: BLE001 - store host gone; the message still goes to our caller
            logger.debug("%s: could not publish failure", self.me.name)

    # -- shutdown -------------------------------------------------------------------------------
    def close(self, error: BaseException | None = None) -> None:
        """Leave the world. With `error`, publish it first so the other ranks stop and name us.

        The store host then waits (bounded by the timeout) until every other rank is done,
        failed or silent, so their last store ops still find the store.
        """
        if self._closed:
            return
        self._closed = True
        if error is not None and not isinstance(error, PeerFailure):
            self._publish_failure(f"{self.me.name} failed: {type(error).__name__}: {error}")
        try:
            if error is None:
                self.store.set(f"done/{self.rank}", "1")
            if self.rank == STORE_HOST_RANK:
                self._wait_for_departures()
        except Exception:  # noqa: BLE001
            logger.debug("%s: store unavailable during close", self.me.name)
        if self._watchdog:
            self._watchdog.stop()
        for group in self.groups.values():
            if group.backend == "nccl":
                group.pg.shutdown()
        self.groups.clear()

    def _wait_for_departures(self) -> None:
        pending = set(range(self.world_size)) - {self.rank}
        deadline = time.monotonic() + self.timeout.total_seconds()
        last = {r: -1 for r in pending}
        last_change = {r: time.monotonic() for r in pending}
        while pending and time.monotonic() < deadline:
            for r in list(pending):
                if self.store.check([f"done/{r}"]) or self.store.check([f"failed/{r}"]):
                    pending.discard(r)
                    continue
                beat = int(self.store.add(f"alive/{r}", 0))
                if beat != last[r]:
                    last[r], last_change[r] = beat, time.monotonic()
                elif time.monotonic() - last_change[r] > 6 * self.heartbeat_s:
                    pending.discard(r)  # silent: gone
            time.sleep(self.heartbeat_s / 2)
        if pending:
            logger.warning("%s: closing the store while %s may still use it", self.me.name,
                           ", ".join(self.name_of(r) for r in sorted(pending)))


class _Watchdog:
    """Heartbeat + fail-fast: bumps `alive/{rank}`; ends the process when another rank failed."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.self_failed = False
        self._stop = threading.Event()
        host, port = world.store_addr
        # Own client: the main thread's store may be busy in a long blocking wait.
        self._store = dist.TCPStore(host, port, None, False, world.timeout, wait_for_workers=False)
        self._thread = threading.Thread(target=self._run, name=f"afd-watchdog-{world.rank}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        me = self.world.me
        misses = 0
        while not self._stop.wait(self.world.heartbeat_s):
            try:
                self._store.add(f"alive/{me.world_rank}", 1)
                failures = int(self._store.add("failures", 0))
                misses = 0
            except Exception:  # noqa: BLE001
                misses += 1
                if misses < 3 or self._stop.is_set():
                    continue
                self._exit(f"{self.world.name_of(STORE_HOST_RANK)} (the store host) is unreachable; "
                           "it probably died")
                return
            if failures and not self.self_failed and not self._stop.is_set():
                try:
                    first = self._store.get("first_failure").decode()
                except Exception:  # noqa: BLE001
                    first = "another rank failed"
                self._exit(f"another rank failed: {first}")
                return

    def _exit(self, why: str) -> None:
        msg = f"{self.world.me.name}: stopping because {why}\n"
        logger.critical("%s", msg.strip())
        try:
            self._store.set(f"failed/{self.world.rank}", msg.strip())
        except Exception:  # noqa: BLE001
            pass
        os.write(2, msg.encode())
        os._exit(1)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5 * self.world.heartbeat_s + 1)


def init_world(
    host: str,
    port: int,
    world_rank: int,
    world_size: int,
    backend: Backend = "gloo",
    timeout: float = 60.0,
    *,
    num_attention: int,
    num_ffn: int,
    world_order: WorldOrder = "ffn_first",
    local_host: str | None = None,
    heartbeat_s: float = 0.25,
) -> World:
    """Join the AFD world through the store at `host:port` (hosted by world rank 0).

    Ranks may start in any order; every wait is bounded by `timeout` seconds. `local_host` is the
    address this rank's gloo connections bind to (default: 127.0.0.1 when the store is on
    loopback, else the host's default interface).
    """
    if num_attention + num_ffn != world_size:
        raise RendezvousError(
            f"world size {world_size} != num_attention {num_attention} + num_ffn {num_ffn}; "
            "pass the same sizes to every rank"
        )
    if not 0 <= world_rank < world_size:
        raise RendezvousError(f"world rank {world_rank} is outside a world of {world_size} ranks")
    role, role_rank = role_of_world(world_rank, num_attention, num_ffn, world_order)
    me = RankInfo(world_rank, role, role_rank, num_attention, num_ffn, world_order, socket.gethostname(),
                  os.getpid())
    td = timedelta(seconds=timeout)
    host_info = role_of_world(STORE_HOST_RANK, num_attention, num_ffn, world_order)
    host_name = f"world rank {STORE_HOST_RANK} ({host_info[0]} {host_info[1]})"
    is_host = world_rank == STORE_HOST_RANK
    try:
        store = dist.TCPStore(host, port, None, is_host, td, wait_for_workers=False)
    except Exception as exc:  # noqa: BLE001 - torch raises several types here
        if is_host:
            raise RendezvousError(f"{me.name} could not host the AFD world store on port {port}: {exc}") from exc
        raise RendezvousError(
            f"{me.name} could not reach the AFD world store at {host}:{port} within {timeout:.1f}s; "
            f"it is hosted by {host_name}: is that rank started, and are host and port right?"
        ) from exc
    if local_host is None and (host.startswith("127.") or host == "localhost"):
        local_host = "127.0.0.1"
    peers = _rendezvous(store, me, world_size, timeout)
    world = World(me=me, world_size=world_size, backend=backend, timeout=td, store=store,
                  store_addr=(host, port), peers=peers, local_host=local_host, heartbeat_s=heartbeat_s)
    world._watchdog = _Watchdog(world)
    logger.info("%s joined a world of %d ranks at %s:%d (%s)", me.name, world_size, host, port, backend)
    return world


def _rendezvous(store: dist.Store, me: RankInfo, world_size: int, timeout: float) -> dict[int, RankInfo]:
    """Publish `arrived/{rank}` and collect every other rank's, checking they agree on the sizes."""
    if int(store.add(f"claim/{me.world_rank}", 1)) > 1:
        raise RendezvousError(f"two processes were started as {me.name}; each world rank must be started once")
    store.set(f"arrived/{me.world_rank}", json.dumps(asdict(me)))
    peers = {me.world_rank: me}
    # The store host gives up last, so the others can still read the store when they give up.
    deadline = time.monotonic() + timeout + (1.0 if me.world_rank == STORE_HOST_RANK else 0.0)
    while True:
        try:
            _collect_arrivals(store, me, world_size, peers)
        except RendezvousError:
            raise
        except Exception as exc:  # noqa: BLE001 - the store went away
            raise RendezvousError(
                f"{me.name}: {_missing(me, world_size, peers)} did not arrive before the AFD world store "
                f"(hosted by world rank {STORE_HOST_RANK}) went away: {exc}"
            ) from exc
        if len(peers) == world_size:
            return peers
        if time.monotonic() >= deadline:
            raise RendezvousError(
                f"{me.name}: {_missing(me, world_size, peers)} did not arrive within {timeout:.1f}s at the AFD "
                "world store; start them, or check their host, port and sizes"
            )
        time.sleep(0.02)


def _collect_arrivals(store: dist.Store, me: RankInfo, world_size: int, peers: dict[int, RankInfo]) -> None:
    for r in range(world_size):
        if r in peers or not store.check([f"arrived/{r}"]):
            continue
        info = RankInfo(**json.loads(store.get(f"arrived/{r}")))
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


def device_for(backend: Backend) -> torch.device:
    """The tensor device a backend's data ops use here (NCCL: this process's current GPU)."""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
