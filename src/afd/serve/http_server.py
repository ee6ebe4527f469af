"""The HTTP/1.1 server under `afd serve`: one asyncio protocol per connection, routes looked up in a dict.

Why not aiohttp's server (which `afd serve` used until round 22): at one request a second, the front end's share
of time to first token was 1.07-1.29 ms p50 against a 1 ms target, and ~0.3 ms of it lay between the request's
bytes arriving and our handler starting (aiohttp's parser, request object, URL and router, middlewares, a task
per request). Here a request whose bytes are in is handed to its handler within the same callback
(an eagerly started task, Python 3.12+), and a stream's chunk goes to the socket in one `write`.

What it speaks: HTTP/1.1 and 1.0 requests with a `Content-Length` or chunked body, keep-alive and pipelining
(one request at a time per connection, in order), `Expect: 100-continue`, HEAD on GET routes; responses whole
(`Response`) or streamed with chunked transfer coding (`Request.stream`). What it refuses, with a status and
the connection closed: a malformed head (400), a head over `MAX_HEAD_BYTES` (431), a body over `max_body_bytes`
(413), a transfer coding other than chunked (501), a request that takes longer than `REQUEST_READ_S` to arrive
(408). It is plain `http://`; put a TLS proxy in front for anything else. Every wait is bounded: an idle
connection closes after `KEEPALIVE_S`, a paused writer's drain after `DRAIN_WRITE_S`.
"""

from __future__ import annotations

import asyncio
import http
import logging
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

MAX_HEAD_BYTES = 64 << 10
KEEPALIVE_S = 75.0  # an idle connection closes after this long without a request
REQUEST_READ_S = 60.0  # a request's head and body must be in within this long of its first byte
RECV_BYTES = 1 << 16
DRAIN_WRITE_S = 60.0  # a client that reads nothing for this long while we write is dropped
LINGER_S = 2.0  # after a refusal, what the client still sends is read and dropped this long, so it sees the answer
_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,16}")  # nothing else: a size a proxy might read otherwise is refused

_eager_task = getattr(asyncio, "eager_task_factory", None)  # Python 3.12+: the handler starts in this callback


class HTTPError(Exception):
    """A request this layer answers itself: malformed or too large (then the connection closes), or for a route
    that does not exist."""

    def __init__(self, status: int, message: str, *, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}


@dataclass
class Response:
    """A whole response: the status, its body and headers (`Content-Length` is added)."""

    status: int = 200
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)


class ClientGone(ConnectionError):
    """The client closed its connection (or stopped reading) while its response was being written."""


@dataclass
class Request:
    method: str
    path: str  # the target without its query
    query: str
    headers: dict[str, str]  # names in lower case; repeated headers joined with ", "
    body: bytes
    version: str  # "HTTP/1.1" or "HTTP/1.0"
    arrived_at: float = 0.0  # `time.perf_counter()` when the bytes that completed it were read
    _conn: _Connection | None = field(default=None, repr=False)
    _stream: Stream | None = field(default=None, repr=False)  # once the handler began a streamed response

    async def stream(self, status: int = 200, headers: dict[str, str] | None = None) -> Stream:
        """Send the head now and return the stream that writes the body (the handler then returns None)."""
        assert self._conn is not None
        return await self._conn.open_stream(self, status, headers or {})


class Stream:
    """A response body written as it is made: chunked on HTTP/1.1, delimited by the connection's close on 1.0."""

    def __init__(self, conn: _Connection, chunked: bool, head_only: bool) -> None:
        self._conn, self._chunked, self._head_only = conn, chunked, head_only
        self.ended = False

    def _framed(self, data: bytes) -> bytes:
        return b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data

    async def write(self, data: bytes) -> None:
        if data and not self._head_only:
            await self._conn.send(self._framed(data))

    def write_nowait(self, data: bytes) -> None:
        """Write without waiting for the client to read (a token's chunk, from a callback): what it has not read
        yet waits in the transport's buffer, as much as the response itself at most. A no-op once the client left
        (its handler is being cancelled)."""
        if data and not self._head_only:
            self._conn.send_nowait(self._framed(data))

    async def end(self) -> None:
        if self.ended:
            return
        self.ended = True
        if self._chunked and not self._head_only:
            await self._conn.send(b"0\r\n\r\n")


