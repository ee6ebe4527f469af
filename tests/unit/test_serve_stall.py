"""`afd.serve.streaming.Stall`: one self-re-arming timer per stream bounds each wait (a write to the client, a
request's next event) without a timer per wait."""

from __future__ import annotations

import asyncio

import pytest

from afd.serve.streaming import Stall


@pytest.mark.timeout(30)
def test_only_one_wait_that_reaches_the_limit_stalls_and_it_stalls_once() -> None:
    async def run() -> tuple[list[float], list[float], bool]:
        loop = asyncio.get_running_loop()
        short_fired: list[float] = []
        short = Stall(0.1, lambda: short_fired.append(loop.time()))
        for _ in range(30):  # 30 waits of 10 ms: 0.3 s in all, none near the limit
            short.begin()
            await asyncio.sleep(0.01)
            short.end()
            await asyncio.sleep(0.001)
        short.close()
        long_fired: list[float] = []
        long = Stall(0.05, lambda: long_fired.append(loop.time()))
        await asyncio.sleep(0.12)  # no wait under way: nothing to bound
        long.begin()
        started = loop.time()
        await asyncio.sleep(0.3)
        long.end()
        long.close()
        return short_fired, [t - started for t in long_fired], long.stalled

    short_fired, long_after, stalled = asyncio.run(run())
    assert short_fired == []
    assert len(long_after) == 1 and 0.05 <= long_after[0] < 0.25 and stalled


@pytest.mark.timeout(30)
def test_a_closed_stall_never_fires() -> None:
    async def run() -> list[int]:
        fired: list[int] = []
        stall = Stall(0.02, lambda: fired.append(1))
        stall.begin()
        stall.close()
        await asyncio.sleep(0.1)
        return fired

    assert asyncio.run(run()) == []
