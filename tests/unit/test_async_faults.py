"""Faults of the `async` window and its shared-memory transport, each shown by a test: segment leaks, a half-sent
overflow, shutdown racing a message, non-x86 hosts, the NVSHMEM placement wait."""

from __future__ import annotations

import platform
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from helpers.async_fakes import HIDDEN, NUM_EXPERTS, TOPK, dims, endpoints, models, reference, routing, segments_of

import afd.connectors.asynchronous.endpoint as async_endpoint
from afd.connectors.asynchronous.attention import AsyncAttentionExchange, ConnectorShutdown
from afd.connectors.asynchronous.ffn import AsyncFFNServer
from afd.connectors.asynchronous.wire import WindowOverflow
from afd.topology import AsyncTopology
from afd.transport.factory import default_heap_factory
from afd.transport.nvshmem import exchange_placement
from afd.transport.shm import RUN_TOKEN_KEY, ShmHeap, check_store_ordering, cleanup_segments
from afd.transport.symm_heap import SymmetricHeap


def test_shm_segments_are_unlinked_once_every_peer_mapped_them() -> None:
    store = dist.HashStore()
    heaps: dict[int, ShmHeap] = {}
    threads = [threading.Thread(target=lambda r=r: heaps.setdefault(r, ShmHeap(store, r, 2, 4096))) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    token = store.get(RUN_TOKEN_KEY).decode()
    try:
        assert segments_of(token) == []  # nothing a crash could leak from here on
        heaps[0].peer_view(1)[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)  # still one shared window
        assert heaps[1].local[:4].tolist() == [1, 2, 3, 4]
    finally:
        for h in heaps.values():
            h.close()
        cleanup_segments(token)


def test_endpoint_closes_its_window_when_init_fails_after_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """`wait_keys` for the peers' process info fails after the window exists: the endpoint must close it."""

    def fail(*args: object, **kwargs: object) -> None:
        raise TimeoutError("timed out waiting for process info of the peers")

    monkeypatch.setattr(async_endpoint, "wait_keys", fail)
    store = dist.HashStore()
    topo = AsyncTopology(1, 1, NUM_EXPERTS)
    heaps: list[SymmetricHeap] = []
    errors: list[BaseException] = []

    def build(cls: type, rank: int, world_rank: int) -> None:
        make = default_heap_factory(store, world_rank, 2, torch.device("cpu"), 10.0)

        def factory(nbytes: int) -> SymmetricHeap:
            heaps.append(make(nbytes))
            return heaps[-1]

        try:
            cls(store, topo, rank, heap_factory=factory, **dims())
        except TimeoutError as e:
            errors.append(e)

    threads = [
        threading.Thread(target=build, args=(AsyncAttentionExchange, 0, 0)),
        threading.Thread(target=build, args=(AsyncFFNServer, 0, 1)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    try:
        assert len(errors) == 2 and len(heaps) == 2
        assert all(h._closed for h in heaps), "a failed endpoint kept its window open"
    finally:
        for h in heaps:
            h.close()
        cleanup_segments(store.get(RUN_TOKEN_KEY).decode())


# --------------------------------------------------------------------------------------------- overflow


def test_overflow_on_second_destination_sends_nothing_and_keeps_the_ring_free() -> None:
    """row_cap 16: FFN rank 0 gets 1 row (fits), FFN rank 1 gets 17 rows (overflows).
    Before the fix FFN rank 0's message was already published and both ring slots stayed in flight, so
    the next send failed with RingExhausted."""
    with endpoints(2, routed_cap_multiplier=0.5) as (ex, servers):
        assert ex.window.layout.row_cap == 16
        g = torch.Generator().manual_seed(3)
        x = torch.randn(18, HIDDEN, generator=g)
        on_ffn1 = SimpleNamespace(
            topk_ids=torch.tensor([[0, 1]] + [[3, 4]] * 17), topk_weights=torch.rand(18, TOPK, generator=g)
        )  # 1 row for FFN rank 0, 17 for FFN rank 1
        with pytest.raises(WindowOverflow, match="row_cap=16"):
            ex.send(0, x, on_ffn1)
        assert ex._in_flight == set() and not ex._pending
        assert all(s.window.poll(0.0) is None for s in servers), "a message of the failed send was published"
        # the next send that fits works end to end
        x, r = torch.randn(5, HIDDEN, generator=g), routing(5, g)
        ex.send(1, x, r)
        for server, model in zip(servers, models(2), strict=True):
            assert server.step(model, max_items=1) == 1
        torch.testing.assert_close(ex.recv(), reference(1, x, r.topk_ids, r.topk_weights))
        assert ex._in_flight == set()


# --------------------------------------------------------------------------------------------- shutdown


def after_flag_read(window: object, action: Callable[[], None]) -> None:
    """Run `action` right after `window`'s next flag read: a peer writing between flag and header read."""
    real = window._read_flags

    def read() -> list[int]:
        flags = real()
        window._read_flags = real
        action()
        return flags

    window._read_flags = read


def test_ffn_shutdown_while_its_response_is_read_is_a_clean_shutdown() -> None:
    """The attention rank has read stage 0's flag of a response when the FFN rank announces shutdown.
    Before the fix the shutdown was written into stage 0 and the attention rank failed with "header seq
    does not match its flag"; now it reads the intact response, then sees a clean shutdown."""
    with endpoints(1) as (ex, (server,)):
        g = torch.Generator().manual_seed(1)
        x, r = torch.randn(4, HIDDEN, generator=g), routing(4, g)
        ex.send(0, x, r)
        assert server.step(models(1)[0], max_items=1) == 1  # the response is in stage 0
        after_flag_read(ex.window, server.announce_shutdown)
        torch.testing.assert_close(ex.recv(), reference(0, x, r.topk_ids, r.topk_weights))
        ex.send(1, x, r)
        with pytest.raises(ConnectorShutdown, match="FFN rank 0"):
            ex.recv()


def test_attention_shutdown_while_its_request_is_in_flight_is_a_clean_shutdown() -> None:
    """The FFN rank has read the flag of a request in stage 0 when the attention rank announces shutdown:
    it serves the intact request, then ends normally."""
    with endpoints(1) as (ex, (server,)):
        g = torch.Generator().manual_seed(2)
        x, r = torch.randn(3, HIDDEN, generator=g), routing(3, g)
        ex.send(0, x, r)
        after_flag_read(server.window, ex.announce_shutdown)
        model = models(1)[0]
        assert server.step(model, max_items=1) == 1
        with pytest.raises(ConnectorShutdown, match="every attention rank"):
            server.step(model)


# --------------------------------------------------------------------------------------------- hosts


def test_shm_window_refuses_hosts_without_x86_store_ordering(monkeypatch: pytest.MonkeyPatch) -> None:
    check_store_ordering("x86_64")
    check_store_ordering("AMD64")
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    store = dist.HashStore()
    try:
        with pytest.raises(RuntimeError, match="needs x86-64 store ordering but this host is aarch64") as info:
            ShmHeap(store, 0, 1, 4096)
        assert "p2p" in str(info.value) and "\n" not in str(info.value)
        assert not store.check([RUN_TOKEN_KEY]), "the refused heap started its rendezvous"
    finally:
        if store.check([RUN_TOKEN_KEY]):
            cleanup_segments(store.get(RUN_TOKEN_KEY).decode())


def test_nvshmem_placement_wait_is_bounded_and_names_the_missing_ranks() -> None:
    store = dist.HashStore()
    store.set("afd_nvshmem/placement/2", '{"host": "h", "gpu": "g2", "nbytes": 1}')
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"world ranks \[1, 3\]"):
        exchange_placement(store, 0, 4, {"host": "h", "gpu": "g0", "nbytes": 1}, timeout_s=0.3)
    assert time.monotonic() - t0 >= 0.3  # it waited its bound, then gave up (the test's timeout catches a hang)
