"""`afd bench serve --chaos`: a server's ranks killed with -9 under load, and what that costs.

Under Poisson load, a random rank of the server (found by its `--launcher-pid`) is killed every `interval_s`
seconds, each time once the server is whole again (`/health` "ok", every replica alive, one restart more), so
every kill's time to heal is its own. Every answer is sorted (`classify`): right (the reference's greedy
tokens), wrong, failed (a clean error), refused (503 with Retry-After: no replica served, nothing started) or
hung (no answer within its bound). A failure whose error names no killed rank is `stray`: a request that was
not on a killed rank and still failed. When the tool started the server it also checks, after the stop, that
no rank and no shared-memory segment of it is left.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import random
import signal
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from afd.transport.shm import SEGMENT_PREFIX

logger = logging.getLogger(__name__)

HEALTH_POLL_S = 0.05


@dataclass
class Outcome:
    """One request's end. `kind`: right | wrong | unchecked (completed, no reference) | failed | refused | hung."""

    kind: str
    error: str = ""
    streamed: bool = False
    token_ids: list[int] | None = None


def request_body(prompt: list[int], max_tokens: int, stream: bool) -> dict:
    """A greedy `/v1/completions` body whose answer carries its token ids (`token_id:N` logprob tokens)."""
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 0,
            "return_tokens_as_token_ids": True, "ignore_eos": True, "stream": stream}  # fmt: skip


def _ids(logprobs: dict | None) -> list[int]:
    return [int(t.split(":")[1]) for t in logprobs["tokens"]] if logprobs else []


def classify(status: int, retry_after: str | None, raw: str, stream: bool, expected: list[int] | None) -> Outcome:
    """Sort one whole answer (its HTTP status, Retry-After header and body) against the `expected` token ids."""
    try:
        if status != 200:
            kind = "refused" if status == 503 and retry_after else "failed"
            return Outcome(kind, json.loads(raw)["error"]["message"], stream)
        if not stream:
            ids = _ids(json.loads(raw)["choices"][0]["logprobs"])
        else:
            events = [e[len("data: ") :] for e in raw.split("\n\n") if e.strip()]
            if not events or events[-1] != "[DONE]":
                return Outcome("failed", "the stream did not end with [DONE]", True)
            ids = []
            for event in events[:-1]:
                got = json.loads(event)
                if "error" in got:
                    return Outcome("failed", got["error"]["message"], True)
                ids += _ids(got["choices"][0]["logprobs"]) if got.get("choices") else []
    except (ValueError, KeyError, IndexError, TypeError):
        return Outcome("failed", f"HTTP {status}, an answer that does not parse: {raw[:200]!r}", stream)
    kind = "unchecked" if expected is None else "right" if ids == expected else "wrong"
    return Outcome(kind, streamed=stream, token_ids=ids)


# ---------------------------------------------------------------- the server's ranks
def _argv(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").replace("\0", " ").split()
    except OSError:
        return []


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv[:-1] else None


def rank_pids(server_pid: int) -> dict[tuple[str, int], int]:
    """The live ranks of the server process `server_pid` by (role, role rank): ("replica", 1), ("ffn", 0)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        argv = _argv(int(entry.name))
        if _flag(argv, "--launcher-pid") == str(server_pid) and "--role" in argv and "--rank" in argv:
            found[(_flag(argv, "--role"), int(_flag(argv, "--rank")))] = int(entry.name)
    return found


def run_tokens(server_pid: int) -> set[str]:
    """The run tokens (shared-memory names) of the server's live ranks."""
    tokens = set()
    for pid in rank_pids(server_pid).values():
        token = _flag(_argv(pid), "--run-token")
        tokens |= {token} if token else set()
    return tokens


def server_pid_of(port: int) -> int | None:
    """The pid of the process on this host that listens on TCP `port` (the server behind `--url`), or None."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f"socket:[{cols[9]}]")
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if any(os.readlink(fd) in inodes for fd in (entry / "fd").iterdir()):
                    return int(entry.name)
            except OSError:
                continue
    return None


def rank_name(role: str, rank: int) -> str:
    """A rank as the server names it: 'replica 1', 'ffn rank 0'."""
    return f"replica {rank}" if role == "replica" else f"{role} rank {rank}"


def names_rank(error: str, name: str) -> bool:
    """Whether a request's error says that rank `name` (`rank_name`) died: 'replica 1 exited ...',
    'ffn rank 0 (world rank 2) exited ...'."""
    return f"{name} exited" in error or f"{name} (world rank" in error


def kill_rank(server_pid: int, role: str, rank: int) -> int:
    """kill -9 that rank's process group (a rank is its own); its pid."""
    pid = rank_pids(server_pid)[(role, rank)]
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return pid


def leftovers(server_pid: int, tokens: set[str]) -> dict[str, list]:
    """After the server stopped: its ranks still alive and its shared-memory segments still there."""
    segments = [p for t in tokens for p in glob.glob(f"/dev/shm/{SEGMENT_PREFIX}{t}_*")]
    return {"processes": sorted(rank_pids(server_pid).values()), "segments": sorted(segments)}


# ---------------------------------------------------------------- health
def health(url: str) -> dict:
    """`GET /health`'s JSON body (also on 503); {"status": "unreachable"} when the server does not answer."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return json.loads(exc.read())
    except (OSError, ValueError):
        return {"status": "unreachable", "replicas": []}


def total_restarts(got: dict) -> int:
    return sum(r["restarts"] for r in got.get("replicas", []))


def await_whole(url: str, restarts: int, timeout_s: float, since: float | None = None) -> float | None:
    """Seconds since `since` until /health says ok with every replica alive and at least `restarts` restarts in
    all; None when that did not happen within `timeout_s`."""
    since = time.monotonic() if since is None else since
    while True:
        got = health(url)
        whole = got["status"] == "ok" and all(r["alive"] for r in got["replicas"])
        if whole and total_restarts(got) >= restarts:
            return time.monotonic() - since
        if time.monotonic() > since + timeout_s:
            logger.warning("the server was not whole again within %g s: %s", timeout_s, got)
            return None
        time.sleep(HEALTH_POLL_S)


@dataclass
class Kill:
    """One kill: the rank (`rank_name`), when (seconds since the chaos began), and its time to heal."""

    rank: str
    at_s: float
    heal_s: float | None  # None: not whole again within the bound


def kill_loop(url: str, server_pid: int, seconds: float, interval_s: float, rng: random.Random,
              heal_bound_s: float, stop: threading.Event | None = None) -> list[Kill]:  # fmt: skip
    """For `seconds`: wait `interval_s`, kill a random rank, wait until the server is whole again; the kills."""
    stop = stop or threading.Event()
    start, kills = time.monotonic(), []
    while not stop.wait(interval_s) and time.monotonic() + interval_s / 2 < start + seconds:
        ranks = sorted(rank_pids(server_pid))
        if not ranks:
            logger.warning("the server (pid %d) has no rank to kill", server_pid)
            continue
        restarts = total_restarts(health(url))
        role, rank = rng.choice(ranks)
        killed = time.monotonic()
        pid = kill_rank(server_pid, role, rank)
        heal_s = await_whole(url, restarts + 1, heal_bound_s, since=killed)
        kills.append(Kill(rank_name(role, rank), killed - start, heal_s))
        logger.info("killed %s (pid %d): whole again after %s s", kills[-1].rank, pid, heal_s)
    return kills
