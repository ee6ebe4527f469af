"""The healer over in-process replicas (`helpers.serve.InProcessServer`) and a stand-in rank supervisor: a lost
replica's requests end with the death's words, it is restarted after its backoff and serves again (/health back to
ok, its restart counted), and one that dies too often is given up on in one log line."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import pytest
from helpers.serve import InProcessServer

from afd.runtime.servers import Loss
from afd.serve.healing import Healer, HealPolicy


@dataclass
class FakeUnit:
    index: int
    replicas: tuple[int, ...]


class FakeRanks:
    """A rank supervisor whose deaths the test declares; `restart` starts the replica's thread again."""

    def __init__(self, num_replicas: int) -> None:
        self.units = [FakeUnit(r, (r,)) for r in range(num_replicas)]
        self.dead: dict[int, str] = {}
        self.restarted: list[int] = []
        self.server: InProcessServer | None = None

    def lost(self, unit: FakeUnit) -> Loss | None:
        why = self.dead.get(unit.index)
        return Loss(unit.replicas, False, why) if why else None

    def stop_unit(self, unit: FakeUnit) -> None:
        pass

    def restart(self, unit: FakeUnit) -> None:
        (r,) = unit.replicas
        assert self.server is not None
        self.server.threads[r].join(10)  # the lost replica's loop has ended (its link was cut)
        self.dead.pop(unit.index, None)
        self.restarted.append(r)
        self.server.start_replica(r)


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} within {timeout_s} s"
        time.sleep(0.02)


def test_backoff_doubles_and_is_capped() -> None:
    policy = HealPolicy(backoff_s=0.5, max_backoff_s=3.0)
    assert [policy.delay(n) for n in (1, 2, 3, 4, 5)] == [0.5, 1.0, 2.0, 3.0, 3.0]


@pytest.mark.timeout(120)
def test_a_dead_replica_is_restarted_and_one_that_dies_too_often_is_given_up(caplog) -> None:
    ranks = FakeRanks(2)
    policy = HealPolicy(max_restarts=2, window_s=60.0, backoff_s=0.2)
    srv = InProcessServer(2, healer=lambda pool, link: Healer(ranks, pool, policy, link.accept_later))
    ranks.server = srv
    pool = srv.state.pool
    try:
        ranks.dead[1] = "replica 1 exited with status -9 (killed by SIGKILL)"
        srv.cut(1)
        _wait(lambda: ranks.restarted == [1], 30, "replica 1 was not restarted")
        _wait(lambda: srv.request("GET", "/health")[1]["status"] == "ok", 30, "the server was not whole again")
        status, health, _ = srv.request("GET", "/health")
        assert status == 200 and health["replicas"][1] == {"index": 1, "alive": True, "restarts": 1}
        status, page, _ = srv.request("GET", "/metrics")
        assert 'afd_rank_restarts_total{replica="1"} 1.0' in page and "afd_replicas_alive 2.0" in page
        for _ in range(4):  # requests reach both replicas again
            assert srv.post("/v1/completions", {"prompt": "a", "max_tokens": 2})[0] == 200
        with caplog.at_level(logging.ERROR, logger="afd.serve.healing"):
            ranks.dead[1] = "replica 1 exited with status 1"
            srv.cut(1)
            _wait(lambda: "giving up on replica 1" in caplog.text, 30, "replica 1 was not given up on")
        assert ranks.restarted == [1]  # the second death within the window: no restart
        assert sum("giving up" in r.message for r in caplog.records) == 1
        status, health, _ = srv.request("GET", "/health")
        assert status == 200 and health["status"] == "degraded" and not pool.alive[1]
        assert srv.post("/v1/completions", {"prompt": "a", "max_tokens": 2})[0] == 200  # replica 0 serves
    finally:
        srv.close()


