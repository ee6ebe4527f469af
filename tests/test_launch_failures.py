"""Processes as a user runs them: ranks started by hand on separate addresses, and every way a run can fail.

Each test starts real `afd` processes, bounds every wait, and kills whatever is left on the way out.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from e2e_util import (
    MAX_NEW_TOKENS,
    PROMPTS,
    afd_worker,
    assert_matches_reference,
    kill_all,
    reference,
    start_long_launch,
    wait_for_workers,
    wait_gone,
    worker_pids,
)

from afd.runtime.launch import free_port


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
        from afd.engine import Output

        replicas = [json.loads((tmp_path / f"attn{a}.json").read_text())["outputs"] for a in range(2)]
        outputs = [Output(**replicas[i % 2][i // 2]) for i in range(len(PROMPTS))]
        assert_matches_reference(outputs, reference(True))
    finally:
        kill_all(procs)


@pytest.mark.timeout(60)
def test_missing_rank_times_out_naming_it() -> None:
    config = {
        "connector": "p2p",
        "port": free_port(),
        "num_attention_ranks": 1,
        "num_ffn_ranks": 2,
        "connector_extra_config": {"timeout_s": 4},
    }
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
    """An attention rank pointed at a port where no store listens gives up in bounded time, saying why."""
    config = {
        "connector": "p2p",
        "port": free_port(),
        "num_attention_ranks": 1,
        "num_ffn_ranks": 1,
        "connector_extra_config": {"timeout_s": 4},
    }
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
        time.sleep(3)  # let the run get going
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
        time.sleep(3)
        victim = next(p for p in pids if b"\0--role\0ffn\0" in Path(f"/proc/{p}/cmdline").read_bytes())
        os.kill(victim, signal.SIGKILL)
        _, err = launcher.communicate(timeout=45)
        assert launcher.returncode == 1
        assert "ffn rank" in err and "Traceback" not in err, err
        assert not wait_gone(pids, 10)
    finally:
        kill_all([launcher])
