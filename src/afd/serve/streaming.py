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


class ClientStalled(Exception):
    """The client read nothing for `WRITE_STALL_S` while its stream had more to send."""


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


async def _write(send: Send, message: Message) -> None:
    try:
        async with asyncio.timeout(WRITE_STALL_S):
            await send(message)
    except TimeoutError:
        raise ClientStalled from None


class EventStream(Response):
    """A response of server-sent events: the head at once (the replica already works), then each event as the
    iterator yields it; `on_end` runs however it ends (the caller aborts what still runs there)."""

    def __init__(self, events: AsyncIterator[bytes], on_end: Callable[[], None], name: str) -> None:
        self.events, self.on_end, self.name = events, on_end, name
        self.status_code, self.background = 200, None
        self.init_headers({"content-type": "text/event-stream", "cache-control": "no-cache"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watcher = _Watcher(receive)
        try:
            await _write(send, {"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async with aclosing(self.events) as events:
                async for data in events:
                    await _write(send, {"type": "http.response.body", "body": data, "more_body": True})
            watcher.finish()
            await _write(send, {"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not watcher.left():
                raise
        except ClientStalled:
            # returning without the end of the response makes uvicorn close the connection
            logger.warning("the client of %s read nothing for %g s; its request is aborted", self.name, WRITE_STALL_S)
        finally:
            watcher.finish()
            self.on_end()
