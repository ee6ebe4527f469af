"""The front end's per-replica sums (outstanding tokens for the balancer, requests held for the waiting count), kept
as requests come, advance and end, against the same sums recomputed from every live request (`ReplicaPool`, no
processes: the pool is fed the messages a replica sends)."""

from __future__ import annotations

import random
import socket
from multiprocessing.connection import Connection

from afd.engine.sampling import SamplingParams
from afd.serve.balancer import outstanding_tokens
from afd.serve.frontend import ReplicaPool


def _pool(replicas: int) -> ReplicaPool:
    hello = {"max_model_len": 64, "vocab_size": 100, "num_cache_tokens": 256, "max_num_seqs": 3}
    conns = {r: Connection(socket.socketpair()[0].detach()) for r in range(replicas)}
    return ReplicaPool(conns, dict.fromkeys(range(replicas), hello))


def _recomputed(pool: ReplicaPool) -> tuple[list[int], list[int]]:
    load, held = [0] * pool.num_replicas, [0] * pool.num_replicas
    for sub in pool.requests.values():
        load[sub.replica] += outstanding_tokens(sub.prompt_len, sub.max_tokens, sub.generated)
        held[sub.replica] += 1
    return load, held


def test_the_sums_follow_every_submit_token_end_abort_and_failure() -> None:
    pool, rng = _pool(3), random.Random(0)
    for i in range(200):
        kind = rng.random()
        live = list(pool.requests)
        if kind < 0.4 or not live:
            pool.submit(f"r{i}", [1] * rng.randint(1, 20), rng.randint(1, 8), SamplingParams(), [])
        elif kind < 0.75:
            rid = rng.choice(live)
            items = [[rid, 5, -0.1]] * rng.randint(1, 3)
            pool._on_message(pool.requests[rid].replica, {"type": "tokens", "items": items, "engine_stamps": {}})
        elif kind < 0.9:
            rid = rng.choice(live)
            pool._on_message(pool.requests[rid].replica, {"type": "finished", "rid": rid, "reason": "length"})
        elif kind < 0.97:
            pool.abort(rng.choice(live))
        else:
            pool.fail("a replica died", replica=rng.randrange(3))
        load, held = _recomputed(pool)
        assert pool.loads() == load, i
        assert pool._held == held, i
        in_flight = sum(max(0, n - 3) for n in held)
        assert pool.waiting() == in_flight
    pool.fail("the end")
    assert pool.loads() == [0, 0, 0] and pool._held == [0, 0, 0] and pool.waiting() == 0
