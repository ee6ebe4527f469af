"""Failure isolation of the real `afd serve --model tiny` under load: a rank killed with -9 ends only the requests
of the replicas it served (each with a clean error that names it), every other request completes with the reference
engine's greedy tokens, none hangs, and the server restarts what died and is whole again (/health `ok`) within the
issue's bounds; at the end SIGTERM leaves no rank and no shared-memory segment."""

from __future__ import annotations

import logging
import os
import tempfile
import time
from pathlib import Path

import pytest
from helpers.chaos import Load, await_whole, health
from helpers.e2e import TEST_TAG_VAR, Leftovers

from afd.bench.chaos import kill_rank, rank_pids
from afd.bench.chaos_run import format_chaos
from afd.runtime.launch import free_port
from afd.serve.run import ServerProcess

log = logging.getLogger(__name__)

MODEL = "tiny"
PROMPTS = [[5, 17, 33, 2, 9, 41, 7, 3, 19, 23, 11], [4, 8], [100, 3, 77, 12, 9, 250], [1, 2, 3]]
MAX_TOKENS = 24
SMALL = ["--max-num-seqs", "16", "--max-model-len", "512", "--max-num-batched-tokens", "512"]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    from afd.engine.generate import generate

    return [out.token_ids for out in generate(MODEL, PROMPTS, max_new_tokens=MAX_TOKENS)]


class Served:
    def __init__(self, flags: list[str], tag: str, monkeypatch) -> None:
        monkeypatch.setenv(TEST_TAG_VAR, tag)  # the ranks inherit it: Leftovers sees exactly this server's
        self.leftovers = Leftovers()
        self.port = free_port()
        argv = ["--model", MODEL, "--port", str(self.port), *SMALL, *flags]
        self.log_path = tempfile.mkstemp(prefix=f"afd_{tag}_", suffix=".log")[1]  # the server's log, for failures
        self.server = ServerProcess(argv, timeout_s=120, log_path=self.log_path)

    def stop_clean(self) -> None:
        assert self.server.stop(timeout_s=30) == 0  # whole again: a clean stop
        self.leftovers.check()

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-lines:])

    def close(self) -> None:
        try:
            self.server.stop(timeout_s=5)
        finally:
            self.leftovers.cleanup()
            Path(self.log_path).unlink(missing_ok=True)


def _kill_under_load(srv: Served, load: Load, role: str, rank: int, restarts: int, heal_bound_s: float) -> float:
    """Requests complete first; then kill the rank, wait for the server to be whole, and let requests complete on it
    again. Returns the seconds from the kill to whole again."""
    right = load.count("right")
    deadline = time.monotonic() + 60
    while load.count("right") < right + 4:
        assert time.monotonic() < deadline, "no request completed under load"
        time.sleep(0.05)
    kill_rank(srv.server.proc.pid, role, rank)
    killed = time.monotonic()
    healed_s = await_whole(srv.port, restarts, heal_bound_s, since=killed)
    right = load.count("right")
    while load.count("right") < right + 4:  # and it serves again
        assert time.monotonic() < deadline + 60, "no request completed after the restart"
        time.sleep(0.05)
    log.warning("%s rank %d killed: whole again after %.1f s", role, rank, healed_s)
    return healed_s


@pytest.mark.timeout(240)
def test_none_a_killed_replica_costs_only_its_requests_and_is_restarted(monkeypatch, reference):
    srv = Served(["--connector", "none", "--replicas", "2"], f"isolnone{os.getpid()}", monkeypatch)
    try:
        load = Load(srv.port, PROMPTS, reference, MAX_TOKENS, clients=4)
        try:
            healed_s = _kill_under_load(srv, load, "replica", 1, restarts=1, heal_bound_s=10)
        finally:
            load.stop()
        assert load.count("wrong") == 0 and load.count("hung") == 0
        failures = load.errors()
        assert all("replica 1 exited with status -9" in e for e in failures), (
            failures,
            srv.log_tail(),
        )  # none of replica 0's
        print(f"none R=2: whole again {healed_s:.1f} s after the kill; {load.count('right')} right, "
              f"{len(failures)} failed (all on the killed replica)")  # fmt: skip
        assert health(srv.port)["replicas"][1]["restarts"] == 1
        srv.stop_clean()
    finally:
        srv.close()


