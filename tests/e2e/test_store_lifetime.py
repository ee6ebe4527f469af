"""The world store outlives every rank that needs it.

`async` ranks started by hand: world rank 0 (attention replica 0) hosts the store, finishes one prompt of one
token and leaves. Replica 1 serves a front end that this test plays: the test holds replica 1 idle until more
than 1.5 x `timeout_s` has passed since replica 0 finished, and only then gives it work. A store host that
left once that bound had passed after its own finish would take the store with it, and replica 1 and the FFN
rank would die with "the store host is unreachable". The situation is made here, not hoped for from the
machine's speed.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from helpers.e2e import MODEL, TOLERANCE, Leftovers, afd_worker, hand_config, kill_all
from helpers.held_replica import accept_replica, assert_served_matches, serve_prompts

from afd.engine.generate import generate
from afd.env import SECRET_VAR
from afd.runtime.launch import free_port, new_secret
from afd.runtime.link import FrontLink, format_address

TIMEOUT_S = 5  # a few seconds; rank start-up on 2 busy cores needs about that for the window bootstrap
LONG_PROMPTS = [[5, 6, 7], [8, 9]]
LONG_NEW_TOKENS = 40


def reference(prompts: list[list[int]], max_new_tokens: int):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks of other tests share 2 cores: oversubscribed threads are 6x slower
    try:
        return generate(MODEL, prompts, max_new_tokens=max_new_tokens)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.timeout(240)
def test_replica_that_finishes_first_keeps_the_store_for_the_others(tmp_path: Path, monkeypatch) -> None:
    secret = new_secret()
    monkeypatch.setenv(SECRET_VAR, secret)  # the ranks' store and replica 1's link are keyed with it
    link = FrontLink(secret.encode())
    config = hand_config("async", 2, 1, port=free_port(), timeout_s=TIMEOUT_S)
    out0 = tmp_path / "attn0.json"
    leftovers = Leftovers()
    procs = [
        afd_worker(config, "attention", 0, "--prompt-ids", "1,2,3", "--max-new-tokens", "1", "--output", str(out0)),
        afd_worker(config, "attention", 1, "--serve-address", format_address(link.address)),
        afd_worker(config, "ffn", 0),
    ]
    try:
        deadline = time.monotonic() + 180
        conn = accept_replica(link, 1, procs)
        while not out0.exists():  # replica 0 finished its prompt
            assert time.monotonic() < deadline, "replica 0 did not finish within 180 s"
            assert procs[0].poll() in (None, 0), procs[0].communicate()[1][-3000:]
            time.sleep(0.05)
        replica0_done = time.monotonic()
        hold_until = replica0_done + 1.5 * TIMEOUT_S  # past the bound on every wait since replica 0's finish
        while time.monotonic() < hold_until:
            assert all(p.poll() is None for p in procs[1:]), "replica 1 or the FFN rank left while replica 1 was idle"
            time.sleep(0.2)
        got = serve_prompts(conn, LONG_PROMPTS, LONG_NEW_TOKENS, deadline, procs)
        conn.send({"type": "shutdown"})
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        errs = [p.communicate()[1] for p in procs]
        for p, err in zip(procs, errs, strict=True):
            assert p.returncode == 0, err[-3000:]
        assert_served_matches(got, reference(LONG_PROMPTS, LONG_NEW_TOKENS), TOLERANCE)
        assert json.loads(out0.read_text())["outputs"][0]["token_ids"] == reference([[1, 2, 3]], 1)[0].token_ids
        leftovers.check()  # no rank and no /dev/shm segment of this run is left
    finally:
        kill_all(procs)
        link.close()
        leftovers.cleanup()
