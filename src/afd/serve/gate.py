"""What every request passes before FastAPI reads its body: the arrival stamp, the `Host` rule and the API key.

A pure ASGI layer outside the FastAPI application, so its refusals go out before any byte of a body is read (and
before `100 Continue`, which uvicorn sends only when the application first asks for the body): a 401 costs the
server the request's head only. It also catches what FastAPI re-raises after its own 500, so one failing request
is one line in the log and its connection stays usable.
"""

from __future__ import annotations

import hmac
import json
import logging
import time

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from afd.serve.protocol import APIError

logger = logging.getLogger(__name__)

ARRIVED = "afd.arrived"  # the scope key of the moment the request reached the application (`time.perf_counter()`)
OPEN_PATHS = ("/health", "/metrics")  # answered without the API key


async def send_error(send: Send, err: APIError, *, close: bool = False) -> None:
    """The OpenAI error object as a whole response (`close`: and the connection ends after it)."""
    body = json.dumps(err.body()).encode()  # ASCII: a lone surrogate in a message cannot break the encoding
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), str(v).encode()) for k, v in err.headers.items()]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _body_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    """The request's Content-Length; -1 for a chunked body (its length is not known up front), None for none."""
    for name, value in headers:
        if name == b"transfer-encoding":
            return -1
        if name == b"content-length":
            return int(value) if value.strip().isdigit() else None
    return None


class BodyTooLarge(HTTPException):
    """A body past the limit, found while it is read (FastAPI's handler for HTTPException answers 413)."""

    def __init__(self) -> None:
        super().__init__(413)


def _limited(receive: Receive, limit: int) -> Receive:
    """`receive` that raises BodyTooLarge once the body read passes `limit` bytes (a chunked body)."""
    read = 0

    async def receive_limited() -> Message:
        nonlocal read
        message = await receive()
        if message["type"] == "http.request":
            read += len(message.get("body", b""))
            if read > limit:
                raise BodyTooLarge
        return message

    return receive_limited


def body_too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes, more than --max-model-len allows")


class Gate:
    """The ASGI application uvicorn runs: checks a request's head, then hands it to FastAPI (`app`).

    - HTTP/1.1 needs exactly one `Host` header (RFC 9112 §3.2): otherwise 400, and the connection closes.
    - With an API key, every route but /health and /metrics needs `Authorization: Bearer KEY`: otherwise 401 with
      `WWW-Authenticate: Bearer`; a request that carries a body has its connection closed, unread.
    - A body over `max_body_bytes` is a 413 and its connection closes: at once when its Content-Length says so,
      else (chunked) as soon as what was read passes the limit.
    """

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope[ARRIVED] = time.perf_counter()
        headers = scope["headers"]
        if scope["http_version"] == "1.1" and sum(name == b"host" for name, _ in headers) != 1:
            err = APIError(400, "an HTTP/1.1 request must carry exactly one Host header")
            await send_error(send, err, close=True)
            return
        if self.expected is not None and scope["path"] not in OPEN_PATHS:
            given = next((value for name, value in headers if name == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):
                err = APIError(
                    401,
                    "the API key is missing or wrong; send the header Authorization: Bearer KEY",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await send_error(send, err, close=_body_length(headers) is not None)
                return
        length = _body_length(headers)
        if length is not None and length > self.max_body_bytes:
            await send_error(send, body_too_large(self.max_body_bytes), close=True)
            return
        if length == -1:
            receive = _limited(receive, self.max_body_bytes)
        try:
            await self.app(scope, receive, send)
        except Exception:  # FastAPI answered it with a 500 (if it could) and re-raised it: one line in the log
            logger.exception("unexpected error in %s %s", scope["method"], scope["path"])