def test_a_loss_is_read_from_one_look_at_the_ranks_while_a_restart_replaces_them(tmp_path) -> None:
    """The server's loop asks `lost` while a restart, on another thread, swaps the unit's rank list: the answer
    comes from one list, never a dead rank found in the old list and then looked up in the new one."""
    from afd.runtime.launch import RankProcess
    from afd.runtime.servers import ServerRanks
    from afd.runtime.spec import RunSpec

    ranks = ServerRanks(None, RunSpec(), 1, tmp_path, "s", "@x")
    unit = ranks.units[0]

    class Proc:
        def __init__(self, code: int | None, then=None) -> None:
            self.code, self.then = code, then

        def poll(self) -> int | None:
            if self.then is not None:
                self.then()  # the restart lands between two looks at the list
            return self.code

    fresh = [RankProcess("replica", 0, 0, Proc(None), tmp_path / "new.log")]
    unit.ranks = [RankProcess("replica", 0, 0, Proc(-9, lambda: setattr(unit, "ranks", fresh)), tmp_path / "old.log")]
    loss = ranks.lost(unit)
    assert loss is not None and loss.replicas == (0,) and "replica 0 exited" in loss.why
    assert ranks.lost(unit) is None  # the new list: every rank runs


class OneWorld(FakeRanks):
    """Both replicas in one unit (an `async` world); a dead attention replica is restarted alone."""

    def __init__(self) -> None:
        super().__init__(2)
        self.units = [FakeUnit(0, (0, 1))]
        self.alone: list[tuple[int, ...]] = []

    def lost(self, unit: FakeUnit) -> Loss | None:
        why = self.dead.get(1)
        return Loss((1,), False, why, alone=True) if why else None

    def restart(self, unit: FakeUnit) -> None:
        raise AssertionError("the whole world was restarted")

    def restart_alone(self, unit: FakeUnit, replicas: tuple[int, ...]) -> None:
        assert self.server is not None
        self.server.threads[1].join(10)
        self.dead.pop(1, None)
        self.alone.append(replicas)
        self.server.start_replica(1)


@pytest.mark.timeout(120)
def test_a_replica_restarted_alone_leaves_the_others_serving() -> None:
    ranks = OneWorld()
    policy = HealPolicy(backoff_s=1.0)
    srv = InProcessServer(2, healer=lambda pool, link: Healer(ranks, pool, policy, link.accept_later))
    ranks.server = srv
    pool = srv.state.pool
    try:
        ranks.dead[1] = "attention rank 1 (world rank 1) exited with status -9 (killed by SIGKILL)"
        srv.cut(1)
        _wait(lambda: not pool.alive[1], 30, "replica 1 was not lost")
        assert pool.accepting[0]  # no drain: replica 0 takes requests through the backoff
        assert srv.post("/v1/completions", {"prompt": "a", "max_tokens": 2})[0] == 200
        _wait(lambda: srv.request("GET", "/health")[1]["status"] == "ok", 30, "the server was not whole again")
        assert ranks.alone == [(1,)]
        assert [r["restarts"] for r in srv.request("GET", "/health")[1]["replicas"]] == [0, 1]
    finally:
        srv.close()


@pytest.mark.parametrize(("device", "dead", "replicas", "alone", "drain"), [
    ("cpu", {1}, (1,), True, False),  # shared memory: the replica rejoins the running world
    ("cuda", {1}, (1,), False, True),  # NVSHMEM: its world is fixed at init, the survivors drain
    ("cpu", {2}, (0, 1), False, False),  # an FFN rank: its experts are gone for every replica
    ("cpu", {0, 1}, (0, 1), False, True),  # no replica left to serve: the world restarts
])  # fmt: skip
def test_what_an_async_death_costs(tmp_path, device, dead, replicas, alone, drain) -> None:
    from afd.config import parse_config
    from afd.runtime.launch import RankProcess
    from afd.runtime.servers import ServerRanks
    from afd.runtime.spec import RunSpec

    config = parse_config({"connector": "async", "num_attention_ranks": 2, "num_ffn_ranks": 1})
    ranks = ServerRanks(config, RunSpec(device=device), 2, tmp_path, "s", "@x")

    class Proc:
        def __init__(self, code: int | None) -> None:
            self.code = code

        def poll(self) -> int | None:
            return self.code

    unit = ranks.units[0]
    roles = [("attention", 0), ("attention", 1), ("ffn", 0)]
    unit.ranks = [
        RankProcess(role, rr, w, Proc(-9 if w in dead else None), tmp_path / f"{w}.log")
        for w, (role, rr) in enumerate(roles)
    ]
    loss = ranks.lost(unit)
    assert loss is not None and (loss.replicas, loss.alone, loss.drain) == (replicas, alone, drain)
