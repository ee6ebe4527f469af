"""The `async` connector end to end over real POSIX shared memory: config, ring, processes, shutdown."""

from __future__ import annotations

import datetime
import glob
import json
import multiprocessing as mp
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from afd.connectors.asynchronous.attention import AsyncAttentionExchange, RingExhausted
from afd.connectors.asynchronous.ffn import AsyncFFNServer, run_ffn_loop
from afd.connectors.expert_pass import WorkRows, expert_pass
from afd.topology import AsyncTopology
from afd.transport.shm import cleanup_segments, read_run_token

NUM_EXPERTS, TOPK, HIDDEN, NUM_LAYERS, MAX_TOKENS = 6, 2, 16, 2, 32


def dims(poll_ms: int = 50) -> dict:
    return dict(
        hidden_size=HIDDEN,
        topk=TOPK,
        num_layers=NUM_LAYERS,
        dtype=torch.float32,
        device="cpu",
        max_num_batched_tokens=MAX_TOKENS,
        extra_config={"recv_poll_timeout_ms": poll_ms},
        timeout_s=30.0,
    )


class StandInFFN:
    """Deterministic per-expert math: expert e(x) = tanh(x) * (1 + 0.1 e) + 0.01 (e + layer)."""

    def __init__(self, expert_range: range) -> None:
        self.start = expert_range.start
        self.num_local = len(expert_range)

    def experts_topk(self, layer_idx: int, x: torch.Tensor, routing) -> torch.Tensor:
        """fp32 sum over the (row, k) pairs whose expert is local; other pairs add nothing."""
        out = torch.zeros(x.shape, dtype=torch.float32)
        for k in range(routing.topk_ids.shape[1]):
            ids = routing.topk_ids[:, k]
            is_local = (ids >= self.start) & (ids < self.start + self.num_local)
            out += torch.where(is_local[:, None], routing.topk_weights[:, k : k + 1] * expert_fn(layer_idx, x, ids), 0)
        return out

    def shared(self, layer_idx: int, x: torch.Tensor) -> torch.Tensor:
        return x * 0.5 + 0.25 * layer_idx + 1.0


def expert_fn(layer_idx: int, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    ids = ids.to(torch.float32).unsqueeze(1)
    return torch.tanh(x) * (1 + 0.1 * ids) + 0.01 * (ids + layer_idx)


def reference(layer_idx: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """Direct computation: sum_k w[t, k] * expert_{ids[t, k]}(x[t]) + shared(x[t])."""
    out = StandInFFN(range(0)).shared(layer_idx, x)
    for k in range(topk_ids.shape[1]):
        out = out + topk_weights[:, k : k + 1] * expert_fn(layer_idx, x, topk_ids[:, k])
    return out


def routing(num_tokens: int, g: torch.Generator, experts: list[int] | None = None) -> SimpleNamespace:
    pool = experts if experts is not None else list(range(NUM_EXPERTS))
    rows = [torch.tensor(pool)[torch.randperm(len(pool), generator=g)[:TOPK]] for _ in range(num_tokens)]
    ids = torch.stack(rows) if rows else torch.zeros(0, TOPK, dtype=torch.int64)  # [T, K]
    return SimpleNamespace(topk_ids=ids, topk_weights=torch.rand(num_tokens, TOPK, generator=g))


def client(port: int) -> dist.Store:
    return dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=30))


# --------------------------------------------------------------------------------------------- processes


class Results:
    """Reports from children through the store: an mp.Queue's lock can die with a killed child."""

    def __init__(self, store: dist.Store) -> None:
        self.store = store
        self.seen = 0

    def put(self, item: tuple[str, int, str]) -> None:
        n = self.store.add("results/count", 1)
        self.store.set(f"results/{n}", json.dumps(item))

    def drain(self) -> list[tuple[str, int, str]]:
        out = []
        while self.store.check([f"results/{self.seen + 1}"]):
            self.seen += 1
            out.append(tuple(json.loads(self.store.get(f"results/{self.seen}"))))
        return out


