"""The AFD world across real processes: the store listens only on its host, and a killed peer, a frozen store host, a
wrong secret or a forged failure record each end or spare the run as they should."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from helpers.e2e import MODEL, Leftovers, afd_worker, hand_config, kill_all

from afd.distributed.store import (
    host_store,
)
from afd.distributed.watchdog import MIN_PEER_SILENCE_S
from afd.engine.generate import generate
from afd.runtime.launch import free_port


class Drained:
    """A process whose stdout and stderr are read by threads (a full pipe never blocks it)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self._threads = [
            threading.Thread(target=self._read, args=(s,), daemon=True) for s in (proc.stdout, proc.stderr)
        ]
        for t in self._threads:
            t.start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.append(line)

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not re.search(pattern, self.text):
            assert self.proc.poll() is None, f"ended before {pattern!r}:\n{self.text[-3000:]}"
            assert time.monotonic() < deadline, f"no {pattern!r} within {timeout_s} s:\n{self.text[-3000:]}"
            time.sleep(0.05)

    def finish(self, timeout_s: float) -> int:
        code = self.proc.wait(timeout_s)
        for t in self._threads:
            t.join(5)
        return code


def other_addresses() -> list[str]:
    """IPv4 addresses of this machine outside 127.0.0.0/8."""
    found: set[str] = set()
    try:
        found.update(socket.gethostbyname_ex(socket.gethostname())[2])
    except OSError:
        pass
    try:
        out = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, timeout=5).stdout
        found.update(re.findall(r"inet (\d+\.\d+\.\d+\.\d+)/", out))
    except (OSError, subprocess.SubprocessError):
        pass
    return sorted(a for a in found if not a.startswith("127."))


# ---------------------------------------------------------------- in process: binding, port, run tag
def test_store_listens_only_on_its_host() -> None:
    addresses = other_addresses()
    if not addresses:
        pytest.skip("this machine has no address outside 127.0.0.0/8")
    port = free_port()
    store = host_store("127.0.0.1", port, 5.0, "s3cret")
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
        for address in addresses:
            with pytest.raises(OSError), socket.create_connection((address, port), timeout=5):
                pass
    finally:
        del store


# ---------------------------------------------------------------- multi-process
RANK_SCRIPT = r"""
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
from afd.distributed.world import init_world
from afd.distributed.store import wait_until
port, rank = int(sys.argv[1]), int(sys.argv[2])
world = init_world("127.0.0.1", port, rank, 3, "gloo", 60.0, num_attention=1, num_ffn=2)
print("joined", flush=True)
# blocked outside any communication op, like nvshmem.init: nothing but the watchdog can end this wait
wait_until(lambda: world.store.check(["never"]), 60.0, "a key nobody writes", poll_s=0.1)
"""


