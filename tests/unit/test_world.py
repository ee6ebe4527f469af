"""The AFD world (afd.distributed.world): the store binds only its host, ranks prove they belong to the run,
records that do not verify are never trusted, and every wait stays bounded when a peer or the store
host dies or freezes, even while no communication op is in flight.

Unit tests run in this process; the multi-process ones start real ranks (`afd worker`, or a few lines
around `init_world`), bound every wait and kill their own processes on the way out.
"""

from __future__ import annotations

import json
import socket
import time

import pytest
import torch.distributed as dist

from afd.distributed.store import (
    RUN_TAG_KEY,
    ForeignRunError,
    PortInUseError,
    RunKeys,
    connect_store,
    host_store,
    publish_failure,
    read_first_failure,
)
from afd.distributed.watchdog import MIN_PEER_SILENCE_S, peer_silence_bound
from afd.distributed.world import init_world
from afd.runtime.launch import free_port


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


def test_port_in_use_is_one_sentence() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(PortInUseError, match=rf"^port {port} on 127.0.0.1 is already in use .*free one$"):
            host_store("127.0.0.1", port, 5.0, "s3cret")


@pytest.mark.timeout(30)
def test_a_client_started_before_the_store_joins_within_a_poll_and_keeps_its_timeout() -> None:
    """A client waiting for a store that starts 0.5 s later is connected within 1 s of it, room for a loaded host's
    stalls (torch's own client backs off and came ~1.6 s late); with nothing listening it gives up at its timeout,
    not twice it."""
    import threading

    port = free_port()
    joined: dict[str, float] = {}

    def client() -> None:
        joined["store"] = connect_store("127.0.0.1", port, 10.0)  # type: ignore[assignment]
        joined["at"] = time.monotonic()

    waiter = threading.Thread(target=client)
    waiter.start()
    time.sleep(0.5)
    started = time.monotonic()
    server = host_store("127.0.0.1", port, 5.0, secret="s")
    waiter.join(timeout=10)
    assert "at" in joined and joined["at"] - started < 1.0
    assert joined["store"].get(RUN_TAG_KEY) == RunKeys.from_secret("s").tag.encode()
    del server

    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="the store at"):
        connect_store("127.0.0.1", free_port(), 0.5)
    assert time.monotonic() - t0 < 1.5


def test_rank_with_another_secret_is_refused_at_once() -> None:
    port = free_port()
    store = host_store("127.0.0.1", port, 5.0, "right")
    try:
        assert store.get(RUN_TAG_KEY).decode() == RunKeys.from_secret("right").tag
        start = time.monotonic()
        with pytest.raises(ForeignRunError, match="belongs to another run: its ranks use a different AFD_SECRET"):
            init_world(
                "127.0.0.1", port, 1, 2, timeout=600.0, num_attention=1, num_ffn=1, secret="wrong", store_external=True
            )
        assert time.monotonic() - start < 300  # at once: long before the bound on the wait (600 s)
    finally:
        del store