def attn_main(port: int, num_attn: int, num_ffn: int, attn_rank: int, scenario: str) -> None:
    results = Results(client(port))
    try:
        topo = AsyncTopology(num_attn, num_ffn, NUM_EXPERTS)
        ex = AsyncAttentionExchange(client(port), topo, attn_rank, **dims())
        g = torch.Generator().manual_seed(attn_rank)
        t0 = time.monotonic()
        if scenario == "kill_me":
            x = torch.randn(3, HIDDEN, generator=g)
            ex(0, x, routing(3, g))
            results.put(("ready", attn_rank, ""))
            time.sleep(600)
        # very different loads: rank 0 long batches, rank 1 short ones
        loads = [0, 17, 32, 5, 1] if attn_rank == 0 else [1, 0, 2]
        for step in range(12):
            num_tokens = loads[step % len(loads)]
            x, r = torch.randn(num_tokens, HIDDEN, generator=g), routing(num_tokens, g)
            for layer in range(NUM_LAYERS):
                torch.testing.assert_close(ex(layer, x, r), reference(layer, x, r.topk_ids, r.topk_weights))
        if attn_rank == 0:
            # 1000 single-token decode steps, top-k all on FFN rank 0: FFN 1 never gets a slot to leak
            ffn0 = list(topo.expert_ranges[0])
            for _ in range(1000):
                x, r = torch.randn(1, HIDDEN, generator=g), routing(1, g, ffn0)
                torch.testing.assert_close(ex(1, x, r), reference(1, x, r.topk_ids, r.topk_weights))
        # fewer tokens than FFN ranks, routed to the last FFN rank: rank 0 gets only the shared row
        last = list(topo.expert_ranges[-1])
        x, r = torch.randn(1, HIDDEN, generator=g), routing(1, g, last)
        torch.testing.assert_close(ex(0, x, r), reference(0, x, r.topk_ids, r.topk_weights))
        ex.close()
        results.put(("ok", attn_rank, f"{time.monotonic() - t0:.2f}s"))
    except BaseException as e:  # noqa: BLE001
        results.put(("error", attn_rank, f"{type(e).__name__}: {e}"))
        raise


def ffn_main(port: int, num_attn: int, num_ffn: int, ffn_rank: int) -> None:
    results = Results(client(port))
    try:
        topo = AsyncTopology(num_attn, num_ffn, NUM_EXPERTS)
        server = AsyncFFNServer(client(port), topo, ffn_rank, **dims())
        run_ffn_loop(server, StandInFFN(topo.expert_ranges[ffn_rank]))
        results.put(("ffn_ok", ffn_rank, str(server.items_served)))
    except BaseException as e:  # noqa: BLE001
        results.put(("ffn_error", ffn_rank, f"{type(e).__name__}: {e}"))


def start(num_attn: int, num_ffn: int, scenario: str) -> tuple[dist.TCPStore, list, Results]:
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=30))
    results = Results(store)
    procs = [ctx.Process(target=attn_main, args=(store.port, num_attn, num_ffn, a, scenario)) for a in range(num_attn)]
    procs += [ctx.Process(target=ffn_main, args=(store.port, num_attn, num_ffn, f)) for f in range(num_ffn)]
    for p in procs:
        p.start()
    return store, procs, results


def stop(procs: list, store: dist.TCPStore) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(5)
    try:
        cleanup_segments(read_run_token(store, timeout_s=0.5))
    except TimeoutError:
        pass


def collect(results: Results, count: int, timeout_s: float) -> list[tuple[str, int, str]]:
    deadline = time.monotonic() + timeout_s
    out = results.drain()
    while len(out) < count and time.monotonic() < deadline:
        time.sleep(0.05)
        out += results.drain()
    return out


def segments(store: dist.Store) -> list[str]:
    return glob.glob(f"/dev/shm/afd_{read_run_token(store, timeout_s=5)}_*")


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_2a2f_matches_direct_computation_and_shuts_down_clean() -> None:
    store, procs, results = start(2, 2, "normal")
    try:
        got = collect(results, 4, 75)
        assert sorted(k for k, _, _ in got) == ["ffn_ok", "ffn_ok", "ok", "ok"], got
        for p in procs:
            p.join(10)
            assert p.exitcode == 0
        assert segments(store) == []
    finally:
        stop(procs, store)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_killed_attention_rank_does_not_hang_ffn() -> None:
    store, procs, results = start(1, 2, "kill_me")
    try:
        assert collect(results, 1, 40) == [("ready", 0, "")]
        procs[0].kill()
        t0 = time.monotonic()
        got = collect(results, 2, 20)
        assert sorted(k for k, _, _ in got) == ["ffn_error", "ffn_error"], got
        assert all("attention rank 0" in msg and "died" in msg for _, _, msg in got)
        assert time.monotonic() - t0 < 10
        for p in procs[1:]:
            p.join(10)
            assert not p.is_alive()
        token = read_run_token(store, timeout_s=5)
        assert cleanup_segments(token) == []  # every segment was unlinked once all ranks had mapped it
        assert segments(store) == []
    finally:
        stop(procs, store)


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
        models = [StandInFFN(r) for r in AsyncTopology(1, 3, NUM_EXPERTS).expert_ranges]
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
        model = StandInFFN(range(NUM_EXPERTS))
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
