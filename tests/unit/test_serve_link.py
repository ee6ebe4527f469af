"""The front end's framing of link messages (byte for byte what `multiprocessing.connection` reads and writes)
and `FrameSender`, which never blocks its caller on a replica that is not reading."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection

import pytest

from afd.engine.sampling import SamplingParams
from afd.runtime.link import (
    LINGER_MAX_S,
    FrameSender,
    FrontLink,
    LinkError,
    ReplicaLink,
    decode_frames,
    encode_frame,
    format_address,
    parse_address,
)
from afd.serve.frontend import Event, ReplicaPool

MESSAGES = [
    {"type": "add", "rid": "cmpl-1", "prompt_ids": list(range(300)), "max_tokens": 8},
    {"type": "tokens", "items": [["cmpl-1", 7, -0.25]], "engine_stamps": {"cmpl-1": [1.5, 1.512]}},
    {"type": "abort", "rid": "cmpl-1"},
]


def test_frames_decode_whole_messages_and_keep_partial_ones():
    stream = b"".join(encode_frame(m) for m in MESSAGES)
    buffer, got = bytearray(), []
    for i in range(0, len(stream), 7):  # bytes arrive in small pieces
        buffer += stream[i : i + 7]
        got += decode_frames(buffer)
    assert got == MESSAGES and buffer == bytearray()
    partial = bytearray(encode_frame(MESSAGES[0])[:-1])
    assert decode_frames(partial) == [] and len(partial) == len(encode_frame(MESSAGES[0])) - 1


def read_messages(sock: socket.socket, count: int) -> list:
    buffer, got = bytearray(), []
    while len(got) < count:
        buffer += sock.recv(1 << 20)
        got += decode_frames(buffer)
    return got


@contextlib.contextmanager
def sender_and_reader(on_broken) -> Iterator[tuple[FrameSender, socket.socket]]:
    """A `FrameSender` on a non-blocking socket, as the front end has it, and the replica's end."""
    front, replica = socket.socketpair()
    front.setblocking(False)
    sender = FrameSender(front, on_broken, "test-link-send")
    try:
        yield sender, replica
    finally:
        sender.close()
        front.close()
        replica.close()


def test_frames_are_what_multiprocessing_connection_speaks():
    ours, theirs = socket.socketpair()
    conn = Connection(theirs.detach())
    try:
        for m in MESSAGES:
            ours.sendall(encode_frame(m))
            assert conn.recv() == m  # a replica reads what the front end frames
            conn.send(m)
        assert read_messages(ours, len(MESSAGES)) == MESSAGES  # and the front end reads what a replica sends
    finally:
        conn.close()
        ours.close()


@pytest.mark.timeout(30)
def test_sender_never_blocks_on_a_busy_reader_and_keeps_the_order():
    broken = threading.Event()
    big = [{"type": "add", "rid": f"r{i}", "prompt_ids": list(range(200_000))} for i in range(4)]
    small = {"type": "abort", "rid": "r0"}
    with sender_and_reader(broken.set) as (sender, replica):
        for m in big:  # ~4 MB: far beyond what the socket holds while nobody reads
            assert sender.send(encode_frame(m))
        assert sender.send(encode_frame(small))
        # the caller (the event loop) was never held up: a blocked send would wait for the reader below forever
        assert not broken.is_set()
        replica.settimeout(10)
        assert read_messages(replica, len(big) + 1) == [*big, small] and not broken.is_set()


class CountingSocket(socket.socket):
    """A socket that counts its `send` calls."""

    sends = 0

    def send(self, data, *flags):
        self.sends += 1
        return super().send(data, *flags)


@pytest.mark.timeout(30)
def test_a_backlog_crosses_in_a_few_writes_not_one_per_frame():
    """A burst of 2,000 small frames queued behind a full socket (a thousand requests' `add`s while the replica
    steps) is written a backlog at a time: far fewer sends than frames, every frame once, in order."""
    front, replica = socket.socketpair()
    counting = CountingSocket(fileno=front.detach())
    counting.setblocking(False)
    sender = FrameSender(counting, lambda: None, "test-link-send")
    try:
        filler = {"type": "add", "rid": "big", "prompt_ids": list(range(200_000))}  # more than the socket holds
        burst = [{"type": "add", "rid": f"r{i}", "prompt_ids": list(range(100))} for i in range(2000)]
        for m in [filler, *burst]:
            assert sender.send(encode_frame(m))
        replica.settimeout(10)
        assert read_messages(replica, 1 + len(burst)) == [filler, *burst]
        assert counting.sends < len(burst) // 10, counting.sends
    finally:
        sender.close()
        counting.close()
        replica.close()


@pytest.mark.timeout(30)
def test_sender_reports_a_closed_peer_once():
    calls = []
    with sender_and_reader(lambda: calls.append(1)) as (sender, replica):
        replica.close()
        deadline = time.monotonic() + 10
        while sender.send(encode_frame(MESSAGES[0])) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sender.broken and calls == [1]
        assert not sender.send(encode_frame(MESSAGES[1]))  # nothing more is taken


