"""The HTTP/1.1 client of `afd bench serve`: keep-alive connections to one server, bodies read as they arrive.

Why not aiohttp's client (the library `afd serve` was first built on): its request path (URL objects,
cookies, tracing, timeouts) spent ~0.3 ms of Python per request before the request's first byte left,
measured with its own trace hooks on a cold CPU at one request a second, and the benchmark counts that time
in the front end's share of TTFT. This client writes one request and parses the status line, the headers and
a chunked, sized or close-delimited body, nothing more. It speaks plain `http://` only; the caller bounds
each request's time.
"""

from __future__ import annotations

import asyncio
import socket
import urllib.parse
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

MAX_HEADER_BYTES = 64 << 10
RECV_BYTES = 1 << 16


class HTTPError(ConnectionError):
    """The server broke the protocol or the connection, in one sentence."""


class _Connection(asyncio.BufferedProtocol):
    """One kept-alive connection: what arrives goes into one buffer of ours (`recv_into`), and `readline`,
    `readexactly` and `read` take from it, waiting only when it has too little. Why not asyncio's streams: their
    transport reads with `recv(256 KiB)`, an allocation that size per packet, and each read passes several
    layers of Python; both are on the way of a token's chunk to the TTFT stamp."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self._recv = memoryview(bytearray(RECV_BYTES))
        self._waiter: asyncio.Future | None = None
        self.eof = False

    # asyncio's callbacks
    def connection_made(self, transport) -> None:
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._recv

    def buffer_updated(self, nbytes: int) -> None:
        self.buffer += self._recv[:nbytes]
        self._wake()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake()
        return False

    def connection_lost(self, exc) -> None:
        self.eof = True
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _more(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    # reading, as asyncio.StreamReader's methods of the same names
    async def readline(self) -> bytes:
        """Up to and with the next newline; what is left at the end of the stream; b"" after it."""
        while (end := self.buffer.find(b"\n")) < 0:
            if len(self.buffer) > MAX_HEADER_BYTES:
                raise HTTPError(f"the server sent a line of over {MAX_HEADER_BYTES} bytes (a header or a chunk size)")
            if self.eof:
                end = len(self.buffer) - 1
                break
            await self._more()
        line = bytes(self.buffer[: end + 1])
        del self.buffer[: end + 1]
        return line

    async def readexactly(self, n: int) -> bytes:
        while len(self.buffer) < n:
            if self.eof:
                partial = bytes(self.buffer)
                self.buffer.clear()
                raise asyncio.IncompleteReadError(partial, n)
            await self._more()
        data = bytes(self.buffer[:n])
        del self.buffer[:n]
        return data

    async def read(self, n: int) -> bytes:
        """Whatever is there, at most `n` bytes, waiting for some; b"" at the end of the stream."""
        while not self.buffer and not self.eof:
            await self._more()
        data = bytes(self.buffer[:n])
        del self.buffer[:n]
        return data

    def write(self, data: bytes) -> None:
        self.transport.write(data)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class Response:
    """A response's status and headers (names in lower case); its body through `chunks`, `lines` or `read`."""

    def __init__(self, status: int, headers: dict[str, str], conn: _Connection) -> None:
        self.status, self.headers, self._conn = status, headers, conn
        self.complete = False  # the whole body was read: the connection may serve the next request

    @property
    def keep_alive(self) -> bool:
        return self.headers.get("connection", "").lower() != "close" and (
            "content-length" in self.headers or "chunked" in self.headers.get("transfer-encoding", "").lower()
        )

    async def chunks(self) -> AsyncIterator[bytes]:
        reader = self._conn
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            while True:
                size_line = await reader.readline()
                try:
                    size = int(size_line.split(b";", 1)[0], 16)
                except ValueError:
                    raise HTTPError(f"the server sent a bad chunk size line {size_line[:40]!r}") from None
                if size == 0:
                    while (await reader.readline()) not in (b"\r\n", b"\n", b""):  # trailers
                        pass
                    break
                data = await reader.readexactly(size)
                await reader.readexactly(2)  # the chunk's CRLF
                yield data
        elif "content-length" in self.headers:
            left = int(self.headers["content-length"])
            while left > 0:
                data = await reader.read(min(left, 1 << 16))
                if not data:
                    raise HTTPError(f"the server closed the connection with {left} bytes of the body unsent")
                left -= len(data)
                yield data
        else:  # the body ends when the server closes the connection
            while data := await reader.read(1 << 16):
                yield data
        self.complete = True

    async def lines(self) -> AsyncIterator[bytes]:
        """The body line by line, each with its newline (server-sent events are lines)."""
        pending = b""
        async for data in self.chunks():
            pending += data
            *whole, pending = pending.split(b"\n")
            for line in whole:
                yield line + b"\n"
        if pending:
            yield pending

    async def read(self) -> bytes:
        return b"".join([data async for data in self.chunks()])


class Client:
    """Requests to the server at `url` (`http://host[:port][/prefix]`) over connections kept open between them;
    as many connections as requests run at once (an open-loop client never queues)."""

    def __init__(self, url: str) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"afd bench serve measures plain http:// servers; {url!r} is not one")
        self.host, self.port = parts.hostname, parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self._host_header = parts.netloc.encode()
        self._idle: list[_Connection] = []

    async def _connect(self) -> _Connection:
        transport, conn = await asyncio.get_running_loop().create_connection(_Connection, self.host, self.port)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a request is one small write
        return conn

    def _request_bytes(self, method: str, path: str, body: bytes, headers: dict[str, str]) -> bytes:
        lines = [f"{method} {self.prefix}{path} HTTP/1.1".encode(), b"Host: " + self._host_header]
        lines += [f"{name}: {value}".encode() for name, value in headers.items()]
        if body or method == "POST":
            lines.append(f"Content-Length: {len(body)}".encode())
        return b"\r\n".join(lines) + b"\r\n\r\n" + body

    @asynccontextmanager
    async def request(
        self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
    ) -> AsyncIterator[Response]:
        """One request; the response's body must be read inside the block for its connection to be reused. A kept
        connection that the server closed meanwhile is replaced once."""
        data = self._request_bytes(method, path, body, headers or {})
        while True:
            reused = bool(self._idle)
            conn = self._idle.pop() if reused else await self._connect()
            try:
                conn.write(data)
                status_line = await conn.readline()
                if not status_line and reused:
                    conn.close()
                    continue  # the server had closed this idle connection: once more on a new one
                response = await _read_head(status_line, conn)
            except BaseException:
                conn.close()
                raise
            break
        try:
            yield response
        finally:
            if response.complete and response.keep_alive:
                self._idle.append(conn)
            else:
                conn.close()

    async def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()


async def _read_head(status_line: bytes, conn: _Connection) -> Response:
    parts = status_line.split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise HTTPError(f"the server did not answer with an HTTP/1.1 status line: {status_line[:60]!r}")
    headers: dict[str, str] = {}
    while True:
        line = await conn.readline()
        if line in (b"\r\n", b"\n"):
            break
        if not line:
            raise HTTPError("the server closed the connection inside a response's headers")
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return Response(int(parts[1]), headers, conn)
