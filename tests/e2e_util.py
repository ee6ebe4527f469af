"""Shared helpers of the end-to-end tests: a ragged prompt set, the reference comparison, and the
process bookkeeping that lets every test prove it left no rank and no shared-memory segment behind."""

from __future__ import annotations

import functools
import glob
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from afd.engine import Output, generate

MODEL = "tiny"
# Ragged on purpose: long and short prompts, and (with 5 attention replicas) replicas that get nothing.
PROMPTS = [[5, 17, 33, 2, 9, 41, 7, 3, 19, 23, 11], [4, 8], [100, 3, 77, 12, 9, 250], [1]]
MAX_NEW_TOKENS = 5
TOLERANCE = 1e-4


@functools.lru_cache(maxsize=4)
def reference(gate_on_attention: bool = True) -> tuple[Output, ...]:
    return tuple(
        generate(
            MODEL, PROMPTS, max_new_tokens=MAX_NEW_TOKENS, prompt_logprobs=True, gate_on_attention=gate_on_attention
        )
    )


def assert_matches_reference(outputs: list[Output], ref: tuple[Output, ...] | list[Output]) -> None:
    assert len(outputs) == len(ref)
    for got, want in zip(outputs, ref, strict=True):
        assert got.prompt_ids == want.prompt_ids
        assert got.token_ids == want.token_ids, "greedy tokens differ from the reference engine"
        for a, b in zip(got.logprobs, want.logprobs, strict=True):
            assert abs(a - b) <= TOLERANCE
        assert got.prompt_logprobs[0] is None
        for a, b in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:], strict=True):
            assert abs(a - b) <= TOLERANCE


def afd_worker(config: dict, role: str, rank: int, *extra: str, bind_host: str | None = None) -> subprocess.Popen:
    """One `afd worker` rank started by hand, in its own process group."""
    cmd = [sys.executable, "-m", "afd", "worker", "--config", json.dumps(config), "--role", role, "--rank", str(rank)]
    cmd += ["--model", MODEL, *extra] + (["--bind-host", bind_host] if bind_host else [])
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def start_long_launch(port: int, connector: str, max_new_tokens: int = 100_000) -> subprocess.Popen:
    """`afd launch` of 2A2F with a generation long enough to be interrupted."""
    cmd = [sys.executable, "-m", "afd", "launch", "--model", MODEL, "--connector", connector]
    cmd += ["--attention", "2", "--ffn", "2", "--prompt-ids", "1,2,3;4,5", "--port", str(port)]
    cmd += ["--max-new-tokens", str(max_new_tokens), "--max-num-batched-tokens", str(max_new_tokens + 16)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def shm_segments() -> set[str]:
    return set(glob.glob("/dev/shm/afd_*"))


def worker_pids() -> set[int]:
    """Live `afd worker` processes on this machine."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"afd" in cmdline and b"worker" in cmdline:
                pids.add(int(entry.name))
    return pids


def role_of(pid: int) -> str | None:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    for role in ("attention", "ffn"):
        if f"\0--role\0{role}\0".encode() in cmdline:
            return role
    return None


def wait_for_workers(count: int, timeout_s: float = 60) -> set[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = worker_pids()
        if len(pids) >= count:
            return pids
        time.sleep(0.2)
    raise AssertionError(f"only {len(worker_pids())} of {count} workers started within {timeout_s} s")


def wait_gone(pids: set[int], timeout_s: float) -> set[int]:
    deadline = time.monotonic() + timeout_s
    while (pids & worker_pids()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return pids & worker_pids()


def kill_pids(pids: set[int]) -> None:
    for pid in pids & worker_pids():
        try:
            os.killpg(pid, signal.SIGKILL)  # every rank is its own process group (start_new_session)
        except (ProcessLookupError, PermissionError):
            pass


def kill_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


class Leftovers:
    """Snapshot of workers and segments before a run; `check()` asserts the run added none."""

    def __init__(self) -> None:
        self.pids = worker_pids()
        self.segments = shm_segments()

    def new_pids(self) -> set[int]:
        return worker_pids() - self.pids

    def new_segments(self) -> set[str]:
        return shm_segments() - self.segments

    def check(self, timeout_s: float = 10) -> None:
        assert not wait_gone(self.new_pids(), timeout_s), "afd worker processes left behind"
        assert not self.new_segments(), f"shared-memory segments left behind: {sorted(self.new_segments())}"

    def cleanup(self) -> None:
        kill_pids(self.new_pids())
        for path in self.new_segments():
            Path(path).unlink(missing_ok=True)
