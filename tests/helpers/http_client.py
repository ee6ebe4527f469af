"""A small HTTP client for the OpenAI-style routes of `afd serve`: one request, the events of a stream, and the
token ids of a choice. Used by the in-process server tests and the e2e ones alike."""

from __future__ import annotations

import http.client
import json
from email.message import Message


def http_request(port: int, method: str, path: str, body=None, headers=None) -> tuple[int, dict | str, Message]:
    """(status, JSON body or text, headers: names in any case) of one request to 127.0.0.1:port."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    raw = resp.read().decode()
    conn.close()
    try:
        payload = json.loads(raw)
    except ValueError:
        payload = raw
    return resp.status, payload, resp.headers


def sse_events(port: int, path: str, body: dict) -> list[dict | str]:
    """Every server-sent event of a streamed response: JSON objects, then '[DONE]'."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", path, body=json.dumps({**body, "stream": True}), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type", "").startswith("text/event-stream")
    events = []
    for raw in resp.read().decode().split("\n\n"):
        if raw.strip():
            assert raw.startswith("data: ")
            data = raw[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    conn.close()
    return events


def token_ids(choice: dict) -> list[int]:
    """The generated ids of a choice asked with `logprobs` and `return_tokens_as_token_ids`."""
    return [int(t.split(":")[1]) for t in choice["logprobs"]["tokens"]]
