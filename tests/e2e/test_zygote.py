"""The zygote a launch forks its ranks from (`afd.runtime.zygote`): real forks of real `afd` commands, their exit
statuses, titles and parents, the environment /proc shows, and what happens when the zygote goes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.e2e import MODEL, hand_config, zygote_pids

from afd.distributed.watchdog import process_alive
from afd.runtime import zygote as zygotes
from afd.runtime.launch import free_port, new_secret, rank_environment


def _parent_of(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def _wait_for_command(pid: int, cmd: list[str], timeout_s: float = 60) -> None:
    """Until /proc shows `cmd` as the process's title: the fork has set itself up as the rank."""
    deadline = time.monotonic() + timeout_s
    while (shown := Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0")) != " ".join(cmd).encode():
        assert time.monotonic() < deadline, f"the rank's command line is still {shown[:80]}"
        time.sleep(0.05)


def _waiting_ffn_rank() -> list[str]:
    """An FFN rank of an async 1A1F world whose store nobody hosts: it waits (bounded) until stopped."""
    config = hand_config("async", 1, 1, port=free_port(), timeout_s=60)
    return [sys.executable, "-m", "afd", "worker", "--config", json.dumps(config), "--role", "ffn", "--rank", "0"] + [
        "--model",
        MODEL,
    ]


def test_set_title_rewrites_the_command_line_and_keeps_the_environment() -> None:
    """With room on its command line and SPT_NOENV (as the zygote starts), the title fits there and
    /proc/PID/environ still shows the environment (the tests find their ranks by it)."""
    code = (
        "from afd.runtime.zygote import set_title; set_title(['afd-test', 'worker', '--role', 'ffn']); "
        "print(open('/proc/self/cmdline', 'rb').read().rstrip(b'\\0')); "
        "print(b'AFD_TEST_RANK_MARK=m' in open('/proc/self/environ', 'rb').read().split(b'\\0'))"
    )
    env = {**os.environ, "SPT_NOENV": "1", "AFD_TEST_RANK_MARK": "m"}
    out = subprocess.run([sys.executable, "-c", code, " " * 200], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["b'afd-test", "worker", "--role", "ffn'", "True"]


@pytest.mark.timeout(120)
def test_a_forked_rank_reports_its_exit_status_and_writes_its_log(tmp_path: Path) -> None:
    zygote = zygotes.Zygote()
    try:
        cmd = [sys.executable, "-m", "afd", "worker", "--no-such-flag"]
        rank = zygote.spawn(cmd, dict(os.environ), tmp_path / "r.log")
        assert rank.wait(90) == 2  # the CLI's usage error, as the process of its own would have exited
        assert "afd: error:" in (tmp_path / "r.log").read_text()
        with pytest.raises(ValueError, match="afd commands only"):
            zygote.spawn([sys.executable, "-c", "pass"], dict(os.environ), tmp_path / "x.log")
    finally:
        zygote.close()
    assert zygote.proc.returncode is not None and not zygote.log_path.exists()


@pytest.mark.timeout(120)
def test_a_forked_rank_shows_its_command_has_its_own_session_and_reports_its_signal(tmp_path: Path) -> None:
    zygote = zygotes.Zygote()
    cmd = _waiting_ffn_rank()
    try:
        rank = zygote.spawn(cmd, dict(os.environ), tmp_path / "ffn0.log")
        _wait_for_command(rank.pid, cmd)  # what `ps`, and the tests' worker_pids(), read
        assert _parent_of(rank.pid) == zygote.proc.pid
        assert os.getpgid(rank.pid) == rank.pid  # its own session: killpg reaches it and its children
        assert rank.poll() is None
        os.killpg(rank.pid, signal.SIGKILL)
        assert rank.wait(30) == -signal.SIGKILL
    finally:
        zygote.close()


@pytest.mark.timeout(120)
def test_a_rank_ends_when_its_zygote_dies_and_its_status_is_unknown(tmp_path: Path) -> None:
    zygote = zygotes.Zygote()
    rank_env = rank_environment(new_secret())
    try:
        cmd = [*_waiting_ffn_rank(), "--launcher-pid", str(os.getpid())]  # the rank asks for a death signal
        rank = zygote.spawn(cmd, rank_env, tmp_path / "ffn0.log")
        _wait_for_command(rank.pid, cmd)
        # whenever it dies: after the rank asked for a parent-death signal, that ends it; before, its check does
        zygote.proc.kill()
        assert rank.wait(30) == 1  # its status went with the zygote
        assert not process_alive(rank.pid)
    finally:
        zygote.close()


@pytest.mark.timeout(120)
def test_one_zygote_serves_every_launch_and_its_ranks_show_the_launchers_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """/proc/PID/environ of a forked rank is its zygote's: this process's environment when the zygote started (the
    tests' tags are found there), never the run's secret. Another environment here gets another zygote."""
    monkeypatch.setenv("AFD_TEST_RANK_MARK", "mark-1")
    first = zygotes.zygote_for_launch()
    assert first is not None and zygotes.zygote_for_launch() is first
    cmd = _waiting_ffn_rank()
    rank = first.spawn(cmd, rank_environment(new_secret()), tmp_path / "ffn0.log")
    try:
        _wait_for_command(rank.pid, cmd)
        shown = Path(f"/proc/{rank.pid}/environ").read_bytes().split(b"\0")
        assert b"AFD_TEST_RANK_MARK=mark-1" in shown  # what finds ranks by environment (the tests' tags) reads
        assert not any(entry.startswith(b"AFD_SECRET=") for entry in shown)
        monkeypatch.setenv("AFD_TEST_RANK_MARK", "mark-2")  # a new environment: a new zygote; the first keeps its rank
        second = zygotes.zygote_for_launch()
        assert second is not first and first.usable() and rank.poll() is None
        os.killpg(rank.pid, signal.SIGKILL)
        assert rank.wait(30) == -signal.SIGKILL
        second.proc.kill()  # a zygote that died is replaced
        second.proc.wait(10)
        third = zygotes.zygote_for_launch()
        assert third is not second and third.usable()
        assert not first.usable()  # retired once its rank ended
    finally:
        zygotes.close_shared()


@pytest.mark.timeout(180)
def test_a_command_leaves_no_zygote_behind_whether_it_runs_or_refuses() -> None:
    """The CLI starts its zygote before it checks its input: a run and a refusal both end it on the way out."""
    launch = [sys.executable, "-m", "afd", "launch", "--connector", "async", "--attention", "1", "--ffn", "1"]
    launch += ["--prompt-ids", "1,2", "--max-new-tokens", "2"]
    ran = subprocess.run([*launch, "--model", MODEL], capture_output=True, text=True, timeout=150)
    assert ran.returncode == 0, ran.stderr[-2000:]
    refused = subprocess.run([*launch, "--model", "no-such-model"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and refused.stderr.startswith("afd: error: ") and refused.stderr.count("\n") == 1
    assert not zygote_pids(), "a zygote outlived its command"
