"""The front end reads all a replica has sent before it hands anything on (`ReplicaPool._readable`), so a stream
behind its replica finds every step's tokens queued at once and writes them together; and a `bye` that arrives with
the link's end is a clean end, not a lost replica. Real sockets, no processes."""

from __future__ import annotations

import asyncio
import socket
from multiprocessing.connection import Connection

from afd.engine.sampling import SamplingParams
from afd.runtime.link import RECV_BYTES, encode_frame
from afd.serve.frontend import ReplicaPool

HELLO = {"max_model_len": 64, "vocab_size": 100, "num_cache_tokens": 256, "max_num_seqs": 4}


async def _pool_and_replica_end() -> tuple[ReplicaPool, socket.socket]:
    ours, theirs = socket.socketpair()
    pool = ReplicaPool({0: Connection(ours.detach())}, {0: HELLO})
    pool.start()
    return pool, theirs


def _tokens(rid: str, token: int, others: int = 0) -> bytes:
    """One step's tokens message: `rid`'s token and those of `others` requests this front end no longer knows."""
    items = [[rid, token, -0.5]] + [[f"gone{i}", 1, -0.5] for i in range(others)]
    return encode_frame({"type": "tokens", "items": items, "engine_stamps": {}})


def test_one_read_takes_every_step_the_replica_sent() -> None:
    async def main() -> None:
        pool, replica = await _pool_and_replica_end()
        pool.submit("r", [1, 2, 3], 8, SamplingParams(), [])
        steps = b"".join(_tokens("r", t, others=1000) for t in range(5))  # more than one recv's worth in all
        assert RECV_BYTES < len(steps) < 150_000  # and less than the socket holds unread
        replica.sendall(steps)
        pool._readable(0)  # one turn of the loop's reader
        queue = pool.requests["r"].queue
        assert queue.qsize() == 5
        assert [queue.get_nowait().items for _ in range(5)] == [[(t, -0.5)] for t in range(5)]
        assert pool.requests["r"].generated == 5
        pool.close()
        replica.close()

    asyncio.run(main())


def test_a_bye_read_with_the_links_end_is_no_loss() -> None:
    async def main() -> None:
        pool, replica = await _pool_and_replica_end()
        replica.sendall(encode_frame({"type": "bye"}))
        replica.close()  # the end of the link comes in the same read as the bye
        pool._readable(0)
        assert pool.alive == [True] and pool._byes[0].is_set()
        pool.close()

    asyncio.run(main())


def test_the_links_end_without_a_bye_loses_the_replica() -> None:
    async def main() -> None:
        pool, replica = await _pool_and_replica_end()
        pool.submit("r", [1, 2, 3], 8, SamplingParams(), [])
        replica.sendall(_tokens("r", 9))
        replica.close()
        pool._readable(0)
        assert pool.requests["r"].generated == 1  # what came before the end is still handed on
        assert pool.alive == [False]
        pool.close()

    asyncio.run(main())
