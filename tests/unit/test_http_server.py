"""`afd.serve.http_server` over real sockets: an `HTTPServer` on a free port in an event loop thread of its own,
tiny routes of ours, and raw clients that send exact bytes — framing, keep-alive and pipelining, refusals,
streaming, the client leaving, timeouts and shutdown."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import closing

import pytest

from afd.serve import http_server
from afd.serve.http_server import HTTPServer, Request, Response

BIG = 32 << 20  # over loopback's socket buffers: most of such a response waits in the transport's own buffer


class Routes:
    """The handlers, and what they saw, for the test thread to check."""

    def __init__(self) -> None:
        self.started, self.cancelled, self.big_done = threading.Event(), threading.Event(), threading.Event()

    async def hello(self, request: Request) -> Response:
        return Response(200, b"hello world", {"Content-Type": "text/plain"})

    async def echo(self, request: Request) -> Response:
        out = {"length": len(request.body), "x": request.headers.get("x-test"), "body": request.body.decode()}
        return Response(200, json.dumps(out).encode(), {"Content-Type": "application/json"})

    async def stream(self, request: Request) -> None:
        out = await request.stream(200, {"Content-Type": "text/plain"})
        for chunk in (b"one", b"two", b"three"):
            await out.write(chunk)
            await asyncio.sleep(0.01)

    async def boom(self, request: Request) -> Response:
        raise RuntimeError("boom")

    async def wait(self, request: Request) -> Response:
        self.started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return Response(200)

    async def nothing(self, request: Request) -> None:
        return None  # neither a response nor a stream: a handler's mistake

    async def big(self, request: Request) -> Response:
        self.big_done.set()
        return Response(200, b"x" * BIG)

    def table(self) -> dict[tuple[str, str], http_server.Handler]:
        get = [self.hello, self.stream, self.boom, self.wait, self.nothing, self.big]
        return {("GET", f"/{h.__name__}"): h for h in get} | {("POST", "/echo"): self.echo}


def error_response(exc: Exception, request: Request | None) -> Response:
    """As `afd serve`'s hook: the HTTP layer's status and headers (`Allow`), else 500; the message as JSON."""
    body = json.dumps({"error": str(exc)}).encode()
    headers = {"Content-Type": "application/json", **getattr(exc, "headers", {})}
    return Response(getattr(exc, "status", None) or 500, body, headers)


class Client:
    """A raw connection reading responses off its own buffer, so pipelined responses split where they should."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.sock.settimeout(5)
        self.buf = bytearray()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _more(self) -> None:
        data = self.sock.recv(1 << 16)
        if not data:
            raise EOFError("the server closed the connection")
        self.buf += data

    def take(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._more()
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def until(self, sep: bytes) -> bytes:
        while (i := self.buf.find(sep)) < 0:
            self._more()
        return self.take(i + len(sep))

    def rest(self) -> bytes:  # a close-delimited body
        try:
            while True:
                self._more()
        except EOFError:
            return self.take(len(self.buf))

    def response(self, *, head_only: bool = False) -> tuple[int, dict[str, str], bytes]:
        lines = self.until(b"\r\n\r\n").decode("latin-1").split("\r\n")[:-2]
        status = int(lines[0].split(" ")[1])
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        if head_only or status == 100:
            return status, headers, b""
        if "content-length" in headers:
            return status, headers, self.take(int(headers["content-length"]))
        if headers.get("transfer-encoding") == "chunked":
            parts = []
            while size := int(self.until(b"\r\n")[:-2], 16):
                parts.append(self.take(size + 2)[:-2])
            self.until(b"\r\n")
            return status, headers, b"".join(parts)
        return status, headers, self.rest()

    def at_eof(self) -> bool:  # the server closed: not a reset, not a timeout, nothing left unread
        return not self.buf and self.sock.recv(1) == b""


class LoopServer:
    """An `HTTPServer` on a free port, served by an event loop in a thread of its own (as `afd serve` runs it)."""

    def __init__(self, max_body_bytes: int = 1000) -> None:
        self.routes = Routes()
        self.server = HTTPServer(self.routes.table(), error_response, max_body_bytes=max_body_bytes)
        sock = socket.create_server(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.clients: list[Client] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.call(self.server.start(sock))

    def call(self, coro, timeout_s: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def client(self) -> Client:
        self.clients.append(Client(self.port))
        return self.clients[-1]

    async def _shutdown(self) -> None:
        await self.server.close(1.0)
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def stop(self) -> None:
        for c in self.clients:
            c.sock.close()
        try:
            self.call(self._shutdown())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
        assert not self.thread.is_alive(), "the server's loop thread did not stop"
        self.loop.close()


def wait_for(predicate: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


@pytest.fixture
def make_server() -> Iterator[Callable[..., LoopServer]]:
    """Servers made after the test's monkeypatches (the module's limits are read when used), all stopped after."""
    servers: list[LoopServer] = []

    def make(**kw: int) -> LoopServer:
        servers.append(LoopServer(**kw))
        return servers[-1]

    yield make
    for s in servers:
        s.stop()


@pytest.fixture
def srv(make_server: Callable[..., LoopServer]) -> LoopServer:
    return make_server()


GET_HELLO = b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.mark.timeout(30)
def test_keep_alive_answers_two_requests_on_one_connection(srv: LoopServer) -> None:
    """HTTP/1.1 keeps the connection by default; each response says its exact length."""
    c = srv.client()
    for _ in range(2):
        c.send(GET_HELLO)
        status, headers, body = c.response()
        assert (status, body, headers["content-length"], headers["server"]) == (200, b"hello world", "11", "afd")
        assert "connection" not in headers and headers["content-type"] == "text/plain"


@pytest.mark.timeout(30)
def test_pipelined_requests_are_answered_in_order(srv: LoopServer) -> None:
    """Three requests in one write: one at a time, in order, a streamed one included."""
    c = srv.client()
    c.send(b"GET /stream HTTP/1.1\r\n\r\nPOST /echo HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc" + GET_HELLO)
    assert c.response()[2] == b"onetwothree"
    assert json.loads(c.response()[2]) == {"length": 3, "x": None, "body": "abc"}
    assert c.response()[:3:2] == (200, b"hello world")


@pytest.mark.timeout(30)
def test_bodies_in_pieces_chunked_and_expect_continue(srv: LoopServer) -> None:
    """A body arrives over several reads; chunked with an extension and a trailer; 100 Continue before the body."""
    c = srv.client()
    c.send(b"POST /echo HTTP/1.1\r\nHost: x\r\nX-Test: split\r\nContent-Length: 10\r\n\r\n")
    for piece in (b"01234", b"567", b"89"):
        time.sleep(0.05)
        c.send(piece)
    assert json.loads(c.response()[2]) == {"length": 10, "x": "split", "body": "0123456789"}
    c.send(b"POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\nX-Test: ch\r\n\r\n5;x=1\r\nhello\r\n6\r\n wor")
    time.sleep(0.05)
    c.send(b"ld\r\n0\r\nX-Trailer: t\r")
    time.sleep(0.05)
    c.send(b"\n\r\n")
    assert json.loads(c.response()[2]) == {"length": 11, "x": "ch", "body": "hello world"}
    c.send(b"POST /echo HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 4\r\n\r\n")
    assert c.until(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
    c.send(b"ping")
    status, _, body = c.response()
    assert status == 200 and json.loads(body)["body"] == "ping"


@pytest.mark.timeout(30)
def test_a_request_that_arrives_byte_by_byte(srv: LoopServer) -> None:
    """The head's end split across reads, each chunk's size line and data in pieces: the parse goes on from where
    it stopped (no read starts it over) and the request comes out whole."""
    c = srv.client()
    c.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    request = (
        b"POST /echo HTTP/1.1\r\nX-Test: slow\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;e=1\r\nde\r\n0\r\n\r\n"
    )
    for i in range(len(request)):
        c.send(request[i : i + 1])
        time.sleep(0.002)
    assert json.loads(c.response()[2]) == {"length": 5, "x": "slow", "body": "abcde"}
    c.send(GET_HELLO)  # the state of the slow request is gone: the next one parses from scratch
    assert c.response()[2] == b"hello world"


@pytest.mark.timeout(30)
def test_head_on_get_routes_sends_headers_only(srv: LoopServer) -> None:
    """HEAD answers a GET route's head (its length too) and no body: the next response follows right after."""
    c = srv.client()
    c.send(b"HEAD /hello HTTP/1.1\r\n\r\n")
    status, headers, _ = c.response(head_only=True)
    assert status == 200 and headers["content-length"] == "11"
    c.send(b"HEAD /stream HTTP/1.1\r\n\r\n")
    status, headers, _ = c.response(head_only=True)
    assert status == 200 and headers["transfer-encoding"] == "chunked"
    c.send(GET_HELLO)
    assert c.response()[2] == b"hello world"


@pytest.mark.timeout(30)
def test_unknown_path_and_wrong_method_keep_the_connection(srv: LoopServer) -> None:
    """404 and 405 (with `Allow`) are answers, not refusals: the connection stays usable."""
    c = srv.client()
    c.send(b"GET /nope HTTP/1.1\r\n\r\n")
    status, headers, body = c.response()
    assert status == 404 and "/nope" in json.loads(body)["error"] and "connection" not in headers
    c.send(b"DELETE /hello HTTP/1.1\r\n\r\n")
    status, headers, _ = c.response()
    assert status == 405 and headers["allow"] == "GET, HEAD"
    c.send(b"GET /echo HTTP/1.1\r\n\r\n")
    assert c.response()[1]["allow"] == "POST"
    c.send(GET_HELLO)
    assert c.response()[2] == b"hello world"


CHUNKED_HEAD = b"POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
REFUSALS = {  # name: (bytes sent, the statuses that are right)
    "request-line": (b"GARBAGE\r\n\r\n", {400}),
    "http-2": (b"GET /hello HTTP/2.0\r\n\r\n", {400}),
    "header-line": (b"GET /hello HTTP/1.1\r\nNoColon\r\n\r\n", {400}),
    "length-and-coding": (b"POST /echo HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\nabc", {400}),
    "length-not-a-number": (b"POST /echo HTTP/1.1\r\nContent-Length: 3x\r\n\r\nabc", {400}),
    "gzip": (b"POST /echo HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n", {501}),
    "body-too-big": (b"POST /echo HTTP/1.1\r\nContent-Length: 1001\r\n\r\n", {413}),
    "chunks-too-big": (CHUNKED_HEAD + b"3e9\r\n", {413}),  # 0x3e9 = 1001
    "head-too-big": (b"GET /hello HTTP/1.1\r\nX-Big: " + b"a" * 2000 + b"\r\n\r\n", {431}),
    "head-too-big-unended": (b"GET /hello HTTP/1.1\r\nX-Big: " + b"a" * 2000, {431}),
    # framing that only looks valid, or has no end (these fail today: see the module's bugs in the report)
    "superscript-length": (b"POST /echo HTTP/1.1\r\nContent-Length: \xb2\r\n\r\nab", {400}),  # "²".isdigit()
    "negative-chunk": (CHUNKED_HEAD + b"5\r\nhello\r\n-2\r\n0\r\n\r\n", {400}),
    "0x-chunk": (CHUNKED_HEAD + b"0x5\r\nhello\r\n0\r\n\r\n", {400}),  # a proxy's strtol reads 0: smuggling
    "endless-chunk-line": (CHUNKED_HEAD + b"1;" + b"e" * 8000, {400, 413, 431}),  # unbounded: the buffer grows
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("raw", "statuses"), REFUSALS.values(), ids=REFUSALS.keys())
def test_refusals_answer_then_close(
    monkeypatch: pytest.MonkeyPatch, make_server: Callable[..., LoopServer], raw: bytes, statuses: set[int]
) -> None:
    """A request this layer cannot frame gets its status, `Connection: close`, and the connection's end."""
    monkeypatch.setattr(http_server, "MAX_HEAD_BYTES", 1024)
    c = make_server(max_body_bytes=1000).client()
    c.send(raw)
    try:
        status, headers, body = c.response()
    except (EOFError, TimeoutError) as exc:  # closed without an answer, or no answer at all
        status, headers, body = type(exc).__name__, {}, b"{}"
    assert status in statuses and headers["connection"] == "close" and json.loads(body)["error"]
    assert c.at_eof()


@pytest.mark.timeout(30)
def test_http10_closes_and_streams_without_chunks(srv: LoopServer) -> None:
    """HTTP/1.0 without keep-alive: `Connection: close` and the close; a stream is raw bytes up to the close."""
    c = srv.client()
    c.send(b"GET /hello HTTP/1.0\r\n\r\n")
    status, headers, body = c.response()
    assert (status, headers["connection"], body) == (200, "close", b"hello world") and c.at_eof()
    c = srv.client()
    c.send(b"GET /stream HTTP/1.0\r\n\r\n")
    status, headers, body = c.response()
    assert (status, headers["connection"], body) == (200, "close", b"onetwothree")
    assert "transfer-encoding" not in headers and "content-length" not in headers
    c = srv.client()
    for _ in range(2):  # asked for, keep-alive holds on 1.0 too
        c.send(b"GET /hello HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
        assert c.response()[2] == b"hello world"


@pytest.mark.timeout(30)
def test_stream_is_chunked_on_http11_and_the_connection_reused(srv: LoopServer) -> None:
    """Each write is one chunk, the end is `0\\r\\n\\r\\n`, and the connection takes the next request."""
    c = srv.client()
    c.send(b"GET /stream HTTP/1.1\r\n\r\n")
    head = c.until(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"\r\nTransfer-Encoding: chunked\r\n" in head
    assert b"Content-Length" not in head and b"Connection" not in head
    assert c.until(b"0\r\n\r\n") == b"3\r\none\r\n3\r\ntwo\r\n5\r\nthree\r\n0\r\n\r\n"
    c.send(GET_HELLO)
    assert c.response()[2] == b"hello world"


@pytest.mark.timeout(30)
def test_handler_exception_gets_the_hooks_500_and_the_connection_stays(srv: LoopServer) -> None:
    """One request's failure is its own: the hook's answer, then the same connection serves on."""
    with closing(http.client.HTTPConnection("127.0.0.1", srv.port, timeout=5)) as conn:
        conn.request("GET", "/boom")
        resp = conn.getresponse()
        assert (resp.status, json.loads(resp.read())) == (500, {"error": "boom"})
        sock = conn.sock
        conn.request("GET", "/hello")
        resp = conn.getresponse()
        assert resp.read() == b"hello world" and conn.sock is sock


@pytest.mark.timeout(30)
def test_handler_returning_nothing_still_gets_an_answer(srv: LoopServer) -> None:
    """A handler that returns None without streaming is a bug of its own, but the client must not hang on it."""
    c = srv.client()
    c.send(b"GET /nothing HTTP/1.1\r\n\r\n")
    try:
        status = c.response()[0]
    except TimeoutError:
        status = None  # no answer, and no timer left to ever close the connection
    assert status == 500


@pytest.mark.timeout(30)
def test_client_disconnect_cancels_the_handler(srv: LoopServer) -> None:
    """A client that leaves stops its handler (that is what aborts a generation) and its connection is gone."""
    c = srv.client()
    c.send(b"GET /wait HTTP/1.1\r\n\r\n")
    assert srv.routes.started.wait(5) and len(srv.server.connections) == 1
    c.sock.close()
    assert srv.routes.cancelled.wait(5)
    assert wait_for(lambda: not srv.server.connections)


@pytest.mark.timeout(30)
def test_slow_request_gets_408_and_idle_connections_close(
    monkeypatch: pytest.MonkeyPatch, make_server: Callable[..., LoopServer]
) -> None:
    """Every wait is bounded: a head that stops half way gets 408; an idle connection, fresh or used, is closed."""
    monkeypatch.setattr(http_server, "REQUEST_READ_S", 0.3)
    monkeypatch.setattr(http_server, "KEEPALIVE_S", 0.3)
    srv = make_server()
    slow = srv.client()
    slow.send(b"GET /hello HTTP/1.1\r\nHost: x\r\n")
    status, headers, _ = slow.response()
    assert (status, headers["connection"]) == (408, "close") and slow.at_eof()
    fresh, used = srv.client(), srv.client()
    used.send(GET_HELLO)
    assert used.response()[0] == 200
    start = time.monotonic()
    assert fresh.at_eof() and used.at_eof() and time.monotonic() - start < 3
    assert wait_for(lambda: not srv.server.connections)


@pytest.mark.timeout(30)
def test_close_ends_idle_and_busy_connections_and_stops_listening(srv: LoopServer) -> None:
    """`close`: idle connections end now, a busy one at its timeout (its handler cancelled), no new ones after."""
    fresh, used, busy = srv.client(), srv.client(), srv.client()
    used.send(GET_HELLO)
    assert used.response()[0] == 200
    busy.send(b"GET /wait HTTP/1.1\r\n\r\n")
    assert srv.routes.started.wait(5) and wait_for(lambda: len(srv.server.connections) == 3)
    start = time.monotonic()
    srv.call(srv.server.close(0.5))
    assert 0.4 < time.monotonic() - start < 5
    assert fresh.at_eof() and used.at_eof() and srv.routes.cancelled.wait(5)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", srv.port), timeout=5).close()
    assert wait_for(lambda: not srv.server.connections)


@pytest.mark.timeout(30)
def test_close_lets_a_written_response_reach_a_slow_reader(srv: LoopServer) -> None:
    """A whole response already written but still in the transport's buffer must not be cut by `close`."""
    c = srv.client()
    c.send(b"GET /big HTTP/1.1\r\n\r\n")
    assert srv.routes.big_done.wait(5)
    assert wait_for(lambda: not any(x.busy for x in list(srv.server.connections)))  # written, not yet sent
    closed = asyncio.run_coroutine_threadsafe(srv.server.close(5.0), srv.loop)  # the client reads meanwhile
    status, headers, _ = c.response(head_only=True)
    assert (status, headers["content-length"]) == (200, str(BIG))
    received = len(c.rest())
    closed.result(10)
    assert received == BIG
