"""Load and kills for the failure-isolation tests of `afd serve`, over the product's own pieces
(`afd.bench.chaos`: the request body, the sorting of answers, the ranks of a server, its health): closed-loop
clients that send greedy completions (streamed or whole) one after another, and the wait for the server to be
whole again after a kill."""

from __future__ import annotations

import http.client
import json
import threading
import time
from dataclasses import dataclass, field

from afd.bench import chaos
from afd.bench.chaos import Outcome, classify, request_body


@dataclass
class Load:
    """`clients` threads, each sending one request after another until `stop()`: prompt i of `prompts` with
    `max_tokens`, greedy, every other one streamed; the answer is compared with `reference[i]` (token ids)."""

    port: int
    prompts: list[list[int]]
    reference: list[list[int]]
    max_tokens: int
    clients: int = 4
    bound_s: float = 60.0  # a request that takes longer is hung
    outcomes: list[Outcome] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._client, args=(c,), daemon=True) for c in range(self.clients)]
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(self.bound_s + 10)
        assert not any(t.is_alive() for t in self._threads), "a client did not end"

    def count(self, kind: str) -> int:
        with self._lock:
            return sum(o.kind == kind for o in self.outcomes)

    def errors(self) -> list[str]:
        with self._lock:
            return [o.error for o in self.outcomes if o.kind == "failed"]

    def _client(self, c: int) -> None:
        n = 0
        while not self._stop.is_set():
            i = (c + n) % len(self.prompts)
            outcome = self._one(i, stream=(c + n) % 2 == 1)
            n += 1
            with self._lock:
                self.outcomes.append(outcome)
            if outcome.kind in ("failed", "refused"):
                time.sleep(0.05)  # a server without a serving replica answers at once: do not spin

    def _one(self, i: int, stream: bool) -> Outcome:
        body = request_body(self.prompts[i], self.max_tokens, stream)
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.bound_s)
        try:
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            raw = resp.read().decode()
        except TimeoutError:
            return Outcome("hung", streamed=stream)
        except (OSError, http.client.HTTPException) as exc:
            return Outcome("failed", f"connection: {exc}", stream)
        finally:
            conn.close()
        return classify(resp.status, resp.getheader("Retry-After"), raw, stream, self.reference[i])


def url(port: int) -> str:
    return f"http://127.0.0.1:{port}"


def health(port: int) -> dict:
    return chaos.health(url(port))


def await_whole(port: int, restarts: int, timeout_s: float, since: float | None = None) -> float:
    """Until /health says ok with every replica alive and `restarts` restarts in all; seconds since `since`."""
    healed_s = chaos.await_whole(url(port), restarts, timeout_s, since)
    assert healed_s is not None, f"the server was not whole again within {timeout_s} s: {health(port)}"
    return healed_s