@pytest.mark.timeout(90)
def test_peer_killed_outside_any_op_is_named_by_the_watchdogs() -> None:
    port = free_port()
    ranks: list[Drained] = []
    try:
        for r in range(3):
            cmd = [sys.executable, "-c", RANK_SCRIPT, str(port), str(r)]
            proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
            )
            ranks.append(Drained(proc))
        for rank in ranks:
            rank.wait_for("joined", 60)
        time.sleep(1.0)
        os.kill(ranks[2].proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        for rank in ranks[:2]:
            code = rank.finish(30)
            assert code != 0
            assert "world rank 2 (attention 0) stopped without a word (killed or crashed)" in rank.text, rank.text
        assert time.monotonic() - killed < MIN_PEER_SILENCE_S + 10
    finally:
        kill_all([r.proc for r in ranks])


@pytest.mark.timeout(180)
def test_frozen_store_host_ends_every_other_rank_naming_it() -> None:
    """SIGSTOP on FFN rank 0 (the p2p store host) mid-run: a store op against it never returns, yet
    every other rank ends within the bound, naming it."""
    port = free_port()
    config = hand_config("p2p", 2, 1, port=port, timeout_s=5)
    leftovers = Leftovers()
    host = Drained(afd_worker(config, "ffn", 0))
    attention = [
        Drained(
            afd_worker(
                config,
                "attention",
                a,
                "--prompt-ids",
                "1,2,3",
                "--max-new-tokens",
                "4000",
                "--max-num-batched-tokens",
                "4016",
            )
        )
        for a in range(2)
    ]
    try:
        for rank in [host, *attention]:
            rank.wait_for("joined a world", 90)
        for rank in attention:
            rank.wait_for("attention model loaded", 90)
        time.sleep(2.0)
        assert all(r.proc.poll() is None for r in [host, *attention]), "the run ended before the freeze"
        os.kill(host.proc.pid, signal.SIGSTOP)
        frozen = time.monotonic()
        for rank in attention:
            code = rank.finish(40)
            assert code != 0
            assert "world rank 0 (ffn 0), the store host at 127.0.0.1:" in rank.text, rank.text[-3000:]
        assert time.monotonic() - frozen < 25
    finally:
        if host.proc.poll() is None:
            os.killpg(host.proc.pid, signal.SIGKILL)
            os.killpg(host.proc.pid, signal.SIGCONT)
        kill_all([r.proc for r in [host, *attention]])
        leftovers.cleanup()


@pytest.mark.timeout(240)
def test_wrong_secret_and_forged_failure_cannot_stop_a_run(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """A rank with another AFD_SECRET is refused in one sentence, and a failure record written into the
    run's namespace without the secret is ignored: the run finishes and matches the reference."""
    port, new_tokens = free_port(), 200
    config = hand_config("p2p", 1, 1, port=port, timeout_s=30)
    prompts = [[1, 2, 3], [4, 5]]
    leftovers = Leftovers()
    monkeypatch.setenv("AFD_SECRET", "right")
    ffn = Drained(afd_worker(config, "ffn", 0))
    out = tmp_path / "attn0.json"
    attn = Drained(
        afd_worker(
            config,
            "attention",
            0,
            "--prompt-ids",
            "1,2,3;4,5",
            "--max-new-tokens",
            str(new_tokens),
            "--output",
            str(out),
        )
    )
    intruder = None
    try:
        attn.wait_for("joined a world", 90)
        monkeypatch.setenv("AFD_SECRET", "wrong")
        intruder = Drained(afd_worker(config, "attention", 0, "--prompt-ids", "7"))
        # an attacker who can reach the port finds the namespace (TCPStore lists its keys) and forges a failure
        client = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=10), wait_for_workers=False)
        arrival = next(k for k in client.list_keys() if k.endswith("arrived/0"))
        namespace = arrival[: -len("arrived/0")]
        client.add(namespace + "failures", 1)
        client.set(namespace + "first_failure", "forged")  # a plain key, as an unsigned record would be
        client.set(namespace + "failed/0", json.dumps({"body": json.dumps({"seq": 0, "msg": "forged"}), "mac": "0"}))
        assert attn.proc.poll() is None, "the run ended before the forged failure was written"
        assert intruder.finish(60) == 2, f"a rank refused at rendezvous exits 2:\n{intruder.text[-3000:]}"
        assert "belongs to another run: its ranks use a different AFD_SECRET" in intruder.text, intruder.text
        assert "Traceback" not in intruder.text
        for rank in (ffn, attn):
            assert rank.finish(120) == 0, rank.text[-3000:]
        got = json.loads(out.read_text())["outputs"]
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # other tests' ranks share the cores: oversubscribed threads are much slower
        try:
            want = generate(MODEL, prompts, max_new_tokens=new_tokens)
        finally:
            torch.set_num_threads(threads)
        assert [o["token_ids"] for o in got] == [o.token_ids for o in want]
        leftovers.check()
    finally:
        kill_all([r.proc for r in (ffn, attn, intruder) if r is not None])
        leftovers.cleanup()
