"""`afd serve` against what a hostile or broken client sends, through raw sockets to the real server (uvicorn's
httptools parser under the FastAPI application) over an in-process replica: malformed heads, lone surrogates,
prompt floods, oversized bodies, clients that stop reading, requests without the API key."""

from __future__ import annotations

import json
import socket
import sys
import time

import pytest
from helpers.http_client import http_request
from helpers.serve import MODEL, InProcessServer

from afd.serve import streaming

BODY = json.dumps({"prompt": "a", "max_tokens": 1}).encode()


def exchange(port: int, data: bytes, *, wait_s: float = 30.0) -> tuple[bytes, bool]:
    """Send `data` on a fresh connection; (every byte the server sent back, whether it closed the connection).

    An answer "at once" is one before `wait_s` of silence, far below the minute a server that waits for more bytes
    would stay quiet: no premise on the machine's speed."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(wait_s)
    try:
        sock.sendall(data)
        got = b""
        while True:
            try:
                piece = sock.recv(65536)
            except TimeoutError:
                return got, False
            except ConnectionResetError:
                return got, True
            if not piece:
                return got, True
            got += piece
    finally:
        sock.close()


@pytest.fixture(scope="module")
def server():
    srv = InProcessServer(num_replicas=1, max_num_seqs=2, max_waiting=3, max_prompts_per_request=8)
    try:
        yield srv
    finally:
        srv.close()


HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\n"
MALFORMED = {
    # h11 reads this as a chunked request; a parser that keeps the LF inside the value frames it otherwise
    "bare LF in a header value": HEAD + b"X-A: a\nTransfer-Encoding: chunked\r\nContent-Length: %d\r\n\r\n" % len(BODY),
    "bare CR in a header value": HEAD + b"X-A: a\rb\r\nContent-Length: %d\r\n\r\n" % len(BODY),
    "NUL in a header value": HEAD + b"X-A: a\x00b\r\nContent-Length: %d\r\n\r\n" % len(BODY),
    "NUL in a header name": HEAD + b"X-\x00A: b\r\nContent-Length: %d\r\n\r\n" % len(BODY),
    "( in a header name": HEAD + b"X-(A: b\r\nContent-Length: %d\r\n\r\n" % len(BODY),
    "bare-LF line endings": b"GET /health HTTP/1.1\nHost: a\n\n",
    "a TLS ClientHello": bytes.fromhex("16030100f1010000ed0303") + bytes(range(32)) + b"\x00" * 200,
    "no Host on HTTP/1.1": b"GET /health HTTP/1.1\r\n\r\n",
    "two Hosts on HTTP/1.1": b"GET /health HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_head_gets_400_at_once_and_the_connection_closes(server, case: str) -> None:
    data = MALFORMED[case]
    got, closed = exchange(server.port, data + (BODY if data.startswith(HEAD) else b""))
    assert got.startswith(b"HTTP/1.1 400 ") and closed, (case, got[:200])
    assert http_request(server.port, "GET", "/health")[0] == 200  # and the server serves on


@pytest.mark.timeout(60)
def test_a_chunked_body_on_http10_closes_the_connection_after_its_answer(server) -> None:
    """RFC 9112 §6.1: a chunked body on HTTP/1.0 cannot be framed for keep-alive; a request pipelined behind it
    is not answered."""
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY)
    request = (
        b"POST /v1/completions HTTP/1.0\r\nConnection: keep-alive\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n" + chunked
    )
    got, closed = exchange(server.port, request + b"GET /health HTTP/1.1\r\nHost: a\r\n\r\n")
    assert closed and got.count(b"HTTP/1.1 ") == 1, got[:300]


@pytest.mark.timeout(60)
def test_a_lone_surrogate_in_a_prompt_or_a_message_is_a_400(server) -> None:
    """JSON can carry "\\ud800", which is no Unicode text: the tokenizer refuses it in one sentence (it was a 500)."""
    raw = [
        ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 1}', "prompt"),
        ("/v1/completions", b'{"prompt": ["ok", "\\udfff"], "max_tokens": 1}', "prompt"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 1}',
            "messages",
        ),
    ]
    for path, body, param in raw:
        status, got, _ = http_request(server.port, "POST", path, body)
        assert status == 400 and got["error"]["param"] == param, (path, got)
        assert "lone surrogate" in got["error"]["message"]
    assert not server.state.pool.requests


@pytest.mark.timeout(60)
def test_prompts_count_against_max_waiting_and_are_capped_per_request(server) -> None:
    """One replica of 2 running places, --max-waiting 3, --max-prompts-per-request 8: a request's prompts are
    requests as far as waiting goes (6 prompts would make 4 wait), and 9 in one request are refused outright."""
    status, got, headers = server.post("/v1/completions", {"prompt": [[1, 2]] * 6, "max_tokens": 1})
    assert status == 429 and headers.get("retry-after") == "1" and "would make 4" in got["error"]["message"]
    status, got, _ = server.post("/v1/completions", {"prompt": [[1, 2]] * 9, "max_tokens": 1})
    assert (
        status == 400 and got["error"]["param"] == "prompt" and "--max-prompts-per-request" in got["error"]["message"]
    )
    assert not server.state.pool.requests  # nothing of either was submitted
    status, got, _ = server.post("/v1/completions", {"prompt": [[1, 2]] * 5, "max_tokens": 1})
    assert status == 200 and len(got["choices"]) == 5  # 3 of them waited: within the limit


@pytest.mark.timeout(60)
def test_a_body_beyond_what_the_model_length_allows_is_refused_before_it_is_read(server) -> None:
    from afd.serve.server import body_limit

    limit = body_limit(server.state.pool.max_model_len)
    assert limit < 2 << 20  # 4,096 tokens: 1.25 MiB
    head = b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\n"
    got, closed = exchange(server.port, head + b"Content-Length: %d\r\n\r\n{" % (60 << 20))  # no body follows
    assert got.startswith(b"HTTP/1.1 413 ") and closed, got[:300]
    assert b"RequestTooLargeError" in got
    # a chunked body has no length to read up front: it is cut off where it passes the limit. The client offers far
    # more than the limit plus what the kernel's buffers on both ends can hold (a few MiB on loopback), so the send
    # fails only because the server stopped reading and closed, whatever the machine's speed.
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.settimeout(30)
    sock.sendall(head + b"Transfer-Encoding: chunked\r\n\r\n")
    chunk = b"%x\r\n%s\r\n" % (1 << 16, b" " * (1 << 16))
    offered, sent = 64 * limit, 0
    try:
        while sent < offered:
            sock.sendall(chunk)
            sent += 1 << 16
    except OSError:  # the server answered and closed
        pass
    answer = sock.recv(65536)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 413 ") and sent < offered, answer[:200]


@pytest.mark.timeout(120)
def test_a_client_that_stops_reading_stalls_only_its_own_stream_then_is_aborted(monkeypatch) -> None:
    """Backpressure: a stream's writes wait for its client; one that reads nothing for WRITE_STALL_S has its request
    aborted on its replica (its cache freed) while the server keeps answering others. The kernel's buffers are kept
    small on both ends (loopback's would otherwise take megabytes), so the server's own buffer fills in seconds."""
    monkeypatch.setattr(streaming, "WRITE_STALL_S", 1.0)
    srv = InProcessServer(num_replicas=1, max_num_seqs=2)
    srv.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # accepted connections inherit it
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        sock.connect(("127.0.0.1", srv.port))
        body = {"prompt": [1, 2, 3], "max_tokens": 4000, "temperature": 0, "ignore_eos": True, "stream": True}
        data = json.dumps(body).encode()
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(data), data)
        )
        deadline = time.monotonic() + 5
        while not srv.state.pool.requests:  # it runs
            assert time.monotonic() < deadline
            time.sleep(0.01)
        (sub,) = srv.state.pool.requests.values()
        assert http_request(srv.port, "GET", "/health")[0] == 200  # others are served meanwhile
        assert srv.post("/v1/completions", {"prompt": "b", "max_tokens": 2})[0] == 200
        deadline = time.monotonic() + 60
        while srv.state.pool.requests:
            assert time.monotonic() < deadline, f"the stalled stream was not aborted ({sub.generated} tokens)"
            time.sleep(0.05)
        assert sub.generated < 4000  # ended by the abort, not by its length
        deadline = time.monotonic() + 10
        while any(e.has_work() for e in srv.engines):
            assert time.monotonic() < deadline, "the replica did not drop the aborted request"
            time.sleep(0.02)
        _, page, _ = srv.request("GET", "/metrics")
        assert 'afd_request_success_total{finished_reason="abort",replica="0"}' in page
    finally:
        sock.close()
        srv.close()


@pytest.mark.timeout(60)
def test_the_api_key_is_checked_before_any_body_is_read() -> None:
    """No `100 Continue`, no body read: a 401 with `WWW-Authenticate: Bearer` answers the head alone."""
    keyed = InProcessServer(num_replicas=1, api_key="sesame")
    try:
        head = (
            b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\n"
            b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % (60 << 20)
        )
        got, closed = exchange(keyed.port, head)
        assert got.startswith(b"HTTP/1.1 401 ") and closed, got[:300]
        assert b"100 Continue" not in got and b"www-authenticate: Bearer" in got.lower().replace(b"bearer", b"Bearer")
        right = {"Authorization": "Bearer sesame"}
        assert keyed.post("/v1/completions", {"prompt": "a", "max_tokens": 1}, headers=right)[0] == 200
    finally:
        keyed.close()


def test_the_api_key_stays_out_of_every_rank_environment(monkeypatch) -> None:
    from afd import env
    from afd.runtime.launch import rank_environment

    monkeypatch.setenv("AFD_API_KEY", "sesame")
    assert env.api_key() == "sesame"
    ranks = rank_environment("secret")
    assert "AFD_API_KEY" not in ranks and ranks["AFD_SECRET"] == "secret" and "AFD_API_KEY" not in env.child_environ()


@pytest.mark.timeout(60)
def test_openapi_schema_and_docs_come_from_the_models(server) -> None:
    status, schema, _ = server.request("GET", "/openapi.json")
    assert status == 200
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"} <= set(schema["paths"])
    assert {"CompletionRequest", "ChatCompletionRequest", "CompletionResponse"} <= set(schema["components"]["schemas"])
    status, page, _ = server.request("GET", "/docs")
    assert status == 200 and "swagger" in page.lower()
    status, got, _ = server.request("DELETE", "/v1/completions")
    assert status == 405 and got["error"]["type"] == "MethodNotAllowedError"


def test_serve_and_bench_without_their_packages_say_what_to_install(monkeypatch, capsys) -> None:
    from afd.cli import main as cli

    monkeypatch.setitem(sys.modules, "fastapi", None)  # as if not installed
    assert cli.main(["serve", "--model", MODEL]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "afd: error: afd serve needs fastapi: pip install 'afd[serve]'", err
    monkeypatch.setitem(sys.modules, "aiohttp", None)
    assert cli.main(["bench", "serve", "--url", "http://127.0.0.1:1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "afd: error: afd bench serve needs aiohttp: pip install 'afd[bench]'", err


@pytest.mark.timeout(60)
def test_a_client_that_leaves_before_a_whole_answer_aborts_its_request(server) -> None:
    """Not streamed: uvicorn does not cancel the route when its client goes; the route's watcher does."""
    sock = socket.create_connection(("127.0.0.1", server.port))
    data = json.dumps({"prompt": [1, 2, 3], "max_tokens": 3000, "temperature": 0, "ignore_eos": True}).encode()
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(data), data)
    )
    deadline = time.monotonic() + 10
    while not server.state.pool.requests:
        assert time.monotonic() < deadline, "the request did not start"
        time.sleep(0.01)
    sock.close()
    deadline = time.monotonic() + 10
    while server.state.pool.requests or any(e.has_work() for e in server.engines):
        assert time.monotonic() < deadline, "the request of a client that left was not aborted"
        time.sleep(0.02)