Handler = Callable[[Request], Awaitable[Response | None]]
# the response to an exception: this layer's own refusals (`HTTPError`) and whatever a handler raised
ErrorResponse = Callable[[Exception, Request | None], Response]


class HTTPServer:
    """Routes (method, path) -> handler over every connection of one listening socket."""

    def __init__(
        self,
        routes: dict[tuple[str, str], Handler],
        error_response: ErrorResponse,
        *,
        max_body_bytes: int,
    ) -> None:
        self.routes = dict(routes)
        for (method, path), handler in routes.items():
            if method == "GET":
                self.routes.setdefault(("HEAD", path), handler)
        self.paths: dict[str, list[str]] = {}
        for method, path in self.routes:
            self.paths.setdefault(path, []).append(method)
        self.error_response, self.max_body_bytes = error_response, max_body_bytes
        self.connections: set[_Connection] = set()
        self._server: asyncio.base_events.Server | None = None
        self.closing = False  # responses say `Connection: close` and idle connections end

    async def start(self, sock) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), sock=sock)

    def stop_accepting(self) -> None:
        if self._server is not None:
            self._server.close()

    async def close(self, timeout_s: float) -> None:
        """Close idle connections now, busy ones when their response ends (at most `timeout_s`), then the rest."""
        self.closing = True
        self.stop_accepting()
        for conn in list(self.connections):
            if not conn.busy:
                conn.close()
        deadline = time.monotonic() + timeout_s
        # a busy one closes itself when its response ends, and a closed one leaves once what it wrote is sent
        while self.connections and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for conn in list(self.connections):
            conn.abort()
        if self._server is not None:
            try:
                async with asyncio.timeout(2.0):
                    await self._server.wait_closed()
            except TimeoutError:
                logger.warning("the HTTP server's connections did not close within 2 s")

    def resolve(self, request: Request) -> Handler:
        handler = self.routes.get((request.method, request.path))
        if handler is not None:
            return handler
        methods = self.paths.get(request.path)
        if methods is None:
            raise HTTPError(404, f"there is no route {request.path}")
        allowed = ", ".join(sorted(methods))
        raise HTTPError(405, f"{request.path} takes {allowed}, not {request.method}", headers={"Allow": allowed})


_REASONS = {status.value: status.phrase for status in http.HTTPStatus}


def _head_bytes(status: int, headers: dict[str, str]) -> bytes:
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}", "Server: afd"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


@dataclass
class _Head:
    """A request whose head is parsed and whose body is still arriving."""

    method: str
    path: str
    query: str
    headers: dict[str, str]
    version: str
    body_start: int  # where the body begins in the connection's buffer
    length: int | None  # its Content-Length; None: chunked
    chunk_pos: int = 0  # chunked: where the next chunk's size line begins
    chunks: list[bytes] = field(default_factory=list)
    chunk_total: int = 0


