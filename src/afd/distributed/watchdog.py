"""The watchdog of a rank of the AFD world (`afd.distributed.world`): it ends the process, saying why, rather than
let a rank hang.

Failures. A watchdog per rank (its own store client) bumps `alive/{rank}` every `heartbeat_s` and:
- ends the process when another rank published a failure (fail-fast, like NCCL's watchdog: a gloo
  op blocked on a live-but-failed peer cannot be interrupted otherwise);
- watches every peer's heartbeat, independently of any op (NCCL waits on the stream, `nvshmem.init`
  is collective with no timeout): a peer silent for `peer_silence_s` without `done` is published
  once as "world rank N (role r) stopped without a word (killed or crashed)";
- ends the process when the store host stops answering: a TCPStore op against a frozen (SIGSTOPped)
  server never returns, whatever its timeout (measured on torch 2.13), so a second thread times the
  last successful round instead of trusting the op timeout;
- ends the process when `watch_pid` (the launcher) is gone.
Ranks in the world's `expendable` set (a server's async attention replicas) may die alone: their silence is noted
once in the log and ends no one (the server restarts them, and the FFN ranks drop them).
`peer_silence_s` = min(timeout, max(8 s, 32 heartbeats)): on CI's 2 overloaded cores a heartbeat
thread was seen starved for 1-2 s, so 8 s leaves a wide margin for busy-but-alive ranks, and it is
never longer than the bound on every other wait. Gloo/NCCL timeouts (the same bound) cover the rest.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Protocol

import torch.distributed as dist

from afd.distributed.store import RunKeys, departed, publish_failure, read_first_failure

logger = logging.getLogger(__name__)

MIN_PEER_SILENCE_S = 8.0
FAILING_LINGER_S = 3.0  # a failing store host stays this long at most so the others can read why


def peer_silence_bound(timeout_s: float, heartbeat_s: float) -> float:
    """How long a peer's heartbeat may stand still before it is declared dead (module docstring)."""
    return min(timeout_s, max(MIN_PEER_SILENCE_S, 32 * heartbeat_s))


def process_alive(pid: int) -> bool:
    """Whether `pid` still runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


class Named(Protocol):
    name: str


class WatchedWorld(Protocol):
    """What a watchdog reads of its rank's world (`afd.distributed.world.World`)."""

    keys: RunKeys
    world_size: int
    heartbeat_s: float
    hosts_store: bool
    watch_pid: int | None
    expendable: frozenset[int]

    @property
    def me(self) -> Named: ...
    @property
    def rank(self) -> int: ...
    @property
    def peer_silence_s(self) -> float: ...
    def name_of(self, world_rank: int) -> str: ...
    def describe_store_host(self) -> str: ...
    def await_departures(self, store: dist.Store, silence_s: float, cap_s: float | None) -> None: ...


class Watchdog:
    """Heartbeat, fail-fast, peer-death, store-host and launcher watch (see the module docstring)."""

    def __init__(self, world: WatchedWorld, client: dist.Store) -> None:
        self.world = world
        self.self_failed = False
        self.finished = False
        self._store = dist.PrefixStore(world.keys.namespace, client)
        self._client = client  # the PrefixStore keeps it alive too; explicit for clarity
        self._stop = threading.Event()
        self._exiting = threading.Lock()
        self._last_ok = time.monotonic()
        now = time.monotonic()
        self._beats = {r: (-1, now) for r in range(world.world_size) if r != world.rank}
        self._parent_is_watched = world.watch_pid is not None and os.getppid() == world.watch_pid
        self._threads = [
            threading.Thread(target=self._beat, name=f"afd-watchdog-{world.rank}", daemon=True),
            threading.Thread(target=self._supervise, name=f"afd-supervisor-{world.rank}", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    # the beat thread: every store op of the watchdog happens here
    def _beat(self) -> None:
        errors = 0
        while not self._stop.wait(self.world.heartbeat_s):
            try:
                self._round()
            except Exception as exc:  # noqa: BLE001 - the store refused: its host is gone
                errors += 1
                logger.debug("%s: watchdog store op failed: %s", self.world.me.name, exc)
                if errors >= 3 and not self._stop.is_set():
                    self._exit(f"{self.world.describe_store_host()} is unreachable; it probably died", publish=False)
                    return
                continue
            errors = 0
            self._last_ok = time.monotonic()

    def _round(self) -> None:
        world = self.world
        self._store.add(f"alive/{world.rank}", 1)
        if self.finished or self._stop.is_set():
            return
        if world.watch_pid is not None and not self._launcher_alive():
            self._exit(f"its launcher (pid {world.watch_pid}) is gone", publish=False)
        if int(self._store.add("failures", 0)) and not self.self_failed:
            first = read_first_failure(self._store, world.keys, world.world_size)
            if first and not self.self_failed and not self.finished:  # no verified record (yet): not trusted
                self._exit(f"another rank failed: {first}")
        now = time.monotonic()
        for r, (seen, since) in list(self._beats.items()):
            beat = int(self._store.add(f"alive/{r}", 0))
            if beat != seen:
                self._beats[r] = (beat, now)
            elif now - since > world.peer_silence_s:
                if departed(self._store, world.keys, r):
                    del self._beats[r]  # done or failed: its silence is no news
                elif r in world.expendable:
                    del self._beats[r]
                    logger.warning("%s stopped without a word; it may die alone", world.name_of(r))
                elif not (self.finished or self.self_failed):
                    msg = f"{world.name_of(r)} stopped without a word (killed or crashed)"
                    self._exit(msg, published=f"{world.me.name}: {msg}")

    def _launcher_alive(self) -> bool:
        pid = self.world.watch_pid
        assert pid is not None
        if self._parent_is_watched:
            return os.getppid() == pid  # reparented: the launcher died, even if not yet reaped
        return process_alive(pid)

    # the supervisor thread: no store ops, so a frozen store cannot hold it
    def _supervise(self) -> None:
        """Count only time this thread was awake to see: a process starved as a whole (both threads
        frozen by the scheduler) must not blame the store host when it wakes up."""
        world = self.world
        unanswered, seen_ok, tick = 0.0, self._last_ok, time.monotonic()
        while not self._stop.wait(world.heartbeat_s):
            now = time.monotonic()
            gap, tick = now - tick, now
            if self._last_ok != seen_ok or (self.finished and world.hosts_store):
                unanswered, seen_ok = 0.0, self._last_ok
                continue
            unanswered += min(gap, 2 * world.heartbeat_s)
            if unanswered > world.peer_silence_s:
                self._exit(
                    f"{world.describe_store_host()} has not answered for {unanswered:.0f}s "
                    "(frozen, overloaded or dead)",
                    publish=False,
                )
                return

    def _exit(self, why: str, *, publish: bool = True, published: str | None = None) -> None:
        """Say why, record it (when the store answers), let the others read it if we host the store, leave."""
        if not self._exiting.acquire(blocking=False):
            return
        world = self.world
        msg = f"{world.me.name}: stopping because {why}"
        logger.critical("%s", msg)
        os.write(2, (msg + "\n").encode())
        if publish:
            try:
                publish_failure(self._store, world.keys, world.rank, published or msg)
                if world.hosts_store:
                    world.await_departures(self._store, 6 * world.heartbeat_s, FAILING_LINGER_S)
            except Exception:  # noqa: BLE001 - nothing more to tell anyone
                pass
        logging.shutdown()
        os._exit(1)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=5 * self.world.heartbeat_s + 1)
