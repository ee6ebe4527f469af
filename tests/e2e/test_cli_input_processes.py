"""The command line as a new user meets it, run as a process: bad input is one sentence and exit 2, runs that do not fit
the machine are refused before starting, and signals end generate, a hand-started worker and launch with one line and
128 + the signal number."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.cli import main_exit
from helpers.e2e import Leftovers, afd_worker, kill_all, start_long_launch, wait_for_workers, wait_gone

from afd.distributed import signals
from afd.runtime import resources
from afd.runtime.launch import free_port


def run_afd(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "afd", *args], capture_output=True, text=True, timeout=timeout)


def assert_one_sentence(proc: subprocess.CompletedProcess, message: str, code: int = 2) -> None:
    assert proc.returncode == code, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-2000:]
    assert message in proc.stderr, proc.stderr


def test_empty_prompt_ids_is_one_sentence_not_a_type_error() -> None:
    assert_one_sentence(run_afd("generate", "--model", "tiny", "--prompt-ids", ""), "--prompt-ids is empty")


# ---------------------------------------------------------------- prompts files
@pytest.mark.timeout(60)
def test_prompts_file_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt_ids": [1]}\n{"prompt_ids": [2]} \xe9\n')
    proc = run_afd("generate", "--model", "tiny", "--prompts-file", str(path))
    assert_one_sentence(proc, "is not UTF-8 text (byte 0xe9 at offset 40)")


@pytest.mark.timeout(30)
def test_fifo_and_device_are_refused_at_once(tmp_path: Path) -> None:
    """Opening a FIFO for reading blocks until a writer comes, and /dev/zero never ends: both hung."""
    fifo = tmp_path / "prompts.fifo"
    os.mkfifo(fifo)
    for path in (str(fifo), "/dev/zero"):
        proc = run_afd("generate", "--model", "tiny", "--prompts-file", path, timeout=20)
        assert_one_sentence(proc, "is not a regular file")
        proc = run_afd("config", path, timeout=20)
        assert_one_sentence(proc, "is not a regular file")
    assert_one_sentence(run_afd("config", str(tmp_path)), "is a directory")


# ---------------------------------------------------------------- the model's positions
@pytest.mark.timeout(60)
def test_prompt_longer_than_the_models_positions(tmp_path: Path) -> None:
    """5000 tokens on `tiny` (4096 positions) ran and exited 0; a 3.5 M-token prompt tried to allocate 12 TB."""
    path = tmp_path / "long.jsonl"
    path.write_text('{"prompt_ids": [' + ",".join(["1"] * 3_500_000) + "]}\n")
    started = time.monotonic()
    proc = run_afd("generate", "--model", "tiny", "--prompts-file", str(path))
    assert_one_sentence(proc, "prompt 0 has 3500000 tokens, more than the 4096 positions of 'tiny'")
    assert time.monotonic() - started < 30
    ids = ",".join(["1"] * 5000)
    proc = run_afd("launch", "--model", "tiny", "--connector", "p2p", "--prompt-ids", ids)
    assert_one_sentence(proc, "prompt 0 has 5000 tokens, more than the 4096 positions")


@pytest.mark.timeout(60)
def test_prompt_plus_new_tokens_beyond_the_models_positions(capsys: pytest.CaptureFixture) -> None:
    ids = ",".join(["1"] * 4000)
    code, err = main_exit(capsys, "generate", "--model", "tiny", "--prompt-ids", f"1;{ids}", "--max-new-tokens", "97")
    assert code == 2 and "prompt 1 has 4000 tokens and --max-new-tokens is 97: 4097 positions" in err
    assert "lower --max-new-tokens to 96" in err
    proc = run_afd(
        "worker", "--role", "attention", "--rank", "0", "--model", "tiny", "--prompt-ids", ids, "--max-new-tokens", "97"
    )
    assert_one_sentence(proc, "prompt 0 has 4000 tokens and --max-new-tokens is 97")  # a hand-started rank too


@pytest.mark.timeout(60)
def test_too_many_ranks_for_this_machine_are_refused_before_starting() -> None:
    """`--attention 64 --ffn 64` on 2 cores started 128 processes."""
    cpus = resources.usable_cpus()
    n = 2 * cpus + 1
    proc = run_afd(
        "generate", "--model", "tiny", "--prompt-ids", "1", "--connector", "p2p", "--attention", str(n), "--ffn", str(n)
    )
    assert_one_sentence(proc, f"{2 * n} ranks on {cpus} CPU core")
    assert "--skip-resource-check" in proc.stderr


# ---------------------------------------------------------------- signals
def _default_signals() -> None:
    """The child starts with default dispositions even if this test runs under nohup or in the background."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def start_afd(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "afd", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=_default_signals,
    )


def wait_until_caught(proc: subprocess.Popen, sig: int, timeout_s: float = 60) -> None:
    """Until the process has a handler for `sig` (its SigCgt mask in /proc), i.e. afd's main() has begun."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"afd ended early: {proc.communicate()[1][-2000:]}"
        try:
            status = Path(f"/proc/{proc.pid}/status").read_text()
            mask = int(re.search(r"^SigCgt:\s*([0-9a-f]+)", status, re.M).group(1), 16)
        except (OSError, AttributeError):
            mask = 0
        if mask >> (sig - 1) & 1:
            return
        time.sleep(0.05)
    raise AssertionError(f"afd did not install a handler for signal {sig} within {timeout_s} s")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGHUP, 129)])
def test_signal_ends_generate_with_one_line(sig: int, code: int) -> None:
    """A 20-line KeyboardInterrupt traceback before; SIGTERM exited as if by SIGINT."""
    proc = start_afd("generate", "--model", "tiny", "--prompt-ids", "1,2,3", "--max-new-tokens", "4000")
    try:
        wait_until_caught(proc, signal.SIGTERM)  # afd's own handlers are in place (SIGINT has one from startup)
        time.sleep(1.0)  # into the generation
        assert proc.poll() is None
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == code, err[-2000:]
        assert err.strip() == f"afd: interrupted by {signal.Signals(sig).name}", err[-2000:]
    finally:
        kill_all([proc])


@pytest.mark.timeout(90)
def test_sigterm_ends_a_hand_started_worker_with_143() -> None:
    """A rank blocked in its rendezvous (its peer never comes) is in a C call: it still leaves, in seconds."""
    config = {"connector": "p2p", "port": free_port(), "num_attention_ranks": 1, "num_ffn_ranks": 1}
    proc = afd_worker(config, "ffn", 0)
    try:
        wait_until_caught(proc, signal.SIGTERM)
        time.sleep(2.0)  # into the rendezvous wait
        assert proc.poll() is None
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert time.monotonic() - sent < signals.WORKER_SIGNAL_GRACE_S + 5
        assert proc.returncode == 143, err[-2000:]
        assert "interrupted by SIGTERM" in err and "Traceback" not in err, err[-2000:]
    finally:
        kill_all([proc])


@pytest.mark.timeout(120)
def test_sigterm_ends_launch_with_143_and_stops_its_ranks() -> None:
    leftovers = Leftovers()
    launcher = start_long_launch(free_port(), "p2p")
    try:
        pids = wait_for_workers(4)
        time.sleep(1.0)
        assert launcher.poll() is None
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=40)
        assert launcher.returncode == 143, err[-2000:]
        assert err.strip().splitlines()[-1] == "afd: interrupted by SIGTERM" and "Traceback" not in err, err
        assert not wait_gone(pids, 10), "ranks left behind"
    finally:
        kill_all([launcher])
        leftovers.cleanup()