@pytest.mark.timeout(300)
def test_async_a_killed_attention_replica_or_ffn_rank_is_restarted(monkeypatch, reference):
    """On CPU a dead attention replica is restarted alone: the FFN rank and the other replica serve on throughout."""
    flags = ["--connector", "async", "--attention", "2", "--ffn", "1"]
    srv = Served(flags, f"isolasync{os.getpid()}", monkeypatch)
    try:
        load = Load(srv.port, PROMPTS, reference, MAX_TOKENS, clients=4)
        try:
            before = rank_pids(srv.server.proc.pid)
            attention_s = _kill_under_load(srv, load, "attention", 1, restarts=1, heal_bound_s=15)
            after = rank_pids(srv.server.proc.pid)
            failures_after_attention, refused_after_attention = load.errors(), load.count("refused")
            ffn_s = _kill_under_load(srv, load, "ffn", 0, restarts=3, heal_bound_s=15)
        finally:
            load.stop()
        assert load.count("wrong") == 0 and load.count("hung") == 0
        # the attention kill: only that process was replaced, and only its requests failed; none was refused
        assert after[("ffn", 0)] == before[("ffn", 0)] and after[("attention", 0)] == before[("attention", 0)]
        assert after[("attention", 1)] != before[("attention", 1)]
        assert refused_after_attention == 0, srv.log_tail()
        assert [r["restarts"] for r in health(srv.port)["replicas"]] == [1, 2]
        assert all("attention rank 1" in e for e in failures_after_attention), (
            failures_after_attention,
            srv.log_tail(),
        )
        later = load.errors()[len(failures_after_attention) :]
        assert all("ffn rank 0" in e or "restarted" in e for e in later), (later, srv.log_tail())
        print(
            f"async 2A1F: attention rank 1 killed: whole again after {attention_s:.1f} s, "
            f"{len(failures_after_attention)} failed (all on it); ffn rank 0 killed: whole again after "
            f"{ffn_s:.1f} s; {load.count('right')} right, {load.count('refused')} refused while restarting"
        )
        srv.stop_clean()
    finally:
        srv.close()


@pytest.mark.timeout(240)
def test_p2p_a_killed_rank_stops_the_group_which_is_restarted_whole(monkeypatch, reference):
    srv = Served(["--connector", "p2p", "--attention", "1", "--ffn", "1"], f"isolp2p{os.getpid()}", monkeypatch)
    try:
        load = Load(srv.port, PROMPTS, reference, MAX_TOKENS, clients=2)
        try:
            healed_s = _kill_under_load(srv, load, "ffn", 0, restarts=1, heal_bound_s=60)
        finally:
            load.stop()
        assert load.count("wrong") == 0 and load.count("hung") == 0
        failures = load.errors()
        assert all("ffn rank 0" in e or "restarted" in e for e in failures), (failures, srv.log_tail())
        print(f"p2p 1A1F: ffn rank 0 killed: whole again after {healed_s:.1f} s; {len(failures)} failed")
        srv.stop_clean()
    finally:
        srv.close()


CHAOS = {"none-R2": ["--connector", "none", "--replicas", "2"],
         "async-2A1F": ["--connector", "async", "--attention", "2", "--ffn", "1"],
         "p2p-2A2F": ["--connector", "p2p", "--attention", "2", "--ffn", "2"]}  # fmt: skip
CHAOS_S, CHAOS_INTERVAL_S = 12.0, 3.0  # two kills at least, each healed before the next


@pytest.mark.timeout(90)
@pytest.mark.parametrize("name", list(CHAOS))
def test_chaos_random_kills_under_load(monkeypatch, name):
    """`afd bench serve --chaos`'s code path for 12 s: a random rank killed every 3 s under Poisson load, each
    time once the server is whole again. Every request is right or ends with an error naming a killed rank (or
    refused while none serves), none hangs, every kill heals, nothing is left behind."""
    from afd.bench.chaos_run import chaos_server

    monkeypatch.setenv(TEST_TAG_VAR, f"chaos{name.replace('-', '')}{os.getpid()}")
    leftovers = Leftovers()
    argv = ["--model", MODEL, *SMALL, *CHAOS[name], "--restart-window", str(CHAOS_INTERVAL_S / 2)]
    try:
        chaos = dict(rate=4.0, seconds=CHAOS_S, interval_s=CHAOS_INTERVAL_S, bound_s=30.0, heal_bound_s=30.0)
        got = chaos_server(argv, PROMPTS, [MAX_TOKENS] * len(PROMPTS), {"model": MODEL}, startup_timeout_s=60, **chaos)
        print(format_chaos(name, got))
        assert got["wrong"] == 0 and got["hung"] == 0 and got["num_stray_failures"] == 0, got
        assert len(got["kills"]) >= 2 and got["not_healed"] == 0, got["kills"]
        assert got["completed"] > 0 and got["server_exit_status"] == 0
        assert got["leftovers"] == {"processes": [], "segments": []}
        leftovers.check()
    finally:
        leftovers.cleanup()