@contextlib.contextmanager
def one_replica(address=None) -> Iterator[tuple[FrontLink, ReplicaLink]]:
    """A front end's listener (at `address`, default: an abstract Unix socket) with one replica connected."""
    front = FrontLink(b"key", address)
    replicas: list[ReplicaLink] = []
    connect = threading.Thread(target=lambda: replicas.append(ReplicaLink(front.address, b"key", {"replica": 0})))
    connect.start()
    try:
        front.accept(1, timeout_s=10)
        connect.join(10)
        yield front, replicas[0]
    finally:
        for replica in replicas:
            replica.close()
        front.close()


@pytest.mark.timeout(30)
def test_both_ends_of_a_link_send_without_nagle():
    """A replica's several small messages per step must not wait for delayed ACKs (~40 ms each with Nagle's
    algorithm on): both ends of the link set TCP_NODELAY, and messages still arrive whole and in order."""
    with one_replica(("127.0.0.1", 0)) as (front, replica):
        for conn in (front.conns[0], replica._conn):
            sock = socket.socket(fileno=conn.fileno())
            try:
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
            finally:
                sock.detach()
        for msg in MESSAGES:
            replica.send(msg)
        assert [front.conns[0].recv() for _ in MESSAGES] == MESSAGES


@pytest.mark.timeout(30)
def test_a_local_link_is_an_abstract_unix_socket_that_leaves_no_file(tmp_path) -> None:
    """`afd serve`'s default: a Unix socket in Linux's abstract namespace (its hop is shorter than loopback TCP's),
    keyed like any link; a wrong key is refused, and closing leaves nothing to clean up."""
    front = FrontLink(b"key")
    assert isinstance(front.address, str) and front.address.startswith("\0")
    assert parse_address(format_address(front.address)) == front.address  # through `--serve-address @NAME`
    replicas: list[ReplicaLink] = []
    refused: list[LinkError] = []

    def connect_both() -> None:
        try:
            ReplicaLink(front.address, b"wrong", {"replica": 0})
        except LinkError as exc:  # refused by the key's challenge, and the front end keeps accepting
            refused.append(exc)
        replicas.append(ReplicaLink(front.address, b"key", {"replica": 0}))

    connect = threading.Thread(target=connect_both)
    connect.start()
    try:
        front.accept(1, timeout_s=10)
        connect.join(10)
        assert len(refused) == 1 and "digest" in str(refused[0]).lower() and len(front.conns) == 1
        for msg in MESSAGES:
            replicas[0].send(msg)
        assert [front.conns[0].recv() for _ in MESSAGES] == MESSAGES
        front.conns[0].send({"type": "shutdown"})
        assert replicas[0].poll(5.0) == [{"type": "shutdown"}]
    finally:
        for replica in replicas:
            replica.close()
        front.close()
    with pytest.raises(LinkError, match="cannot reach the front end at @afd-link-"):
        ReplicaLink(front.address, b"key", {"replica": 0})


def test_link_addresses_read_and_write_as_the_flag_takes_them() -> None:
    for address, text in [
        (("127.0.0.1", 8000), "127.0.0.1:8000"),
        (("::1", 9), "[::1]:9"),
        ("/run/afd/link.sock", "/run/afd/link.sock"),
        ("\0afd-link-1f", "@afd-link-1f"),
    ]:
        assert format_address(address) == text and parse_address(text) == address
    for bad in ["localhost", "host:0", "host:70000", ":80", "@", "relative/path.sock"]:
        with pytest.raises(ValueError, match="HOST:PORT with a port between 1 and 65535, a socket path or @NAME"):
            parse_address(bad)


@pytest.mark.timeout(30)
def test_a_replica_drains_every_waiting_message_and_hears_the_front_end_leave() -> None:
    """`ReplicaLink.poll`: nothing waiting returns [] after (not before) its timeout; everything waiting comes in
    one call, in order; a front end that closed its end is a LinkError at the next poll, not a hang."""
    with one_replica() as (front, replica):
        start = time.monotonic()
        assert replica.poll(0.05) == []
        assert time.monotonic() - start >= 0.05
        for msg in MESSAGES:
            front.conns[0].send(msg)
        assert replica.poll(5.0) == MESSAGES
        assert replica.poll(0.0) == []
        front.conns[0].close()
        with pytest.raises(LinkError, match="closed its link"):
            replica.poll(5.0)


