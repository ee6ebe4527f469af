"""Load and kills for the failure-isolation tests of `afd serve`: closed-loop clients that send greedy completions
(streamed or whole) and sort every answer into right / wrong / failed (a clean error) / hung, the ranks of a server
by role, and the wait for the server to be whole again after a kill."""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from helpers.e2e import kill_pids, worker_pids
from helpers.http_client import http_request


@dataclass
class Outcome:
    kind: str  # right | wrong | failed (ended with an error) | refused (503 + Retry-After, never started) | hung
    error: str = ""
    streamed: bool = False


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
        body = {"prompt": self.prompts[i], "max_tokens": self.max_tokens, "temperature": 0, "logprobs": 0,
                "return_tokens_as_token_ids": True, "ignore_eos": True, "stream": stream}  # fmt: skip
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
        if resp.status != 200:
            kind = "refused" if resp.status == 503 and resp.getheader("Retry-After") else "failed"
            return Outcome(kind, json.loads(raw)["error"]["message"], stream)
        if not stream:
            ids = [int(t.split(":")[1]) for t in json.loads(raw)["choices"][0]["logprobs"]["tokens"]]
            return Outcome("right" if ids == self.reference[i] else "wrong", streamed=False)
        events = [e[len("data: ") :] for e in raw.split("\n\n") if e.strip()]
        if events[-1] != "[DONE]":
            return Outcome("failed", "the stream did not end with [DONE]", True)
        ids = []
        for e in events[:-1]:
            got = json.loads(e)
            if "error" in got:
                return Outcome("failed", got["error"]["message"], True)
            logprobs = got["choices"][0]["logprobs"] if got.get("choices") else None
            ids += [int(t.split(":")[1]) for t in logprobs["tokens"]] if logprobs else []
        return Outcome("right" if ids == self.reference[i] else "wrong", streamed=True)


def _argv(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").replace("\0", " ").split()
    except OSError:
        return []


def rank_pids() -> dict[tuple[str, int], int]:
    """The current test's live ranks by (role, role rank): ("replica", 1), ("attention", 0), ("ffn", 0)."""
    found = {}
    for pid in worker_pids():
        argv = _argv(pid)
        if "--role" in argv and "--rank" in argv:
            found[(argv[argv.index("--role") + 1], int(argv[argv.index("--rank") + 1]))] = pid
    return found


def kill_rank(role: str, rank: int) -> int:
    """kill -9 that rank (its process group); its pid."""
    pid = rank_pids()[(role, rank)]
    kill_pids({pid})
    return pid


def health(port: int) -> dict:
    return http_request(port, "GET", "/health")[1]


def await_whole(port: int, restarts: int, timeout_s: float, since: float | None = None) -> float:
    """Until /health says ok with every replica alive and `restarts` restarts in all; seconds since `since`."""
    since = time.monotonic() if since is None else since
    deadline = since + timeout_s
    while True:
        got = health(port)
        if got["status"] == "ok" and sum(r["restarts"] for r in got["replicas"]) >= restarts:
            return time.monotonic() - since
        assert time.monotonic() < deadline, f"the server was not whole again within {timeout_s} s: {got}"
        time.sleep(0.05)


def random_rank(rng: random.Random) -> tuple[str, int]:
    return rng.choice(sorted(rank_pids()))
