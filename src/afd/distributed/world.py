"""The AFD world: one store per run, a private namespace, prefixed subgroups, bounded waits, failures that name a rank.

Store. Every rank of a topology connects to ONE TCPStore at the configured `host:port`. Under `afd launch` the
launcher process hosts it (`host_store`; every rank is a client, `store_external`), so the store lives exactly as long
as the run. For ranks started by hand, world rank 0 (`STORE_HOST_RANK`; FFN rank 0 in the `p2p` order, attention rank
0 in the `async` order) hosts it, and on a normal close it stays for as long as any peer is still working (its
heartbeat advances), so a rank that finished early never brings down the ranks still working. Every subgroup (p2p sync
groups, the expert-parallel group, the wave group, control channels) is a gloo/NCCL process group built on
`PrefixStore(prefix, store)`: no other port is ever opened by hand, so multi-host works.

Security (the store listens on one address; a per-run secret keeps runs apart and signs every record a rank
trusts): `afd.distributed.store`.

Rendezvous (`afd.distributed.rendezvous`): every rank publishes who it is and waits, bounded, for the others.

Failures: a watchdog per rank (`afd.distributed.watchdog`) ends the process, saying why, when another rank failed, a
peer went silent, the store host stopped answering or the launcher is gone.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist

from afd import env
from afd.distributed.rendezvous import RankInfo, WorldOrder, rendezvous, role_of_world
from afd.distributed.store import (
    RendezvousError,
    RunKeys,
    check_run_tag,
    connect_store,
    departed,
    host_store,
    publish_failure,
    read_first_failure,
    wait_until,
)
from afd.distributed.watchdog import FAILING_LINGER_S, Watchdog, peer_silence_bound

logger = logging.getLogger(__name__)

STORE_HOST_RANK = 0
PEER_GONE = ("Connection closed by peer", "Connection reset by peer")  # gloo, when the other end died
Backend = Literal["gloo", "nccl"]


class PeerFailure(RuntimeError):
    """A communication op failed; the message names the rank(s) that caused it."""


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
    """Handle of this rank in the AFD world. Build it with `init_world`; end it with `close`.

    `store` is the run's private namespace of the world store (a PrefixStore); everything a rank
    or a connector keeps there is invisible to other runs on the same store.
    """

    me: RankInfo
    world_size: int
    backend: Backend
    timeout: timedelta
    store: dist.Store
    store_addr: tuple[str, int]
    peers: dict[int, RankInfo]
    keys: RunKeys
    local_host: str | None = None
    heartbeat_s: float = 0.25
    hosts_store: bool = False
    store_host: str = f"world rank {STORE_HOST_RANK}"
    watch_pid: int | None = None
    expendable: frozenset[int] = frozenset()  # world ranks that may die alone (the watchdog ignores their silence)
    groups: dict[str, Group] = field(default_factory=dict)
    _server: dist.Store | None = None  # the TCPStore server when this rank hosts it: keep it alive
    _watchdog: Watchdog | None = None
    _closed: bool = False

    @property
    def rank(self) -> int:
        return self.me.world_rank

    @property
    def peer_silence_s(self) -> float:
        return peer_silence_bound(self.timeout.total_seconds(), self.heartbeat_s)

    def name_of(self, world_rank: int) -> str:
        return self.peers[world_rank].name

    def describe_store_host(self) -> str:
        host, port = self.store_addr
        return f"{self.store_host}, the store host at {host}:{port},"

    # -- subgroups ---------------------------------------------------------------------------
    def new_group(self, name: str, world_ranks: Sequence[int], backend: Backend | None = None) -> Group | None:
        """Create subgroup `name` over `world_ranks` (group rank order = that order).

        Collective over its members only; returns None on a non-member without blocking. Members
        must create their common groups in the same order. NCCL groups get the world's timeout.
        """
        ranks = tuple(world_ranks)
        if len(set(ranks)) != len(ranks) or not all(0 <= r < self.world_size for r in ranks):
            raise ValueError(f"group {name!r}: bad world ranks {ranks}")
        if self.rank not in ranks:
            return None
        if name in self.groups:
            raise ValueError(f"group {name!r} already exists on {self.me.name}")
        backend = backend or self.backend
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"unknown backend {backend!r}; use 'gloo' or 'nccl'")
        store = dist.PrefixStore(f"group/{name}/", self.store)
        rank = ranks.index(self.rank)
        try:
            if backend == "gloo":
                opts = dist.ProcessGroupGloo._Options()
                opts._timeout = self.timeout
                opts._devices = [self._gloo_device()]
                pg = dist.ProcessGroupGloo(store, rank, len(ranks), opts)
            else:
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = self.timeout
                pg = dist.ProcessGroupNCCL(store, rank, len(ranks), opts)
        except RuntimeError as exc:  # a member or the store host died while the group was being wired
            raise self.fail(f"creating group {name!r} failed") from exc
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

    def blame(self, exc: BaseException) -> BaseException:
        """The error a rank ends with: one raised by torch.distributed (a store op, or an op posted to a pair
        whose peer closed) before any wait could name the culprit becomes `fail`'s diagnosis; others stay."""
        if isinstance(exc, dist.DistError) or any(s in str(exc) for s in PEER_GONE):
            return self.fail(f"{type(exc).__name__} from torch.distributed")
        return exc

    def diagnose(self) -> str:
        """One sentence on why the world broke: an earlier published failure, or ranks gone silent."""
        try:
            first = self._first_failure()
            if first:
                return f"caused by an earlier failure: {first}"
            silent = self._silent_ranks()
        except Exception:  # noqa: BLE001 - any store error means the store host is gone
            return f"{self.describe_store_host()} is unreachable; it probably died"
        if silent:
            names = ", ".join(self.name_of(r) for r in silent)
            return f"{names} stopped without a word (killed or crashed)"
        return "no rank is known to have died (a peer may be hung, or the timeout is too short)"

    def _first_failure(self) -> str | None:
        if int(self.store.add("failures", 0)) == 0:
            return None
        found: list[str] = []

        def read() -> bool:
            first = read_first_failure(self.store, self.keys, self.world_size)
            if first:
                found.append(first)
            return bool(first)

        try:
            wait_until(read, 2.0, "the first failure's description")
        except TimeoutError:
            return None  # a counter without a verified record: nothing to trust
        return found[0]

    def _silent_ranks(self) -> list[int]:
        """Ranks whose heartbeat stood still for a few beats without saying done or failed.

        A short window is enough here: an op has already failed, so someone is gone.
        """
        others = [r for r in range(self.world_size) if r != self.rank]
        before = {r: int(self.store.add(f"alive/{r}", 0)) for r in others}
        time.sleep(6 * self.heartbeat_s)
        return [
            r
            for r in others
            if int(self.store.add(f"alive/{r}", 0)) == before[r] and not departed(self.store, self.keys, r)
        ]

    def _publish_failure(self, msg: str) -> None:
        if self._watchdog:
            self._watchdog.self_failed = True
        try:
            publish_failure(self.store, self.keys, self.rank, msg)
        except Exception:  # noqa: BLE001 - store host gone; the message still goes to our caller
            logger.debug("%s: could not publish failure", self.me.name)

    # -- shutdown -------------------------------------------------------------------------------
    @contextmanager
    def session(self) -> Iterator[World]:
        """Leave the world when the block ends: cleanly, or with its error (as `blame` puts it) published."""
        try:
            yield self
        except BaseException as exc:
            error = self.blame(exc)
            logger.error("%s failed: %s", self.me.name, error)
            self.close(error=error)
            if error is exc:
                raise
            raise error from exc
        self.close()

    def close(self, error: BaseException | None = None) -> None:
        """Leave the world. With `error`, publish it first so the other ranks stop and name us.

        A rank that hosts the store then stays while its peers still need it: after a normal end,
        until every other rank is done, failed, or silent for `peer_silence_s` (no fixed cap: a
        replica that finished early must not bring down one still generating); after a failure, a
        few seconds at most, so the others can read why.
        """
        if self._closed:
            return
        self._closed = True
        if self._watchdog:
            self._watchdog.finished = True  # from here on, others' failures are no reason to exit
        if error is not None and not isinstance(error, PeerFailure):
            self._publish_failure(f"{self.me.name} failed: {type(error).__name__}: {error}")
        try:
            if error is None:
                key = f"done/{self.rank}"
                self.store.set(key, self.keys.sign(key, "1"))
            if self.hosts_store:
                if error is None:
                    self.await_departures(self.store, self.peer_silence_s, None)
                else:
                    self.await_departures(self.store, 6 * self.heartbeat_s, FAILING_LINGER_S)
        except Exception:  # noqa: BLE001
            logger.debug("%s: store unavailable during close", self.me.name)
        if self._watchdog:
            self._watchdog.stop()
        for group in self.groups.values():
            if group.backend == "nccl":
                group.pg.shutdown()
        self.groups.clear()

    def await_departures(self, store: dist.Store, silence_s: float, cap_s: float | None) -> None:
        """Keep hosting the store until every other rank is done, failed, or silent for `silence_s`."""
        pending = set(range(self.world_size)) - {self.rank}
        start = time.monotonic()
        last = {r: -1 for r in pending}
        last_change = {r: start for r in pending}
        next_note = start + 30.0
        while pending:
            now = time.monotonic()
            if cap_s is not None and now - start > cap_s:
                break
            for r in sorted(pending):
                beat = int(store.add(f"alive/{r}", 0))
                if beat != last[r]:
                    last[r], last_change[r] = beat, now
                    if not departed(store, self.keys, r):
                        continue
                elif now - last_change[r] <= silence_s and not departed(store, self.keys, r):
                    continue
                pending.discard(r)
            if pending and now >= next_note:
                logger.info(
                    "%s: still hosting the world store for %s",
                    self.me.name,
                    ", ".join(self.name_of(r) for r in sorted(pending)),
                )
                next_note = now + 30.0
            time.sleep(self.heartbeat_s / 2)
        if pending:
            logger.warning(
                "%s: closing the store while %s may still use it",
                self.me.name,
                ", ".join(self.name_of(r) for r in sorted(pending)),
            )


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
    store_external: bool = False,
    secret: str | None = None,
    watch_pid: int | None = None,
    expendable: frozenset[int] = frozenset(),
    dtype: str | None = None,
    rejoin: bool = False,
) -> World:
    """Join the AFD world through the store at `host:port`.

    The store is hosted by world rank 0, or, with `store_external`, by someone else (the launcher).
    `secret` (default: `afd.env.secret()`) must be the same on every rank. `watch_pid`: a process
    whose death ends this rank (the launcher). Ranks may start in any order; every wait is bounded
    by `timeout` seconds. `expendable`: world ranks whose death alone ends no other rank (`rejoin`: this
    process restarts one of them). `local_host` is the address this rank's gloo connections bind to
    (default: 127.0.0.1 when the store is on loopback, else the host's default interface). `dtype`: an
    attention rank's compute dtype (`RankInfo`).
    """
    if num_attention + num_ffn != world_size:
        raise RendezvousError(
            f"world size {world_size} != num_attention {num_attention} + num_ffn {num_ffn}; "
            "pass the same sizes to every rank"
        )
    if not 0 <= world_rank < world_size:
        raise RendezvousError(f"world rank {world_rank} is outside a world of {world_size} ranks")
    role, role_rank = role_of_world(world_rank, num_attention, num_ffn, world_order)
    me = RankInfo(
        world_rank, role, role_rank, num_attention, num_ffn, world_order, socket.gethostname(), os.getpid(), dtype
    )
    td = timedelta(seconds=timeout)
    secret = env.secret() if secret is None else secret
    keys = RunKeys.from_secret(secret)
    if store_external:
        host_name = "the afd launch process" + (f" (pid {watch_pid})" if watch_pid else "")
    else:
        host_name = "world rank {} ({} {})".format(
            STORE_HOST_RANK, *role_of_world(STORE_HOST_RANK, num_attention, num_ffn, world_order)
        )
    is_host = world_rank == STORE_HOST_RANK and not store_external
    server = None
    try:
        if is_host:
            server = root = host_store(host, port, timeout, secret)  # the server is a client too
        else:
            root = connect_store(host, port, timeout)
    except RendezvousError as exc:
        raise type(exc)(f"{me.name} could not host the AFD world store: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - torch raises several types here
        raise RendezvousError(
            f"{me.name} could not reach the AFD world store at {host}:{port} within {timeout:.1f}s; "
            f"it is hosted by {host_name}: is it started, and are host and port right?"
        ) from exc
    if local_host is None and (host.startswith("127.") or host == "localhost"):
        local_host = "127.0.0.1"
    store = dist.PrefixStore(keys.namespace, root)
    try:
        check_run_tag(root, keys, host, port, timeout, me.name)
        peers = rendezvous(store, keys, me, world_size, timeout, is_host, rejoin)
    except RendezvousError:
        raise
    except Exception as exc:  # noqa: BLE001 - a store op failed: its host went away
        raise RendezvousError(
            f"{me.name}: the AFD world store at {host}:{port}, hosted by {host_name}, went away during the "
            f"rendezvous ({exc})"
        ) from exc
    world = World(
        me=me,
        world_size=world_size,
        backend=backend,
        timeout=td,
        store=store,
        store_addr=(host, port),
        peers=peers,
        keys=keys,
        local_host=local_host,
        heartbeat_s=heartbeat_s,
        hosts_store=is_host,
        store_host=host_name,
        watch_pid=watch_pid,
        expendable=expendable,
        _server=server,
    )
    # the watchdog's own client: the main thread's store may be busy in a long blocking wait
    try:
        watchdog_client = dist.TCPStore(
            host, port, None, False, timedelta(seconds=world.peer_silence_s), wait_for_workers=False
        )
    except Exception as exc:  # noqa: BLE001 - torch raises several types here
        raise RendezvousError(f"{me.name}: {world.describe_store_host()} went away after the rendezvous") from exc
    world._watchdog = Watchdog(world, watchdog_client)
    logger.info("%s joined a world of %d ranks at %s:%d (%s)", me.name, world_size, host, port, backend)
    return world


def device_for(backend: Backend) -> torch.device:
    """The tensor device a backend's data ops use here (NCCL: this process's current GPU)."""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
