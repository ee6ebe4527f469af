"""The benchmark's HTTP/1.1 client (`afd.bench.http1`) against a scripted local server: chunked, sized and
close-delimited bodies, line reassembly across chunks, connection reuse, a kept connection the server closed,
and protocol errors in one sentence."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import pytest

from afd.bench.http1 import Client, HTTPError

CHUNKED = (
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n8\r\ndata: a\n\r\n5\r\n\ndata\r\n4\r\n: c\n\r\n0\r\n\r\n"
)
SIZED = b"HTTP/1.1 404 Not Found\r\nContent-Length: 5\r\nContent-Type: text/plain\r\n\r\nnope!"
CLOSED = b"HTTP/1.1 200 OK\r\n\r\nuntil the end"


@asynccontextmanager
async def _scripted(answers: list[bytes], close_after: set[int] = frozenset()):
    """A server that answers request i with answers[i] (whatever the request), closing the connection after the
    answers in `close_after`; yields (a client of it, the requests it read, how many connections it accepted)."""
    requests: list[bytes] = []
    accepted = [0]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted[0] += 1
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:  # the client closed its kept connection
                return
            length = [int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.startswith(b"Content-Length")]
            body = await reader.readexactly(length[0]) if length else b""
            i = len(requests)
            requests.append(head + body)
            writer.write(answers[i])
            await writer.drain()
            if i in close_after or b"Content-Length" not in answers[i] and b"chunked" not in answers[i]:
                writer.close()
                return

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    client = Client(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/prefix")
    try:
        yield client, requests, accepted
    finally:
        await client.close()
        server.close()
        await server.wait_closed()


@pytest.mark.timeout(30)
def test_bodies_of_each_kind_and_one_connection_for_sequential_requests() -> None:
    async def main():
        async with _scripted([CHUNKED, SIZED, CHUNKED, CLOSED]) as (client, requests, accepted):
            await _each_kind(client, requests, accepted)

    async def _each_kind(client, requests, accepted):
        async with client.request("POST", "/v1/x", b'{"a":1}', {"Content-Type": "application/json"}) as resp:
            lines = [line async for line in resp.lines()]
        assert resp.status == 200 and lines == [b"data: a\n", b"\n", b"data: c\n"]  # lines cut across chunks
        async with client.request("GET", "/health") as resp:
            assert (resp.status, await resp.read()) == (404, b"nope!")
        async with client.request("GET", "/health") as resp:
            assert b"".join([c async for c in resp.chunks()]) == b"data: a\n\ndata: c\n"
        assert accepted[0] == 1  # kept alive across the three
        async with client.request("GET", "/health") as resp:
            assert await resp.read() == b"until the end"  # no length: the body ends with the connection
        assert not client._idle  # and that connection is not kept
        assert requests[0].startswith(b"POST /prefix/v1/x HTTP/1.1\r\nHost: 127.0.0.1:")
        assert b"Content-Length: 7\r\n" in requests[0] and requests[0].endswith(b'\r\n\r\n{"a":1}')

    asyncio.run(main())


@pytest.mark.timeout(30)
def test_a_kept_connection_the_server_closed_is_replaced_once() -> None:
    async def main():
        async with _scripted([SIZED, SIZED], close_after={0}) as (client, _, accepted):
            for _ in range(2):
                async with client.request("GET", "/health") as resp:
                    assert await resp.read() == b"nope!"
                await asyncio.sleep(0.05)  # the server's close arrives
            assert accepted[0] == 2

    asyncio.run(main())


@pytest.mark.timeout(30)
def test_protocol_errors_and_urls_in_one_sentence() -> None:
    async def main():
        async with _scripted([b"SMTP ready\r\n\r\n"]) as (client, _, _):
            with pytest.raises(HTTPError, match="did not answer with an HTTP/1.1 status line"):
                async with client.request("GET", "/health"):
                    pass

    asyncio.run(main())

    async def endless_header() -> None:  # a line that never ends is refused, not buffered without bound
        async with _scripted([b"HTTP/1.1 200 OK\r\nX-Long: " + b"a" * (100 << 10)]) as (client, _, _):
            with pytest.raises(HTTPError, match="a line of over 65536 bytes"):
                async with client.request("GET", "/health"):
                    pass

    asyncio.run(endless_header())
    for url in ("https://127.0.0.1:8000", "127.0.0.1:8000", "http://"):
        with pytest.raises(ValueError, match="plain http:// servers"):
            Client(url)
