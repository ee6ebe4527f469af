"""Processes as a user runs them: ranks started by hand on separate addresses, and every way a run can fail.

Each test starts real `afd` processes, bounds every wait, and kills whatever is left on the way out.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from helpers.e2e import (
    MAX_NEW_TOKENS,
    MODEL,
    P2P_WARMED_UP,
    PROMPTS,
    TOLERANCE,
    Leftovers,
    afd_worker,
    assert_matches_reference,
    hand_config,
    kill_all,
    reference,
    role_of,
    start_long_launch,
    wait_for_workers,
    wait_gone,
    wait_until_logged,
    worker_pids,
)
from helpers.held_replica import accept_replica, assert_served_matches, serve_prompts

from afd.config import parse_config
from afd.engine.generate import generate
from afd.env import SECRET_VAR
from afd.runtime.launch import LaunchError, free_port, launch, new_secret
from afd.runtime.link import FrontLink, format_address
from afd.runtime.spec import RunSpec


def wait_until_stepping(pids: set[int], launcher: subprocess.Popen) -> None:
    """Until a long p2p launch is in its decode loop: every attention rank has run its world's first step (its
    warm-up), and a moment more."""
    wait_until_logged({p for p in pids if role_of(p) == "attention"}, P2P_WARMED_UP, [launcher])
    time.sleep(0.5)


@pytest.mark.timeout(120)
def test_multi_host_ranks_started_by_hand(tmp_path: Path) -> None:
    """FFN ranks on 127.0.0.2 / 127.0.0.3, attention on 127.0.0.1; only the world store has a port."""
    port = free_port("127.0.0.2")
    config = {
        "connector": "p2p",
        "host": "127.0.0.2",
        "port": port,
        "num_attention_ranks": 2,
        "num_ffn_ranks": 2,
        "connector_extra_config": {"timeout_s": 60},
    }
    procs = []
    try:
        for a in range(2):  # attention first: ranks may start in any order
            prompts = ";".join(",".join(map(str, p)) for p in PROMPTS[a::2])
            out = tmp_path / f"attn{a}.json"
            procs.append(
                afd_worker(
                    config,
                    "attention",
                    a,
                    "--prompt-ids",
                    prompts,
                    "--output",
                    str(out),
                    "--prompt-logprobs",
                    "--max-new-tokens",
                    str(MAX_NEW_TOKENS),
                    bind_host="127.0.0.1",
                )
            )
            time.sleep(0.5)
        for f, host in enumerate(["127.0.0.2", "127.0.0.3"]):
            procs.append(afd_worker(config, "ffn", f, bind_host=host))
        for p in procs:
            _, err = p.communicate(timeout=90)
            assert p.returncode == 0, err
        from afd.engine.engine import Output

        replicas = [json.loads((tmp_path / f"attn{a}.json").read_text())["outputs"] for a in range(2)]
        outputs = [Output(**replicas[i % 2][i // 2]) for i in range(len(PROMPTS))]
        assert_matches_reference(outputs, reference(True))
    finally:
        kill_all(procs)


@pytest.mark.timeout(60)
def test_missing_rank_times_out_naming_it() -> None:
    config = hand_config("p2p", 1, 2, port=free_port(), timeout_s=4)
    procs = [afd_worker(config, "ffn", 0), afd_worker(config, "attention", 0, "--prompt-ids", "1,2")]
    try:
        start = time.monotonic()
        for p in procs:
            _, err = p.communicate(timeout=45)
            assert p.returncode != 0
            assert "world rank 1" in err and "ffn 1" in err, err
            assert "Traceback" not in err
        assert time.monotonic() - start < 45
    finally:
        kill_all(procs)


@pytest.mark.timeout(60)
def test_wrong_port_times_out_with_clear_message() -> None:
    """An attention rank pointed at a port where no store listens gives up in bounded time, saying why. (No peer
    has to start within the timeout here, so it can be short: the store client's retries still overshoot it.)"""
    config = hand_config("p2p", 1, 1, port=free_port(), timeout_s=2)
    proc = afd_worker(config, "attention", 0, "--prompt-ids", "1,2")
    try:
        _, err = proc.communicate(timeout=45)
        assert proc.returncode != 0
        assert "world rank 0" in err and "Traceback" not in err, err
    finally:
        kill_all([proc])


@pytest.mark.timeout(60)
def test_mismatched_rank_counts_are_named() -> None:
    port = free_port()
    base = {"connector": "p2p", "port": port, "num_ffn_ranks": 1, "connector_extra_config": {"timeout_s": 10}}
    procs = [
        afd_worker({**base, "num_attention_ranks": 1}, "ffn", 0),
        afd_worker({**base, "num_attention_ranks": 2}, "attention", 0, "--prompt-ids", "1,2"),
    ]
    try:
        errs = []
        for p in procs:
            _, err = p.communicate(timeout=45)
            assert p.returncode != 0
            errs.append(err)
        assert any("num_attention" in e or "A=" in e or "attention ranks" in e for e in errs), errs
    finally:
        kill_all(procs)


@pytest.mark.timeout(90)
def test_sigterm_to_launch_ends_the_whole_tree() -> None:
    before = worker_pids()
    launcher = start_long_launch(free_port(), "p2p")
    try:
        pids = wait_for_workers(len(before) + 4) - before
        wait_until_stepping(pids, launcher)
        sent = time.monotonic()
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=20)
        assert not wait_gone(pids, max(0.0, 20 - (time.monotonic() - sent)))
        assert time.monotonic() - sent < 20
    finally:
        kill_all([launcher])


