"""async end to end on CPU: real rank processes over POSIX shared memory, started by the launcher.

Every run is compared with the single-process reference engine, leaves no `afd worker` process and no
/dev/shm/afd_* segment behind, and kills whatever is left on the way out.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from helpers.async_runs import reference, run_async, tokens, uneven_prompts
from helpers.e2e import (
    Leftovers,
    afd_worker,
    assert_matches_reference,
    hand_config,
    kill_all,
    role_of,
    start_long_launch,
    wait_for_workers,
    wait_gone,
    wait_until_mapped,
)

from afd.runtime.launch import free_port

SHARED_TEST_TAG = True  # one zygote for the module's launches (tests/conftest.py)

VOCAB = 256  # the tiny preset


# ---------------------------------------------------------------- correctness under uneven load
TOPOLOGIES = [(1, 1), (2, 2), (3, 1), (3, 2), (1, 3)]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("num_attn, num_ffn", TOPOLOGIES, ids=[f"{a}A{f}F" for a, f in TOPOLOGIES])
def test_async_matches_reference_with_uneven_replicas(num_attn: int, num_ffn: int, tmp_path: Path) -> None:
    prompts = uneven_prompts(num_attn)
    outputs, stats = run_async(num_attn, num_ffn, prompts, run_dir=tmp_path)
    assert_matches_reference(outputs, reference(prompts))
    replicas = stats["replicas"]
    assert len(replicas) == num_attn
    if num_attn >= 3:
        assert replicas[-1]["num_steps"] == 0, "the replica with no prompt must not step (no dummy steps)"


# ---------------------------------------------------------------- no lockstep
LONG_PROMPT = 3000  # ~5 s of prefill on one CPU core; the short replica is done in well under 1 s


@pytest.mark.timeout(120)
def test_replica_finishes_while_another_is_in_its_first_prefill(tmp_path: Path) -> None:
    """2A1F: replica 0's first step is one 3000-token prefill; replica 1 (two short prompts, a few
    tokens) starts, decodes and finishes before replica 0 has its first token."""
    long = tokens(LONG_PROMPT, 99)
    # replica 0: [long, [7]] (the 1-token prompt waits for the long prefill: one step more);
    # replica 1: [[1, 2], [3]] (both prefilled in its first step)
    prompts = [long, [1, 2], [7], [3]]
    outputs, stats = run_async(2, 1, prompts, max_new_tokens=3, max_num_batched_tokens=LONG_PROMPT, run_dir=tmp_path)
    slow, fast = stats["replicas"]
    slow_first_token = slow["start_unix"] + slow["ttft_s"][0]
    fast_end = fast["start_unix"] + fast["elapsed_s"]
    assert fast_end < slow_first_token, (
        f"replica 1 ended at +{fast_end - slow['start_unix']:.2f} s, replica 0's first token came at "
        f"+{slow['ttft_s'][0]:.2f} s: the replicas ran in lockstep"
    )
    assert fast["num_steps"] == 3 and slow["num_steps"] == 4, stats
    assert_matches_reference(outputs, reference(prompts, max_new_tokens=3))


# ---------------------------------------------------------------- stress
@pytest.mark.timeout(90)
def test_many_single_token_decode_steps() -> None:
    """1A2F, one 1-token prompt, 300 decode steps of one token each: every step's 3 routed rows may all
    land on one FFN rank; no ring slot may leak on the other."""
    prompts = [[42]]
    outputs, stats = run_async(1, 2, prompts, max_new_tokens=300)
    assert stats["replicas"][0]["num_steps"] == 300
    assert_matches_reference(outputs, reference(prompts, max_new_tokens=300))


@pytest.mark.timeout(60)
def test_fewer_tokens_than_ffn_ranks() -> None:
    """1A3F with a 1-token prompt: 1 token's shared rows go to FFN rank 0 only and its 3 routed rows to at
    most 3 ranks, so some FFN ranks get nothing in some steps."""
    prompts = [[9]]
    outputs, _ = run_async(1, 3, prompts)
    assert_matches_reference(outputs, reference(prompts))


# ---------------------------------------------------------------- failure
@pytest.mark.timeout(120)
def test_killed_attention_rank_ends_the_run_and_cleans_up() -> None:
    leftovers = Leftovers()
    launcher = start_long_launch(free_port(), "async", max_new_tokens=4000)
    try:
        # wait until every rank has mapped all 4 windows (past init), then let the decode loop run
        pids = wait_for_workers(len(leftovers.pids) + 4) - leftovers.pids  # this launch's ranks only
        wait_until_mapped(pids, 4, [launcher])
        time.sleep(1.5)
        assert launcher.poll() is None, "the run ended before the kill"
        victim = next(p for p in sorted(pids) if role_of(p) == "attention")
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        _, err = launcher.communicate(timeout=30)
        assert time.monotonic() - killed < 30
        assert launcher.returncode != 0
        assert "rank" in err and "Traceback" not in err, err
        assert not wait_gone(pids, 10), "afd worker processes left behind"
        assert not leftovers.new_segments(), f"segments left behind: {sorted(leftovers.new_segments())}"
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait(10)
        leftovers.cleanup()


@pytest.mark.timeout(100)
@pytest.mark.parametrize("device_passes", [False, True], ids=["host_loop", "device_passes"])
def test_ffn_rank_gives_up_on_its_own_when_attention_dies(device_passes: bool) -> None:
    """No launcher to stop it: an FFN rank whose only attention peer is SIGKILLed mid-run exits non-zero
    by itself in bounded time, naming that rank, and unlinks its own window; also while it waits in a pass queued
    for the device (`cpu_device_passes`, afd.connectors.asynchronous.ffn_chain)."""
    config = hand_config("async", 1, 1, port=free_port(), recv_poll_timeout_ms=100, cpu_device_passes=device_passes)
    leftovers = Leftovers()
    ffn = afd_worker(config, "ffn", 0)
    attn = afd_worker(config, "attention", 0, "--prompt-ids", "1,2,3", "--max-new-tokens", "4000")
    try:
        wait_until_mapped({ffn.pid, attn.pid}, 2, [ffn, attn])
        time.sleep(1.0)
        assert attn.poll() is None, "the attention rank ended before the kill"
        killed = time.monotonic()
        os.kill(attn.pid, signal.SIGKILL)
        _, err = ffn.communicate(timeout=20)
        assert time.monotonic() - killed < 20
        assert ffn.returncode != 0
        assert "attention rank 0" in err and "died" in err and "Traceback" not in err, err
        assert not leftovers.new_segments(), f"segments left behind: {sorted(leftovers.new_segments())}"
    finally:
        kill_all([ffn, attn])
        leftovers.cleanup()
