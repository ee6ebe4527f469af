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
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from afd.engine.engine import Output
from afd.engine.generate import generate

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


TEST_TAG_VAR = "AFD_TEST_TAG"  # set per test by conftest; every process a test starts inherits it


def test_tag() -> str:
    return os.environ.get(TEST_TAG_VAR, "untagged")


def hand_config(connector: str, num_attention: int, num_ffn: int, *, port: int, **extra_config: object) -> dict:
    """The AFD config of a run whose ranks a test starts by hand (`connector_extra_config` from the keywords)."""
    return {
        "connector": connector,
        "port": port,
        "num_attention_ranks": num_attention,
        "num_ffn_ranks": num_ffn,
        "connector_extra_config": extra_config,
    }


def launch_checked(
    connector: str,
    num_attention: int,
    num_ffn: int,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    max_num_batched_tokens: int,
    run_dir: Path | None = None,
    max_num_seqs: int | None = None,
    **extra_config: object,
) -> tuple[list[Output], dict]:
    """`afd launch` of tiny fp32 with prompt logprobs, asserting it left no worker and no segment behind."""
    from afd.config import parse_config
    from afd.model.kv_cache import CacheOptions
    from afd.runtime.launch import free_port, launch
    from afd.runtime.spec import RunSpec

    config = parse_config(hand_config(connector, num_attention, num_ffn, port=free_port(), **extra_config))
    spec = RunSpec(
        model=MODEL,
        dtype="float32",
        max_new_tokens=max_new_tokens,
        prompt_logprobs=True,
        max_num_batched_tokens=max_num_batched_tokens,
        timeout_s=90,
        cache=CacheOptions() if max_num_seqs is None else CacheOptions(max_num_seqs=max_num_seqs),
    )
    leftovers = Leftovers()
    try:
        outputs, stats = launch(config, spec, prompts, run_dir=run_dir)
        leftovers.check()
    finally:
        leftovers.cleanup()
    return outputs, stats


