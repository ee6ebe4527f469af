"""Failure isolation and healing: a dead rank costs only the requests of the replicas it served, and what died is
restarted from the zygote while the rest of the server keeps serving.

`Healer` runs on the server's event loop. Every `POLL_S` it asks the rank supervisor (`afd.runtime.servers`)
whether a unit (what is restarted together) lost a rank, and heals it in a task of its own:
1. the replicas the death costs stop taking requests, and their in-flight requests end with the death as the error;
2. dead replicas that can be restarted alone (an `async` attention replica on CPU) are, after a backoff, while the
   others serve on; otherwise a unit whose other replicas still serve (`async` on NVSHMEM: its world is fixed at
   init) drains them: they take no new request and finish what they run (at most `DRAIN_S`);
3. after a backoff (`HealPolicy.delay`), the unit is stopped and started again; its replicas serve as soon as each
   says hello again (`ReplicaPool.attach`);
4. a unit that died `max_restarts` times within `window_s` is given up on, in one log line, and the server serves
   with what remains.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from afd.runtime.launch import LaunchError
from afd.runtime.servers import Loss
from afd.serve import DRAIN_S
from afd.serve.frontend import ReplicaPool

logger = logging.getLogger(__name__)

POLL_S = 0.25  # how often the ranks are looked at
WAIT_S = 0.05  # the pace of a healing task's waits


@dataclass(frozen=True)
class HealPolicy:
    """When to restart: after `backoff_s`, doubled for every earlier death of the unit within `window_s` (at most
    `max_backoff_s`); never again once it died `max_restarts` times within `window_s` (0: never restart)."""

    max_restarts: int = 5
    window_s: float = 60.0
    backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    hello_timeout_s: float = 600.0  # a restarted unit's replicas have this long to load and say hello

    def delay(self, deaths_in_window: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2 ** max(0, deaths_in_window - 1))


class UnitLike(Protocol):
    index: int
    replicas: tuple[int, ...]


class Supervised(Protocol):
    """What the healer needs of the rank supervisor (`afd.runtime.servers.ServerRanks`)."""

    units: Sequence[UnitLike]

    def lost(self, unit) -> Loss | None: ...
    def restart(self, unit) -> None: ...
    def restart_alone(self, unit, replicas: tuple[int, ...]) -> None: ...
    def stop_unit(self, unit) -> None: ...


@dataclass
class UnitState:
    status: str = "serving"  # serving | healing | given_up
    deaths: deque = field(default_factory=deque)  # monotonic times of its deaths within the window


class Healer:
    """Watches the ranks, isolates what a death costs and restarts it (module docstring). `restarts[r]`: how many
    times replica r was restarted."""

    def __init__(self, ranks: Supervised, pool: ReplicaPool, policy: HealPolicy | None = None,
                 accept_later: Callable[[Callable], None] | None = None) -> None:  # fmt: skip
        self.ranks, self.pool, self.policy = ranks, pool, policy or HealPolicy()
        self.units = {unit.index: UnitState() for unit in ranks.units}
        self.restarts = [0] * pool.num_replicas
        self._accept_later = accept_later  # `FrontLink.accept_later`: restarted replicas' hellos
        self._tasks: set[asyncio.Task] = set()
        pool.cause_of_loss = self.cause_of_loss

    def cause_of_loss(self, replica: int) -> str | None:
        unit = next(u for u in self.ranks.units if replica in u.replicas)
        loss = self.ranks.lost(unit)
        return loss.why if loss is not None else None

    def down_because(self) -> str | None:
        """Why no replica serves now (a death, a restart), or None."""
        for unit in self.ranks.units:
            loss = self.ranks.lost(unit)
            if loss is not None:
                return f"{loss.why}; the server cannot generate until it is restarted"
        if any(state.status == "healing" for state in self.units.values()):
            return "every replica is being restarted"
        return None

    async def run(self) -> None:
        """Until cancelled (the server stops): look at the ranks, heal what lost one."""
        loop = asyncio.get_running_loop()
        if self._accept_later is not None:
            self._accept_later(lambda r, conn, hello: loop.call_soon_threadsafe(self._attach, r, conn, hello))
        try:
            while True:
                for unit in self.ranks.units:
                    state = self.units[unit.index]
                    if state.status != "serving":
                        continue
                    loss = self.ranks.lost(unit)
                    if loss is not None:
                        state.status = "healing"
                        task = loop.create_task(self._heal(unit, state, loss))
                        self._tasks.add(task)
                        task.add_done_callback(self._tasks.discard)
                await asyncio.sleep(POLL_S)
        finally:
            for task in list(self._tasks):
                task.cancel()

    def _attach(self, replica: int, conn, hello: dict) -> None:
        if self.pool.stopping or not self.pool.attach(replica, conn, hello):
            conn.close()

    async def _heal(self, unit: UnitLike, state: UnitState, loss: Loss) -> None:
        policy, pool = self.policy, self.pool
        while True:
            now = time.monotonic()
            state.deaths.append(now)
            while state.deaths and now - state.deaths[0] > policy.window_s:
                state.deaths.popleft()
            logger.error("%s; the requests of replica %s end with an error", loss.why, _names(loss.replicas))
            for r in loss.replicas:
                pool.lose(r, loss.why)
            survivors = [r for r in unit.replicas if r not in loss.replicas]
            if len(state.deaths) >= max(1, policy.max_restarts) or policy.max_restarts == 0:
                state.status = "given_up"
                logger.error(
                    "giving up on replica %s: it died %d times within %g s; serving with the %d replicas that remain",
                    _names(unit.replicas), len(state.deaths), policy.window_s, sum(pool.serving()),
                )  # fmt: skip
                if not survivors:
                    await asyncio.to_thread(self.ranks.stop_unit, unit)
                return
            started = time.monotonic()
            restarted = loss.replicas if loss.alone else unit.replicas
            if loss.alone:
                await asyncio.sleep(policy.delay(len(state.deaths)))
            else:
                await self._drain(survivors, started + policy.delay(len(state.deaths)))
            for r in restarted:
                pool.accepting[r] = False  # each serves again when it says hello (`ReplicaPool.attach`)
                if pool.alive[r]:
                    pool.lose(r, "the replica is being restarted")
            try:
                if loss.alone:
                    await asyncio.to_thread(self.ranks.restart_alone, unit, loss.replicas)
                else:
                    await asyncio.to_thread(self.ranks.restart, unit)
            except LaunchError as exc:
                loss = Loss(unit.replicas, False, f"replica {_names(unit.replicas)} could not be restarted: {exc}")
                continue
            for r in restarted:
                self.restarts[r] += 1
                pool.metrics.rank_restarts.labels(str(r)).inc()
            loss = await self._await_hellos(unit)
            if loss is None:
                state.status = "serving"
                logger.warning(
                    "replica %s serves again, %.1f s after the restart began", _names(restarted),
                    time.monotonic() - started,
                )  # fmt: skip
                return

    async def _drain(self, survivors: list[int], not_before: float) -> None:
        """Survivors take no new request and finish theirs (at most `DRAIN_S`); returns no sooner than `not_before`."""
        pool = self.pool
        for r in survivors:
            pool.accepting[r] = False
        deadline = time.monotonic() + DRAIN_S
        while time.monotonic() < not_before or any(s.replica in survivors for s in pool.requests.values()):
            if time.monotonic() > max(deadline, not_before):
                for r in survivors:
                    pool.fail(f"replica {r} was drained for a restart and did not finish within {DRAIN_S:g} s", r)
                break
            await asyncio.sleep(WAIT_S)
        if survivors:
            logger.info("replica %s drained for the restart of its world", _names(survivors))

    async def _await_hellos(self, unit: UnitLike) -> Loss | None:
        """Until every replica of the restarted unit said hello (None), or a rank of it died meanwhile (its Loss)."""
        deadline = time.monotonic() + self.policy.hello_timeout_s
        while not all(self.pool.alive[r] for r in unit.replicas):
            loss = self.ranks.lost(unit)
            if loss is not None:
                return loss
            if time.monotonic() > deadline:
                why = f"did not say hello within {self.policy.hello_timeout_s:g} s of its restart"
                return Loss(unit.replicas, False, f"replica {_names(unit.replicas)} {why}")
            await asyncio.sleep(WAIT_S)
        return None


def _names(replicas: Sequence[int]) -> str:
    return ", ".join(str(r) for r in replicas)