@pytest.mark.timeout(30)
def test_a_lingering_poll_reads_a_burst_larger_than_the_socket(monkeypatch) -> None:
    """Hundreds of long prompts sent at once (~2.5 MB, some 35 socketfuls) by another process, as the front end
    is: a lingering `poll` of the replica goes on reading while the sender refills the socket (without lingering
    it took one socketful per engine step), in order. The linger's bounds are the test's, wide enough that a
    loaded host's stalls do not end it (with afd's 1 ms and `LINGER_MAX_S` such a host took 5-11 polls, and 11-53
    without lingering): what is checked is that the poll keeps reading, not how fast. Nothing sent, `poll(0, 1)`
    returns at once."""
    import multiprocessing

    from afd.runtime import link

    adds = [{"type": "add", "rid": f"r{i}", "prompt_ids": list(range(100_000, 101_024))} for i in range(500)]
    with one_replica() as (front, replica):
        conn = front.conns[0]
        sender = multiprocessing.get_context("fork").Process(target=lambda: [conn.send(m) for m in adds], daemon=True)
        monkeypatch.setattr(link, "LINGER_MAX_S", 10.0)
        sender.start()
        try:
            got, polls = [], 0
            while len(got) < len(adds) and polls < 100:
                got += replica.poll(5.0, 200)
                polls += 1
            in_order = got == adds  # compared apart: pytest's diff of two 500-prompt lists outlasts the timeout
            assert in_order and polls <= 3, (len(got), polls)
        finally:
            sender.join(10)
        monkeypatch.undo()
        start = time.monotonic()  # fifty empty polls: one linger each would take a second, a slow host's stalls not
        assert all(replica.poll(0.0, 1) == [] for _ in range(50)) and time.monotonic() - start < 50 * LINGER_MAX_S / 2


@pytest.mark.timeout(30)
def test_a_replica_never_waits_for_a_front_end_that_does_not_read() -> None:
    """A step's tokens go out without waiting for the socket: 200 messages of 1,000 tokens (far more than a socket
    holds) are queued at once while the front end reads nothing, then arrive whole and in order; once the front
    end is gone, a send says so."""
    tokens = {"type": "tokens", "items": [[f"cmpl-{i}", i, -0.5] for i in range(1000)], "engine_stamps": {}}
    with one_replica() as (front, replica):
        start = time.monotonic()
        for _ in range(200):
            replica.send(tokens)
        assert time.monotonic() - start < 2.0
        assert all(front.conns[0].recv() == tokens for _ in range(200))
        front.conns[0].close()
        with pytest.raises(LinkError, match="closed its link"):
            for _ in range(1000):
                replica.send(tokens)
                time.sleep(0.001)


@pytest.mark.timeout(30)
def test_a_poll_stops_lingering_once_the_step_in_flight_ended() -> None:
    """A message trickling in every 0.5 ms keeps a lingering poll (10 ms) reading for all of `LINGER_MAX_S`; with the
    device done (`device_busy` False) it returns after the first read, so the device is not kept waiting."""
    import statistics
    import threading

    with one_replica() as (front, replica):
        conn, stop = front.conns[0], threading.Event()

        def trickle() -> None:
            while not stop.is_set():
                conn.send({"type": "abort", "rid": "r"})
                time.sleep(0.0005)

        sender = threading.Thread(target=trickle, daemon=True)
        sender.start()
        try:
            replica.poll(5.0, 1)  # drain what came before
            start = time.monotonic()
            replica.poll(5.0, 10, lambda: True)
            busy_s = time.monotonic() - start
            done = []  # the median of nine, so one stall of a loaded host is not read as a linger
            for _ in range(9):
                start = time.monotonic()
                replica.poll(5.0, 10, lambda: False)
                done.append(time.monotonic() - start)
            done_s = statistics.median(done)
        finally:
            stop.set()
            sender.join(5)
        assert busy_s >= LINGER_MAX_S and done_s < LINGER_MAX_S / 2, (busy_s, done_s)


def _pool_with_one_replica() -> tuple[ReplicaPool, Connection]:
    """A front end's pool over a socketpair; the other end is the replica's Connection."""
    front, replica = socket.socketpair()
    hello = {"max_model_len": 64, "vocab_size": 100, "num_cache_tokens": 256, "max_num_seqs": 4}
    return ReplicaPool({0: Connection(front.detach())}, {0: hello}), Connection(replica.detach())


@pytest.mark.timeout(30)
@pytest.mark.parametrize("death_seen_after_s", [0.1, None])
def test_a_lost_replicas_requests_end_with_the_rank_death_behind_it(death_seen_after_s) -> None:
    """A replica's link closes because a rank of its world died (the replica exits after it): its requests end with
    that rank's name once the supervisor sees the death, looked for briefly; with no death, with the lost link."""
    death = "ffn rank 0 (world rank 1) exited with status -9 (killed by SIGKILL)"

    async def scenario() -> Event:
        pool, replica = _pool_with_one_replica()
        pool.start()
        began = time.monotonic()
        if death_seen_after_s is not None:
            pool.cause_of_loss = lambda r: death if time.monotonic() - began > death_seen_after_s else None
        sub = pool.submit("cmpl-1", [1, 2, 3], 4, SamplingParams(), [])
        assert replica.recv()["type"] == "add"
        replica.close()  # the replica process exits
        try:
            event = await asyncio.wait_for(sub.queue.get(), 5)
            assert not pool.alive[0]  # no request went there after the link closed
            return event
        finally:
            pool.close()

    event = asyncio.run(scenario())
    assert event.kind == "finished" and event.reason == "error" and event.status == 503
    assert event.message == (death if death_seen_after_s is not None else "replica 0 closed its link")
