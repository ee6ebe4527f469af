"""A response's life against its client: a stream of server-sent events that stops when the client leaves or stops
reading, and a non-streamed answer whose work is cancelled when the client leaves.

uvicorn tells an application that its client left only through `receive()` (`http.disconnect`), and a `send` to a
client that no longer reads waits for the socket to drain. So each response has a watcher on `receive()` that
cancels the work when the client goes (whose `finally` blocks abort the request on its replica), and every
write of a stream is bounded by `WRITE_STALL_S`: a client that reads nothing for that long is dropped and its
request aborted, so a stalled reader holds at most the transport's buffer and a queue of its own tokens.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import TypeVar

from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

logger = logging.getLogger(__name__)

WRITE_STALL_S = 30.0  # the longest one write of a stream may wait for its client to read

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its answer was complete."""


class _Watcher:
    """Cancels the running task when `receive()` says the client left (unless `finish` came first)."""

    def __init__(self, receive: Receive) -> None:
        self.gone = False
        self.finished = False
        self._task = asyncio.current_task()
        self._watch = asyncio.ensure_future(self._run(receive))

    async def _run(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if not self.finished and self._task is not None:
            self.gone = True
            self._task.cancel()

    def finish(self) -> None:
        self.finished = True
        self._watch.cancel()

    def left(self) -> bool:
        """In an `except CancelledError`: whether it was the client leaving (then the cancel is taken back)."""
        if self.gone and self._task is not None:
            self._task.uncancel()
            return True
        return False


async def unless_disconnected(receive: Receive, work: Awaitable[T]) -> T:
    """`work`'s result; ClientGone (with `work` cancelled, its `finally` blocks run) when the client leaves first."""
    watcher = _Watcher(receive)
    try:
        return await work
    except asyncio.CancelledError:
        if watcher.left():
            raise ClientGone from None
        raise
    finally:
        watcher.finish()


class Stall:
    """Whether one wait (between `begin()` and `end()`) has lasted `limit` seconds: then `on_stall()`, once. One
    timer that re-arms itself checks it, not a timer per wait: a stream waits once per token, and arming
    `asyncio.timeout` for each cost ~15 us of the front end's loop (a tenth of its time at ~1,000 streams)."""

    def __init__(self, limit: float, on_stall: Callable[[], None]) -> None:
        self.limit, self.on_stall = limit, on_stall
        self.since: float | None = None
        self.stalled = False
        self._loop = asyncio.get_running_loop()
        self._handle = self._loop.call_later(limit, self._check)

    def begin(self) -> None:
        self.since = self._loop.time()

    def end(self) -> None:
        self.since = None

    def close(self) -> None:
        self._handle.cancel()

    def _check(self) -> None:
        waited = 0.0 if self.since is None else self._loop.time() - self.since
        if waited >= self.limit:
            self.stalled = True
            self.on_stall()
        else:
            self._handle = self._loop.call_later(self.limit - waited, self._check)


class EventStream(Response):
    """A response of server-sent events: the head at once (the replica already works), then each event as the
    iterator yields it; `on_end` runs however it ends (the caller aborts what still runs there)."""

    def __init__(self, events: AsyncIterator[bytes], on_end: Callable[[], None], name: str) -> None:
        self.events, self.on_end, self.name = events, on_end, name
        self.status_code, self.background = 200, None
        self.init_headers({"content-type": "text/event-stream", "cache-control": "no-cache"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watcher = _Watcher(receive)
        task = asyncio.current_task()
        assert task is not None
        stall = Stall(WRITE_STALL_S, task.cancel)  # every write bounded: a client that reads nothing is dropped

        async def write(message: Message) -> None:
            stall.begin()
            await send(message)
            stall.end()

        try:
            await write({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async with aclosing(self.events) as events:
                async for data in events:
                    await write({"type": "http.response.body", "body": data, "more_body": True})
            watcher.finish()
            await write({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if stall.stalled:  # returning without the end of the response makes uvicorn close the connection
                task.uncancel()
                logger.warning("the client of %s read nothing for %g s; its request is aborted", self.name, stall.limit)
            elif not watcher.left():
                raise
        finally:
            stall.close()
            watcher.finish()
            self.on_end()
