"""The `async` connector across real processes over POSIX shared memory: 2A2F outputs equal the direct computation and
every rank shuts down clean, and a killed attention rank does not hang the FFN ranks."""

from __future__ import annotations

import datetime
import glob
import json
import multiprocessing as mp
import time

import pytest
import torch
import torch.distributed as dist
from helpers.async_fakes import (
    HIDDEN,
    NUM_EXPERTS,
    NUM_LAYERS,
    AsyncStandInFFN,
    dims,
    reference,
    routing,
)

from afd.connectors.asynchronous.attention import AsyncAttentionExchange
from afd.connectors.asynchronous.ffn import AsyncFFNServer, run_ffn_loop
from afd.topology import AsyncTopology
from afd.transport.shm import cleanup_segments, read_run_token


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
        run_ffn_loop(server, AsyncStandInFFN(topo.expert_ranges[ffn_rank]))
        results.put(("ffn_ok", ffn_rank, str(server.items_served)))
    except BaseException as e:  # noqa: BLE001
        results.put(("ffn_error", ffn_rank, f"{type(e).__name__}: {e}"))


# Ranks are forked from a forkserver that has torch and the connector preloaded (a fresh, single-threaded process,
# as clean as a spawned one): a spawned rank imported torch itself, ~1.7 s of CPU each on a 2-core host.
_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "afd.connectors.asynchronous.attention", "afd.connectors.asynchronous.ffn"])


def start(num_attn: int, num_ffn: int, scenario: str) -> tuple[dist.TCPStore, list, Results]:
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=30))
    results = Results(store)
    procs = [_CTX.Process(target=attn_main, args=(store.port, num_attn, num_ffn, a, scenario)) for a in range(num_attn)]
    procs += [_CTX.Process(target=ffn_main, args=(store.port, num_attn, num_ffn, f)) for f in range(num_ffn)]
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