def afd_worker(config: dict, role: str, rank: int, *extra: str, bind_host: str | None = None) -> subprocess.Popen:
    """One `afd worker` rank started by hand, in its own process group.

    Its shared-memory run token is derived from this test's tag and the run's port, so the test can find
    (and clean up) exactly its own segments; pass `--run-token` in `extra` to choose another."""
    cmd = [sys.executable, "-m", "afd", "worker", "--config", json.dumps(config), "--role", role, "--rank", str(rank)]
    cmd += ["--model", MODEL, *extra] + (["--bind-host", bind_host] if bind_host else [])
    if "--run-token" not in extra:
        cmd += ["--run-token", f"{test_tag()}p{config.get('port', 0)}"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def start_long_launch(port: int, connector: str, max_new_tokens: int = 4000) -> subprocess.Popen:
    """`afd launch` of 2A2F with a generation long enough to be interrupted (within tiny's 4096 positions)."""
    cmd = [sys.executable, "-m", "afd", "launch", "--model", MODEL, "--connector", connector]
    cmd += ["--attention", "2", "--ffn", "2", "--prompt-ids", "1,2,3;4,5", "--port", str(port)]
    cmd += ["--max-new-tokens", str(max_new_tokens), "--max-num-batched-tokens", str(max_new_tokens + 16)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


# ---------------------------------------------------------------- this test's processes and segments
# Everything below is scoped to the current test: processes by the AFD_TEST_TAG in their environment,
# shared-memory segments by the run tokens of those processes. Another afd run on the same machine (a
# service, another test session) is never looked at, waited for or killed.

_TOKENS_SEEN: set[str] = set()  # run tokens of this session's tagged workers, recorded while they were alive


def _tagged(pid: int, tag: str) -> bool:
    try:
        return f"{TEST_TAG_VAR}={tag}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


def _cmdline(pid: int) -> list[bytes]:
    """The words of the process's command line: its arguments, or a forked rank's title (one string, spaces
    between its words: `afd.runtime.zygote.set_title`)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").split()
    except OSError:
        return []


def worker_pids() -> set[int]:
    """Live `afd worker` processes started (directly or through `afd launch`) by the current test."""
    tag, pids = test_tag(), set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        cmdline = _cmdline(int(entry.name))
        if b"afd" in cmdline and b"worker" in cmdline and _tagged(int(entry.name), tag):
            pids.add(int(entry.name))
            if b"--run-token" in cmdline:
                i = cmdline.index(b"--run-token")
                if i + 1 < len(cmdline):
                    _TOKENS_SEEN.add(cmdline[i + 1].decode())
    return pids


def zygote_pids() -> set[int]:
    """Live zygotes (`afd.runtime.zygote`) started by the current test's processes: they carry its tag too."""
    tag = test_tag()
    return {
        int(entry.name)
        for entry in Path("/proc").iterdir()
        if entry.name.isdigit() and b"afd.cli.zygote" in _cmdline(int(entry.name)) and _tagged(int(entry.name), tag)
    }


def role_of(pid: int) -> str | None:
    cmdline = b"\0".join(_cmdline(pid))
    for role in ("attention", "ffn"):
        if f"\0--role\0{role}\0".encode() in cmdline:
            return role
    return None


def mapped_windows(pid: int) -> set[str]:
    """The afd shared-memory windows process `pid` has mapped (also after they were unlinked)."""
    try:
        lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    except OSError:
        return set()
    return {ln.split("/dev/shm/", 1)[1].split()[0] for ln in lines if "/dev/shm/afd_" in ln}


def wait_until_mapped(pids: set[int], num_windows: int, procs: list[subprocess.Popen], timeout_s: float = 60) -> None:
    """Until every pid has mapped `num_windows` windows (the whole async world is past its init)."""
    deadline = time.monotonic() + timeout_s
    while not all(len(mapped_windows(p)) >= num_windows for p in pids):
        for proc in procs:
            assert proc.poll() is None, f"a process ended during init: {proc.communicate()[1][-2000:]}"
        assert time.monotonic() < deadline, f"the async world did not map its {num_windows} windows in {timeout_s} s"
        time.sleep(0.1)


def rank_log(pid: int) -> Path | None:
    """The file a rank logs to: its stderr, which a launcher's rank has as its log in the run directory. None for a
    rank whose stderr is not a file (a pipe, say) or that is gone."""
    try:
        target = os.readlink(f"/proc/{pid}/fd/2")
    except OSError:
        return None
    return Path(target) if target.startswith("/") else None


P2P_WARMED_UP = "warmed up the p2p exchange"  # an attention rank's line once its whole world has run a step


def wait_until_logged(pids: set[int], text: str, procs: list[subprocess.Popen], timeout_s: float = 60) -> None:
    """Until the log of every rank in `pids` shows `text` (those ranks got that far), failing at once if one of
    `procs` ended first."""
    deadline = time.monotonic() + timeout_s

    def logged(pid: int) -> bool:
        log = rank_log(pid)
        return log is not None and text in log.read_text(errors="replace")

    while not all(logged(p) for p in pids):
        for proc in procs:
            assert proc.poll() is None, f"a process ended before its ranks logged {text!r}"
        assert time.monotonic() < deadline, f"the ranks did not log {text!r} within {timeout_s} s"
        time.sleep(0.05)


def shm_segments() -> set[str]:
    """Shared-memory segments of the current test's runs (hand-started tokens and every token seen)."""
    worker_pids()  # record the tokens of the workers alive now
    tokens = _TOKENS_SEEN | {test_tag()}
    return {p for p in glob.glob("/dev/shm/afd_*") if any(f"afd_{t}" in p for t in tokens)}


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
    """Watches the current test's workers while it runs (a thread records their run tokens); `check()`
    asserts the test's runs left no worker and no segment, `cleanup()` removes only those."""

    def __init__(self) -> None:
        self.pids = worker_pids()
        self.segments = shm_segments()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.1):
            worker_pids()

    def new_pids(self) -> set[int]:
        return worker_pids() - self.pids

    def new_segments(self) -> set[str]:
        return shm_segments() - self.segments

    def check(self, timeout_s: float = 10) -> None:
        assert not wait_gone(self.new_pids(), timeout_s), "afd worker processes left behind"
        assert not self.new_segments(), f"shared-memory segments left behind: {sorted(self.new_segments())}"

    def cleanup(self) -> None:
        self._stop.set()
        self._thread.join(2)
        kill_pids(self.new_pids())
        for path in self.new_segments():
            Path(path).unlink(missing_ok=True)


@contextmanager
def module_env_dir(tmp_path: Path, variable: str) -> Iterator[Path]:
    """`tmp_path` as the environment variable `variable` for every launch of a test module (the launched ranks inherit
    it): one directory for the module, so the environment, and with it the launcher's zygote, stays the same from
    test to test. Each test empties it first (`emptied`)."""
    import pytest

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(variable, str(tmp_path))
        yield tmp_path


def emptied(path: Path) -> Path:
    """`path` with its files removed: what a test's launch writes there is then all there is."""
    for old in path.iterdir():
        old.unlink()
    return path