@pytest.mark.timeout(90)
def test_killed_rank_fails_the_run_naming_it() -> None:
    before = worker_pids()
    launcher = start_long_launch(free_port(), "p2p")
    try:
        pids = wait_for_workers(len(before) + 4) - before
        wait_until_stepping(pids, launcher)
        victim = next(p for p in pids if role_of(p) == "ffn")
        os.kill(victim, signal.SIGKILL)
        _, err = launcher.communicate(timeout=45)
        assert launcher.returncode == 1
        assert "ffn rank" in err and "Traceback" not in err, err
        assert not wait_gone(pids, 10)
        # only lines that explain the failure are quoted (no "model loaded"), and the kept logs are named
        assert "exited with status -9 (killed by SIGKILL); logs: " in err, err
        run_dir = Path(err.rsplit("logs: ", 1)[1].split()[0])
        assert (run_dir / "ffn0.log").exists(), err
        shutil.rmtree(run_dir)
    finally:
        kill_all([launcher])


# ---------------------------------------------------------------- store, launcher, failure messages
def _reference(prompts: list[list[int]], max_new_tokens: int) -> list:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # other tests' ranks share the cores: oversubscribed threads are much slower
    try:
        return generate(MODEL, prompts, max_new_tokens=max_new_tokens)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.timeout(240)
def test_second_run_on_the_same_port_fails_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run's store holds its port: a second launcher cannot bind it, says so in one line before starting any rank,
    and the first run never notices. The first run is a replica this test serves by hand, so it is still running
    when the second launcher tries, however fast or slow the machine is."""
    secret = new_secret()
    monkeypatch.setenv(SECRET_VAR, secret)
    link = FrontLink(secret.encode())
    port = free_port()
    config = hand_config("p2p", 1, 1, port=port)  # world rank 0, the FFN rank, hosts the store on `port`
    leftovers = Leftovers()
    first = [
        afd_worker(config, "ffn", 0),
        afd_worker(config, "attention", 0, "--serve-address", format_address(link.address)),
    ]
    second = None
    try:
        deadline = time.monotonic() + 200
        conn = accept_replica(link, 0, first)
        first_ranks = worker_pids()
        second = start_long_launch(port, "async", max_new_tokens=5)
        _, err = second.communicate(timeout=120)
        assert second.returncode == 2, "a refused launch is bad input: exit status 2"
        assert f"port {port} on 127.0.0.1 is already in use" in err and "Traceback" not in err, err
        assert len(err.strip().splitlines()) == 1, err
        assert worker_pids() <= first_ranks, "the second launcher started ranks"
        assert all(p.poll() is None for p in first), "the first run ended when the second one was refused"
        got = serve_prompts(conn, [[1, 2, 3], [4, 5]], 20, deadline, first)
        conn.send({"type": "shutdown"})
        for p in first:
            assert p.wait(timeout=max(1.0, deadline - time.monotonic())) == 0, p.communicate()[1][-3000:]
        assert_served_matches(got, _reference([[1, 2, 3], [4, 5]], 20), TOLERANCE)
        leftovers.check()
    finally:
        kill_all([*first, *([second] if second is not None else [])])
        link.close()
        leftovers.cleanup()


@pytest.mark.timeout(90)
def test_killed_launcher_takes_its_ranks_with_it() -> None:
    """`kill -9` of `afd launch`: its ranks (parent-death signal, watchdog) are all gone within seconds."""
    leftovers = Leftovers()
    launcher = start_long_launch(free_port(), "p2p")
    try:
        pids = wait_for_workers(4)
        wait_until_stepping(pids, launcher)
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(10)
        assert not wait_gone(pids, 10), "ranks outlived their launcher"
    finally:
        kill_all([launcher])
        leftovers.cleanup()


@pytest.mark.timeout(90)
def test_sighup_to_launch_ends_the_whole_tree() -> None:
    """A closed terminal or SSH session (SIGHUP) stops the run like SIGTERM does."""
    leftovers = Leftovers()
    launcher = start_long_launch(free_port(), "p2p")
    try:
        pids = wait_for_workers(4)
        wait_until_stepping(pids, launcher)
        sent = time.monotonic()
        launcher.send_signal(signal.SIGHUP)
        launcher.wait(timeout=20)
        assert launcher.returncode != 0
        assert not wait_gone(pids, max(0.0, 20 - (time.monotonic() - sent)))
    finally:
        kill_all([launcher])
        leftovers.cleanup()


@pytest.mark.timeout(60)
def test_failed_launch_keeps_and_names_its_run_directory() -> None:
    config = parse_config({"connector": "p2p", "port": free_port(), "num_attention_ranks": 1, "num_ffn_ranks": 1})
    with pytest.raises(LaunchError) as info:
        launch(config, RunSpec(model="no-such-model", max_new_tokens=2, timeout_s=45), [[1, 2, 3]])
    msg = str(info.value)
    assert re.search(r"rank 0 \(world rank \d\) exited with status 2: error: .*no-such-model", msg), msg
    run_dir = Path(msg.rsplit("logs: ", 1)[1])
    try:
        assert run_dir.is_dir() and (run_dir / "prompts_attn0.jsonl").exists() and (run_dir / "ffn0.log").exists()
    finally:
        shutil.rmtree(run_dir)
