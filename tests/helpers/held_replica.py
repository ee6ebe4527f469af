"""An attention replica that a test serves by hand over the replica link (`afd worker --serve-address`): it stays
up, idle, until the test gives it work or ends it. A test that needs "this run is still going" makes it so this
way, instead of hoping the machine is slow enough."""

from __future__ import annotations

import subprocess
import time
from multiprocessing.connection import Connection

from afd.runtime.link import FrontLink


def accept_replica(link: FrontLink, replica: int, procs: list[subprocess.Popen], timeout_s: float = 120) -> Connection:
    """Wait for attention replica `replica` to connect to `link`; fail naming the ranks' exit codes if it does not."""
    try:
        link.accept(1, timeout_s)
    except Exception as exc:
        raise AssertionError(f"{exc}; exit codes {[p.poll() for p in procs]}") from None
    return link.conns[replica]


def serve_prompts(
    conn: Connection, prompts: list[list[int]], max_tokens: int, deadline: float, procs: list[subprocess.Popen]
) -> list[list[tuple[int, float]]]:
    """Send `prompts` to the replica and collect each one's (token, logprob) pairs until all finished by length."""
    rids = [f"r{i}" for i in range(len(prompts))]
    for rid, prompt in zip(rids, prompts, strict=True):
        conn.send({"type": "add", "rid": rid, "prompt_ids": prompt, "max_tokens": max_tokens, "sampling": {}})
    tokens: dict[str, list[tuple[int, float]]] = {rid: [] for rid in rids}
    left = set(rids)
    while left:
        assert time.monotonic() < deadline, (
            f"the replica did not finish its requests; exit codes {[p.poll() for p in procs]}"
        )
        if not conn.poll(0.2):
            continue
        msg = conn.recv()
        if msg["type"] == "tokens":
            for rid, token, logprob in msg["items"]:
                tokens[rid].append((token, logprob))
        elif msg["type"] == "finished":
            assert msg["reason"] == "length", msg
            left.discard(msg["rid"])
    return [tokens[rid] for rid in rids]


def assert_served_matches(got: list[list[tuple[int, float]]], want: list, tolerance: float) -> None:
    """Served (token, logprob) pairs against reference `Output`s: equal greedy tokens, logprobs within `tolerance`."""
    for pairs, ref in zip(got, want, strict=True):
        assert [t for t, _ in pairs] == ref.token_ids, "the served tokens differ from the reference engine"
        assert max(abs(a - b) for (_, a), b in zip(pairs, ref.logprobs, strict=True)) <= tolerance
