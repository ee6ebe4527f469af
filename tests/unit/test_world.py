"""The AFD world (afd.distributed.world): the store binds only its host, ranks prove they belong to the run,
records that do not verify are never trusted, and every wait stays bounded when a peer or the store
host dies or freezes, even while no communication op is in flight.

Unit tests run in this process; the multi-process ones start real ranks (`afd worker`, or a few lines
around `init_world`), bound every wait and kill their own processes on the way out.
"""

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
    RUN_TAG_KEY,
    ForeignRunError,
    PortInUseError,
    RunKeys,
    host_store,
    publish_failure,
    read_first_failure,
)
from afd.distributed.watchdog import MIN_PEER_SILENCE_S, peer_silence_bound
from afd.distributed.world import init_world
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


# ---------------------------------------------------------------- unit: the run's keys and records
def test_run_keys_are_independent_and_secret_dependent() -> None:
    a, b = RunKeys.from_secret("s3cret"), RunKeys.from_secret("other")
    assert a == RunKeys.from_secret("s3cret")
    assert a.namespace != b.namespace and a.tag != b.tag
    assert a.tag not in a.namespace and "s3cret" not in a.namespace + a.tag


def test_signed_records_verify_and_forgeries_do_not() -> None:
    keys = RunKeys.from_secret("s3cret")
    raw = keys.sign("failed/1", "boom")
    assert keys.verify("failed/1", raw) == "boom"
    assert keys.verify("failed/2", raw) is None  # a record moved to another key
    assert RunKeys.from_secret("other").verify("failed/1", raw) is None
    tampered = json.dumps({**json.loads(raw), "body": "bang"})
    assert keys.verify("failed/1", tampered) is None
    assert keys.verify("failed/1", b"not json") is None


def test_unverified_failure_records_are_never_trusted() -> None:
    keys, store = RunKeys.from_secret("s3cret"), dist.HashStore()
    store.add("failures", 1)
    store.set("failed/0", json.dumps({"body": json.dumps({"seq": 1, "msg": "stop"}), "mac": "0" * 64}))
    assert read_first_failure(store, keys, 3) is None
    publish_failure(store, keys, 2, "world rank 2 (ffn 0) failed: real")
    publish_failure(store, keys, 1, "world rank 1 (ffn 1): a later one")
    assert read_first_failure(store, keys, 3) == "world rank 2 (ffn 0) failed: real"


def test_peer_silence_bound() -> None:
    assert peer_silence_bound(120.0, 0.25) == MIN_PEER_SILENCE_S  # starved-but-alive ranks on 2 cores
    assert peer_silence_bound(3.0, 0.25) == 3.0  # never longer than the bound on every wait
    assert peer_silence_bound(120.0, 1.0) == 32.0


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


def test_port_in_use_is_one_sentence() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(PortInUseError, match=rf"^port {port} on 127.0.0.1 is already in use .*free one$"):
            host_store("127.0.0.1", port, 5.0, "s3cret")


def test_rank_with_another_secret_is_refused_at_once() -> None:
    port = free_port()
    store = host_store("127.0.0.1", port, 5.0, "right")
    try:
        assert store.get(RUN_TAG_KEY).decode() == RunKeys.from_secret("right").tag
        start = time.monotonic()
        with pytest.raises(ForeignRunError, match="belongs to another run: its ranks use a different AFD_SECRET"):
            init_world(
                "127.0.0.1", port, 1, 2, timeout=30.0, num_attention=1, num_ffn=1, secret="wrong", store_external=True
            )
        assert time.monotonic() - start < 5
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
        client.set(namespace + "first_failure", "forged")  # where afd before issue 9 looked
        client.set(namespace + "failed/0", json.dumps({"body": json.dumps({"seq": 0, "msg": "forged"}), "mac": "0"}))
        assert attn.proc.poll() is None, "the run ended before the forged failure was written"
        assert intruder.finish(60) == 2, "a rank refused at rendezvous exits 2"
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