class _Connection(asyncio.BufferedProtocol):
    """One client connection: reads requests, runs one handler at a time, writes its response.

    A buffered protocol: the transport reads into one buffer of ours (`recv_into`), where a plain protocol's
    `recv(256 KiB)` allocates that much for every packet (~20 us of a request's way in, on the CPU host)."""

    def __init__(self, server: HTTPServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self._recv = memoryview(bytearray(RECV_BYTES))
        self.busy = False  # a request is being handled
        self.keep_alive = True
        self._task: asyncio.Task | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._deadline: float | None = None  # when `_timed_out` acts (the loop's clock); None while busy
        self._request_started = False  # part of a request is in, the rest is awaited
        self._head: _Head | None = None  # the request being read, once its head is in
        self._head_scan = 0  # where the search for the end of the head goes on
        self._continued = False  # `100 Continue` sent for the request being read
        self._drain: asyncio.Future | None = None
        self._paused = False
        self._closed = False
        self._arrived_at = 0.0
        self._lingering = False  # refused: what still comes is dropped until the client closes (or LINGER_S)
        self._loop = asyncio.get_running_loop()

    # --- asyncio's callbacks
    def connection_made(self, transport) -> None:
        self.transport = transport
        self.server.connections.add(self)
        self._set_deadline(KEEPALIVE_S)

    def connection_lost(self, exc) -> None:
        self._closed = True
        self.server.connections.discard(self)
        self._cancel_timer()
        if self._drain is not None and not self._drain.done():
            self._drain.set_exception(ClientGone("the client closed its connection"))
        if self._task is not None and not self._task.done():
            self._task.cancel()  # the client left: its handler stops (and aborts its generation)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._recv

    def buffer_updated(self, nbytes: int) -> None:
        self._arrived_at = time.perf_counter()
        if self._lingering:
            return
        self.buffer += self._recv[:nbytes]
        if not self.busy:
            self._next_request()
        elif len(self.buffer) > MAX_HEAD_BYTES + self.server.max_body_bytes:
            self.transport.pause_reading()  # a pipelining client far ahead of us: wait for the current response

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    # --- reading requests
    def _next_request(self) -> None:
        if self._closed or self.busy:
            return
        while self.buffer[:2] == b"\r\n":  # an empty line before a request line is ignored (RFC 9112 2.2)
            del self.buffer[:2]
        if not self.buffer:
            if self.server.closing:
                self.close()
            return
        try:
            request = self._parse()
        except HTTPError as err:
            self._refuse(err)
            return
        if request is None:  # more bytes to come, within REQUEST_READ_S of the first
            if not self._request_started:
                self._request_started = True
                self._set_deadline(REQUEST_READ_S)
            return
        self._request_started = self._continued = False
        self._deadline = None
        self.busy = True
        coro = self._handle(request)
        self._task = _eager_task(self._loop, coro) if _eager_task else self._loop.create_task(coro)

    def _parse(self) -> Request | None:
        """The next whole request off the buffer, None while incomplete. Incremental: the head is parsed once,
        and the search for its end and a chunked body's parsing go on from where they stopped, so a request that
        trickles in costs time in its size, not in its size times its pieces."""
        head = self._head
        if head is None:
            end = self.buffer.find(b"\r\n\r\n", self._head_scan)
            if end < 0:
                if len(self.buffer) > MAX_HEAD_BYTES:
                    raise HTTPError(431, f"the request's head is over {MAX_HEAD_BYTES} bytes")
                self._head_scan = max(0, len(self.buffer) - 3)
                return None
            if end > MAX_HEAD_BYTES:
                raise HTTPError(431, f"the request's head is over {MAX_HEAD_BYTES} bytes")
            head = self._head = self._parse_head(end)
        if head.length is None:
            parsed = self._chunked_body(head)
        elif len(self.buffer) - head.body_start >= head.length:
            parsed = bytes(self.buffer[head.body_start : head.body_start + head.length]), head.body_start + head.length
        else:
            parsed = None
        if parsed is None:
            self._expect_continue(head)
            return None
        body, consumed = parsed
        del self.buffer[:consumed]
        self._head, self._head_scan = None, 0
        connection = head.headers.get("connection", "").lower()
        self.keep_alive = "close" not in connection and (head.version == "HTTP/1.1" or "keep-alive" in connection)
        return Request(head.method, head.path, head.query, head.headers, body, head.version, self._arrived_at, self)

    def _parse_head(self, end: int) -> _Head:
        """The request line and headers that end at `end`, and how its body is framed."""
        head = bytes(self.buffer[:end]).decode("latin-1")  # any byte decodes; the checks below refuse what is odd
        request_line, *header_lines = head.split("\r\n")
        parts = request_line.split(" ")
        if len(parts) != 3 or parts[2] not in ("HTTP/1.1", "HTTP/1.0") or not parts[0].isalpha():
            raise HTTPError(400, f"the request line {request_line[:80]!r} is not HTTP/1.x")
        method, target, version = parts
        headers: dict[str, str] = {}
        for line in header_lines:
            name, sep, value = line.partition(":")
            if not sep or not name or name != name.strip() or " " in name:
                raise HTTPError(400, f"the header line {line[:80]!r} is malformed")
            name, value = name.lower(), value.strip()
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        if target.startswith(("http://", "https://")):  # absolute form: keep the path
            target = "/" + target.split("://", 1)[1].partition("/")[2]
        path, _, query = target.partition("?")
        coding = headers.get("transfer-encoding")
        length = headers.get("content-length")
        if coding is not None:
            if length is not None:
                raise HTTPError(400, "a request may not carry both Content-Length and Transfer-Encoding")
            if coding.lower() != "chunked":
                raise HTTPError(501, f"the transfer coding {coding!r} is not supported; send chunked or a length")
            size = None
        elif length is None:
            size = 0
        elif length.isascii() and length.isdigit():
            size = int(length)
            if size > self.server.max_body_bytes:
                raise HTTPError(413, f"the request body is over {self.server.max_body_bytes} bytes")
        else:
            raise HTTPError(400, f"Content-Length {length[:40]!r} is not a number")
        return _Head(method, path, query, headers, version, end + 4, size, chunk_pos=end + 4)

    def _chunked_body(self, head: _Head) -> tuple[bytes, int] | None:
        """(body, bytes consumed) of a chunked body, or None while incomplete; the chunks read so far stay in
        `head` for the next call."""
        buf = self.buffer
        while True:
            pos = head.chunk_pos
            line_end = buf.find(b"\r\n", pos)
            if line_end < 0:
                if len(buf) - pos > MAX_HEAD_BYTES:
                    raise HTTPError(431, f"a chunk's size line is over {MAX_HEAD_BYTES} bytes")
                return None
            size_text = bytes(buf[pos:line_end]).split(b";", 1)[0].strip(b" \t")
            if not _CHUNK_SIZE.fullmatch(size_text):
                raise HTTPError(400, f"the chunk size {size_text[:20]!r} is not a hexadecimal number")
            size = int(size_text, 16)
            if head.chunk_total + size > self.server.max_body_bytes:
                raise HTTPError(413, f"the request body is over {self.server.max_body_bytes} bytes")
            if size == 0:
                if buf[line_end : line_end + 4] == b"\r\n\r\n":
                    return b"".join(head.chunks), line_end + 4
                trailer_end = buf.find(b"\r\n\r\n", line_end)  # trailers (ignored) end with an empty line
                if trailer_end < 0:
                    if len(buf) - line_end > MAX_HEAD_BYTES:
                        raise HTTPError(431, f"the request's trailers are over {MAX_HEAD_BYTES} bytes")
                    return None
                return b"".join(head.chunks), trailer_end + 4
            data_start = line_end + 2
            if len(buf) < data_start + size + 2:
                return None
            if buf[data_start + size : data_start + size + 2] != b"\r\n":
                raise HTTPError(400, "a chunk does not end where its size says")
            head.chunks.append(bytes(buf[data_start : data_start + size]))
            head.chunk_total += size
            head.chunk_pos = data_start + size + 2

    def _expect_continue(self, head: _Head) -> None:
        if (
            not self._continued
            and head.version == "HTTP/1.1"
            and head.headers.get("expect", "").lower() == "100-continue"
        ):
            self._continued = True
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    # --- handling one request
    async def _handle(self, request: Request) -> None:
        try:
            try:
                response = await self.server.resolve(request)(request)
                if response is None and request._stream is None:
                    raise RuntimeError(f"the handler of {request.method} {request.path} returned no response")
            except ClientGone:
                raise
            except Exception as exc:  # noqa: BLE001 - one request's failure must not end the server
                if request._stream is not None:  # the head went out: cut the body off, so the client sees it failed
                    logger.exception("%s %s failed after its response began", request.method, request.path)
                    raise ClientGone("the response was cut off") from exc
                response = self.server.error_response(exc, request)
            if response is None:
                await request._stream.end()
            else:
                self._write_whole(response, head_only=request.method == "HEAD", close=not self._keeps_alive())
        except (asyncio.CancelledError, ClientGone):
            self.abort()  # the client left (or stopped reading): its handler was stopped, its generation aborted
            return
        finally:
            self.busy = False
            self._task = None
        if not self._keeps_alive():
            self.close()
            return
        self._set_deadline(KEEPALIVE_S)
        self.transport.resume_reading()
        self._loop.call_soon(self._next_request)  # a pipelined request waits its turn (never recursion)

    def _refuse(self, err: HTTPError) -> None:
        """Answer a request this layer cannot take, then close: first the sending side, while what the client is
        still sending is read and dropped (closing on unread bytes resets the connection, and the client would
        lose the answer), then all of it when the client closes or after `LINGER_S`."""
        self.keep_alive = False
        self.buffer.clear()
        self._head, self._head_scan = None, 0
        self._write_whole(self.server.error_response(err, None), head_only=False, close=False, connection_close=True)
        self._lingering = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
            self._set_deadline(LINGER_S)
        else:
            self.close()

    def eof_received(self) -> bool:
        if self._lingering:
            self.close()
        return False  # the client closed its side: asyncio closes the connection (a handler still running stops)

    def _keeps_alive(self) -> bool:
        return self.keep_alive and not self.server.closing and not self._closed

    async def open_stream(self, request: Request, status: int, headers: dict[str, str]) -> Stream:
        chunked = request.version == "HTTP/1.1"
        if not chunked:
            self.keep_alive = False
        head = dict(headers)
        head["Transfer-Encoding" if chunked else "Connection"] = "chunked" if chunked else "close"
        if chunked and not self._keeps_alive():
            head["Connection"] = "close"
        stream = Stream(self, chunked, head_only=request.method == "HEAD")
        request._stream = stream
        await self.send(_head_bytes(status, head))
        return stream

    def _write_whole(self, response: Response, *, head_only: bool, close: bool, connection_close: bool = False) -> None:
        headers = {**response.headers, "Content-Length": str(len(response.body))}
        if close or connection_close:
            headers["Connection"] = "close"
        data = _head_bytes(response.status, headers)
        if not head_only:
            data += response.body
        if not self._closed:
            self.transport.write(data)
        if close:
            self.close()

    def send_nowait(self, data: bytes) -> None:
        if not self._closed and not self.transport.is_closing():
            self.transport.write(data)

    async def send(self, data: bytes) -> None:
        if self._closed or self.transport.is_closing():
            raise ClientGone("the client closed its connection")
        self.transport.write(data)
        if self._paused:
            self._drain = self._loop.create_future()
            try:
                async with asyncio.timeout(DRAIN_WRITE_S):
                    await self._drain
            except TimeoutError:
                raise ClientGone(f"the client read nothing for {DRAIN_WRITE_S:g} s") from None
            finally:
                self._drain = None

    # --- timers and closing
    def _set_deadline(self, seconds: float) -> None:
        """`_timed_out` acts `seconds` from now. One timer per connection, moved only when the deadline comes
        sooner and re-armed when it fires early, so a request on a kept-alive connection costs no timer."""
        self._deadline = self._loop.time() + seconds
        if self._timer is not None and self._timer.when() > self._deadline:
            self._cancel_timer()
        if self._timer is None:
            self._timer = self._loop.call_at(self._deadline, self._timed_out)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _timed_out(self) -> None:
        self._timer = None
        if self.busy or self._closed or self._deadline is None:
            return  # a response ends by setting the next deadline
        if self._loop.time() < self._deadline:
            self._timer = self._loop.call_at(self._deadline, self._timed_out)
            return
        if self._lingering:
            self.abort()
        elif self._request_started:  # a request was arriving, too slowly
            self._refuse(HTTPError(408, f"the request did not arrive within {REQUEST_READ_S:g} s"))
        else:
            self.close()

    def close(self) -> None:
        """Close once what was written is sent."""
        if not self._closed and self.transport is not None:
            self._closed = True
            self._cancel_timer()
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            self._closed = True
            self._cancel_timer()
            self.transport.abort()
