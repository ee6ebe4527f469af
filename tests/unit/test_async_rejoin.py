"""An attention replica restarted alone joins a running `async` world over real shared memory (in one process):
the FFN rank maps its new window, ignores what the dead incarnation left unread, and answers the new one; the new
window's name goes once the FFN rank mapped it, and the FFN rank's stays for later restarts."""

from __future__ import annotations

import os
import threading

import torch
import torch.distributed as dist
from helpers.async_fakes import HIDDEN, NUM_EXPERTS, AsyncStandInFFN, dims, reference, routing, segments_of

from afd.connectors.asynchronous.attention import AsyncAttentionExchange
from afd.connectors.asynchronous.ffn import AsyncFFNServer
from afd.connectors.asynchronous.window import GENERATION_SEQ_BITS
from afd.topology import AsyncTopology
from afd.transport.shm import ShmHeap, cleanup_segments


def test_a_restarted_attention_replica_joins_the_running_world() -> None:
    store, token = dist.HashStore(), f"rejoin{os.getpid()}"
    topo = AsyncTopology(1, 1, NUM_EXPERTS)
    made: dict[str, object] = {}

    def heap(world_rank: int, **options):
        return lambda nbytes: ShmHeap(store, world_rank, 2, nbytes, run_token=token, **options)

    def ffn() -> None:
        made["ffn"] = AsyncFFNServer(store, topo, 0, heap_factory=heap(1, keep_name=True), **dims())

    thread = threading.Thread(target=ffn)
    thread.start()
    first = AsyncAttentionExchange(store, topo, 0, heap_factory=heap(0), **dims())
    thread.join(30)
    server = made["ffn"]
    assert isinstance(server, AsyncFFNServer)
    server.drop_dead_peers = True
    model = AsyncStandInFFN(range(NUM_EXPERTS))
    g = torch.Generator().manual_seed(3)
    try:
        assert segments_of(token) == [f"/dev/shm/afd_{token}_1"]  # the FFN rank's name stays
        x, r = torch.randn(5, HIDDEN, generator=g), routing(5, g)
        first.send(0, x, r)  # and then this incarnation dies: its request is never answered

        def rejoin() -> None:
            made["second"] = AsyncAttentionExchange(
                store, topo, 0, heap_factory=heap(0, generation=1, peers=[1]), **dims()
            )

        joining = threading.Thread(target=rejoin)
        joining.start()
        while joining.is_alive():  # the FFN rank's liveness look admits it
            server.admit_restarted_peers()
            joining.join(0.01)
        second = made["second"]
        assert isinstance(second, AsyncAttentionExchange)
        assert segments_of(token) == [f"/dev/shm/afd_{token}_1"]  # the new window's name went once it was mapped
        assert second.window.seq == 1 << GENERATION_SEQ_BITS  # above any seq its dead incarnation stamped

        stop = threading.Event()
        loop = threading.Thread(target=lambda: [server.step(model, 1) for _ in iter(stop.is_set, True)])
        loop.start()
        try:
            for layer in (0, 1):
                x, r = torch.randn(7, HIDDEN, generator=g), routing(7, g)
                out = second(layer, x, r)
                torch.testing.assert_close(out, reference(layer, x, r.topk_ids, r.topk_weights))
        finally:
            stop.set()
            loop.join(30)
        assert server.items_served == 2  # the dead incarnation's request was never served
        second.close()
    finally:
        first.window.close()
        server.close()
        cleanup_segments(token)
