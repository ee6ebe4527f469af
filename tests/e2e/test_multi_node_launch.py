"""`afd launch --nnodes 2` as two "nodes" on 127.0.0.1: two terminals' worth of processes, over the real transports.

Each test starts both node commands as a user would (the same command but `--node-rank`, one AFD_SECRET), orders
them by what they log rather than by sleeping, bounds every wait, and kills whatever is left on the way out.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.e2e import (
    MAX_NEW_TOKENS,
    MODEL,
    PROMPTS,
    Leftovers,
    assert_matches_reference,
    kill_all,
    reference,
    role_of,
    wait_for_workers,
)

from afd.engine.engine import Output
from afd.env import SECRET_VAR
from afd.runtime.launch import free_port

PROMPT_IDS = ";".join(",".join(map(str, p)) for p in PROMPTS)


def node_command(port: int, connector: str, node_rank: int, *extra: str) -> list[str]:
    cmd = [sys.executable, "-m", "afd", "-v", "launch", "--model", MODEL, "--connector", connector]
    cmd += ["--attention", "2", "--ffn", "2", "--prompt-ids", PROMPT_IDS, "--max-new-tokens", str(MAX_NEW_TOKENS)]
    cmd += ["--prompt-logprobs", "--json", "--nnodes", "2", "--nproc-per-node", "2"]
    cmd += ["--master-addr", "127.0.0.1", "--master-port", str(port), "--node-rank", str(node_rank), *extra]
    return cmd


def start_node(cmd: list[str], log: Path, secret: str) -> subprocess.Popen:
    with open(log, "w") as err:
        return subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            start_new_session=True,
            env={**os.environ, SECRET_VAR: secret},
        )


def wait_for_line(log: Path, text: str, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    """Until the node's log shows `text` (it reached that point), failing at once if the node ended first."""
    deadline = time.monotonic() + timeout_s
    while text not in log.read_text(errors="replace"):
        assert proc.poll() is None, f"the node ended before logging {text!r}: {log.read_text()[-2000:]}"
        assert time.monotonic() < deadline, f"the node did not log {text!r} within {timeout_s} s"
        time.sleep(0.05)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("connector, first", [("p2p", 0), ("async", 1)])
def test_two_nodes_equal_the_reference(connector: str, first: int, tmp_path: Path) -> None:
    """Node 0 prints the run's --json (outputs of both nodes' attention ranks); node 1 prints nothing and exits 0.
    `first`: which node is started first; the other starts once the first is waiting for it."""
    port, secret = free_port(), os.urandom(16).hex()
    logs = [tmp_path / "node0.err", tmp_path / "node1.err"]
    leftovers = Leftovers()
    procs: dict[int, subprocess.Popen] = {}
    try:
        procs[first] = start_node(node_command(port, connector, first), logs[first], secret)
        waiting = "joined; waiting for the other nodes" if first == 0 else "waiting for node 0's world store"
        wait_for_line(logs[first], waiting, procs[first])
        procs[1 - first] = start_node(node_command(port, connector, 1 - first), logs[1 - first], secret)
        out0, _ = procs[0].communicate(timeout=180)
        out1, _ = procs[1].communicate(timeout=60)
        assert procs[0].returncode == 0, logs[0].read_text()[-3000:]
        assert procs[1].returncode == 0, logs[1].read_text()[-3000:]
        assert out1 == ""
        data = json.loads(out0)
        assert list(data) == ["outputs"]
        assert_matches_reference([Output(**o) for o in data["outputs"]], reference())
        leftovers.check()
    finally:
        kill_all(list(procs.values()))
        leftovers.cleanup()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("present", [0, 1])
def test_a_node_that_never_comes_is_named(present: int, tmp_path: Path) -> None:
    """Only one node is started: it names the other within the world timeout, exits 1 and leaves nothing behind."""
    port, log = free_port(), tmp_path / "node.err"
    config = json.dumps({"connector_extra_config": {"timeout_s": 2}})
    leftovers = Leftovers()
    proc = start_node(node_command(port, "p2p", present, "--config", config), log, os.urandom(16).hex())
    try:
        out, _ = proc.communicate(timeout=90)
        error = log.read_text().strip().splitlines()[-1]
        assert proc.returncode == 1 and out == ""
        if present == 0:
            assert error.startswith("afd: error: node 1 (world ranks 2-3) did not come within 2 s")
        else:
            assert error.startswith("afd: error: node 0, the world store's host at 127.0.0.1:")
            assert "did not come within 2 s" in error
        assert "Traceback" not in log.read_text()
        leftovers.check()
    finally:
        kill_all([proc])
        leftovers.cleanup()


def attention_log(pids: set[int]) -> Path:
    """The log of an attention rank among `pids`: beside its outputs file, in its node's run directory."""
    for pid in pids:
        if role_of(pid) == "attention":
            words = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().split()
            return Path(words[words.index("--output") + 1]).parent / "attention0.log"
    raise AssertionError("no attention rank among the workers")


@pytest.mark.timeout(180)
def test_a_node_killed_mid_run_ends_the_run_everywhere(tmp_path: Path) -> None:
    """`kill -9` of node 1's afd launch once the world is formed: its ranks go with it, node 0 exits 1 naming a
    rank of node 1, and no rank of either node is left."""
    port, secret = free_port(), os.urandom(16).hex()
    config = json.dumps({"connector_extra_config": {"timeout_s": 60}})
    long_run = ["--config", config, "--max-new-tokens", "4000", "--max-num-batched-tokens", "4100"]
    logs = [tmp_path / "node0.err", tmp_path / "node1.err"]
    leftovers = Leftovers()
    procs = [start_node(node_command(port, "p2p", k, *long_run), logs[k], secret) for k in (0, 1)]
    try:
        log = attention_log(wait_for_workers(4))  # p2p 2A2F: node 1 hosts the attention ranks
        deadline = time.monotonic() + 120
        while not (log.exists() and "joined a world of 4 ranks" in log.read_text(errors="replace")):
            assert all(p.poll() is None for p in procs), "a node ended before the world was formed"
            assert time.monotonic() < deadline, "the world did not form within 120 s"
            time.sleep(0.05)
        os.kill(procs[1].pid, signal.SIGKILL)
        procs[1].wait(10)
        out, _ = procs[0].communicate(timeout=120)
        error = logs[0].read_text().strip().splitlines()[-1]
        assert procs[0].returncode == 1 and out == ""
        assert error.startswith("afd: error: ") and "attention" in error, error
        leftovers.check(timeout_s=30)
    finally:
        kill_all(procs)
        leftovers.cleanup()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "extra, secret, message",
    [
        (["--node-rank", "2"], "s", "--node-rank 2 is out of range for --nnodes 2 (0 to 1)"),
        (["--nproc-per-node", "3"], "s", "--nproc-per-node 3 x --nnodes 2 is 6 ranks, but the world has 4"),
        (["--master-port", "0"], "s", "expected a port (1-65535)"),
        ([], "", "--nnodes 2 needs AFD_SECRET in the environment"),
        (["--port", "7000", "--master-port", "7001"], "s", "--port and --master-port both name"),
    ],
)
def test_bad_node_flags_are_one_sentence_and_exit_2(extra: list[str], secret: str, message: str) -> None:
    cmd = [sys.executable, "-m", "afd", "launch", "--model", MODEL, "--connector", "p2p", "--attention", "2"]
    cmd += ["--ffn", "2", "--prompt-ids", "1,2", "--nnodes", "2", "--node-rank", "1", "--master-port", "7001", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env={**os.environ, SECRET_VAR: secret})
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert proc.stdout == ""
