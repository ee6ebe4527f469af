"""The `async` connector end to end over real POSIX shared memory: config, ring, processes, shutdown."""

from __future__ import annotations

import glob
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from helpers.async_fakes import (
    HIDDEN,
    NUM_EXPERTS,
    TOPK,
    AsyncStandInFFN,
    dims,
    reference,
    routing,
)

from afd.connectors.asynchronous.attention import AsyncAttentionExchange, RingExhausted
from afd.connectors.asynchronous.ffn import AsyncFFNServer
from afd.connectors.expert_pass import WorkRows, expert_pass
from afd.topology import AsyncTopology

# --------------------------------------------------------------------------------------------- in process


def test_ring_exhaustion_is_a_configuration_error() -> None:
    store = dist.HashStore()
    topo = AsyncTopology(1, 1, NUM_EXPERTS)
    made: dict[str, object] = {}
    release = threading.Event()

    def ffn() -> None:
        made["ffn"] = AsyncFFNServer(store, topo, 0, **dims())
        release.wait(10)
        made["ffn"].close()

    t = threading.Thread(target=ffn)
    t.start()
    ex = AsyncAttentionExchange(store, topo, 0, **dims())
    try:
        g = torch.Generator().manual_seed(0)
        x, r = torch.randn(2, HIDDEN, generator=g), routing(2, g)
        ex.send(0, x, r)
        with pytest.raises(RingExhausted, match="ring_depth=1"):
            ex.send(1, x, r)
    finally:
        release.set()
        t.join(10)
        ex.close()
    assert not glob.glob(f"/dev/shm/afd_{ex.window.heap.run_token}_*")


def test_zero_tokens_never_wait_and_gate_must_be_on_attention() -> None:
    store = dist.HashStore()
    topo = AsyncTopology(1, 1, NUM_EXPERTS)
    box: dict[str, AsyncFFNServer] = {}
    t = threading.Thread(target=lambda: box.setdefault("ffn", AsyncFFNServer(store, topo, 0, **dims())))
    t.start()
    ex = AsyncAttentionExchange(store, topo, 0, **dims())
    t.join(10)
    try:
        y = ex(0, torch.zeros(0, HIDDEN), routing(0, torch.Generator()))
        assert y.shape == (0, HIDDEN)
        with pytest.raises(ValueError, match="compute_gate_on_attention"):
            ex(0, torch.zeros(1, HIDDEN), None)
    finally:
        ex.close()
        box["ffn"].close()


@contextmanager
def in_process(
    num_attn: int, num_ffn: int, topk: int = TOPK
) -> Iterator[tuple[list[AsyncAttentionExchange], list[AsyncFFNServer]]]:
    """Every endpoint of an A:F topology in this process (threads only to get past the init barrier)."""
    store = dist.HashStore()
    topo = AsyncTopology(num_attn, num_ffn, NUM_EXPERTS)
    made: dict[tuple[str, int], object] = {}
    builders = [(("a", a), AsyncAttentionExchange, a) for a in range(num_attn)]
    builders += [(("f", f), AsyncFFNServer, f) for f in range(num_ffn)]
    threads = [
        threading.Thread(target=lambda k=k, c=c, r=r: made.setdefault(k, c(store, topo, r, **{**dims(), "topk": topk})))
        for k, c, r in builders
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    try:
        assert len(made) == num_attn + num_ffn, "an endpoint failed to start"
        yield [made[("a", a)] for a in range(num_attn)], [made[("f", f)] for f in range(num_ffn)]
    finally:
        for endpoint in made.values():
            endpoint.close()


def test_partials_are_added_in_ffn_rank_order_whatever_order_they_arrive_in() -> None:
    """1A3F, top-3 on all three ranks: FFN rank 2 answers first, ranks 1 and 0 after the attention rank's
    first flag read, so it reads them 2, 0, 1. The result is still zeros + p0 + p1 + p2 in fp32, bit for bit
    (two partials per token would add the same either way)."""
    with in_process(1, 3, topk=3) as ((ex,), servers):
        models = [AsyncStandInFFN(r) for r in AsyncTopology(1, 3, NUM_EXPERTS).expert_ranges]
        g = torch.Generator().manual_seed(11)
        x = torch.randn(12, HIDDEN, generator=g) * 100
        ids = torch.tensor([[0, 2, 4], [3, 5, 1], [1, 4, 2]] * 4)  # experts 0-1, 2-3, 4-5 on FFN 0, 1, 2
        r = SimpleNamespace(topk_ids=ids, topk_weights=torch.rand(12, 3, generator=g) * 7)
        pending = ex.send(1, x, r)
        assert sorted(pending.sent) == [0, 1, 2]
        partials = {}
        for f in range(3):
            tok = pending.plan.token_index[pending.plan.segment(f)]
            item = WorkRows(x[tok], r.topk_ids[tok], r.topk_weights[tok], pending.plan.shared_rows[f])
            partials[f] = (tok, expert_pass(models[f], 1, [item])[0])

        def summed(order: list[int]) -> torch.Tensor:
            acc = torch.zeros(12, HIDDEN)
            for f in order:
                acc.index_add_(0, *partials[f])
            return acc

        assert not torch.equal(summed([0, 1, 2]), summed([2, 0, 1]))  # the data tells the orders apart
        assert servers[2].step(models[2], max_items=1) == 1
        real = ex.window._read_flags

        def read() -> list[int]:  # the first read sees rank 2 only; then ranks 1 and 0 answer
            flags = real()
            ex.window._read_flags = real
            for f in (1, 0):
                assert servers[f].step(models[f], max_items=1) == 1
            return flags

        ex.window._read_flags = read
        assert torch.equal(ex.recv(), summed([0, 1, 2]))


def test_items_of_one_layer_from_two_replicas_share_one_expert_pass() -> None:
    """2A1F in one process: both replicas' layer-1 requests wait together; one FFN step answers both
    with one expert pass, each answer equal to the direct computation and to the answer served alone."""
    with in_process(2, 1) as ((ex0, ex1), (server,)):
        model = AsyncStandInFFN(range(NUM_EXPERTS))
        calls: list[int] = []
        real = model.experts_topk
        model.experts_topk = lambda layer, x, r: calls.append(x.shape[0]) or real(layer, x, r)
        g = torch.Generator().manual_seed(5)
        (x0, r0), (x1, r1) = [(torch.randn(n, HIDDEN, generator=g), routing(n, g)) for n in (7, 3)]
        ex0.send(1, x0, r0)
        ex1.send(1, x1, r1)
        assert server.step(model) == 2 and server.expert_passes == 1 and calls == [10]
        together = ex0.recv(), ex1.recv()
        for got, (x, r) in zip(together, ((x0, r0), (x1, r1)), strict=True):
            torch.testing.assert_close(got, reference(1, x, r.topk_ids, r.topk_weights))
        for ex, x, r, got in ((ex0, x0, r0, together[0]), (ex1, x1, r1, together[1])):
            ex.send(1, x, r)
            assert server.step(model, max_items=1) == 1
            torch.testing.assert_close(ex.recv(), got, atol=1e-6, rtol=1e-6)
        assert server.expert_passes == 3
