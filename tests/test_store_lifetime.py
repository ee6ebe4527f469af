"""The world store outlives every rank that needs it (issue 9's critical fault).

`async` ranks started by hand: world rank 0 (attention replica 0) hosts the store. Replica 0 gets one
prompt and one new token, replica 1 a long generation, and `timeout_s` is a few seconds: before the
fix, replica 0 left once that bound had passed after its own finish, taking the store with it, and
every rank still working died with "the store host is unreachable".
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from e2e_util import MODEL, TOLERANCE, Leftovers, afd_worker, hand_config, kill_all

from afd.generate import generate
from afd.runtime.launch import free_port

TIMEOUT_S = 5  # a few seconds; rank start-up on 2 busy cores needs about that for the window bootstrap
LONG_PROMPTS = [[5, 6, 7], [8, 9]]
LONG_NEW_TOKENS = 2000  # replica 1 keeps generating for well over TIMEOUT_S after replica 0 finished


def reference(prompts: list[list[int]], max_new_tokens: int):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks of other tests share 2 cores: oversubscribed threads are 6x slower
    try:
        return generate(MODEL, prompts, max_new_tokens=max_new_tokens)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.timeout(240)
def test_replica_that_finishes_first_keeps_the_store_for_the_others(tmp_path: Path) -> None:
    port = free_port()
    config = hand_config("async", 2, 1, port=port, timeout_s=TIMEOUT_S)
    out0, out1 = tmp_path / "attn0.json", tmp_path / "attn1.json"
    long_ids = ";".join(",".join(map(str, p)) for p in LONG_PROMPTS)
    leftovers = Leftovers()
    procs = [
        afd_worker(config, "attention", 0, "--prompt-ids", "1,2,3", "--max-new-tokens", "1", "--output", str(out0)),
        afd_worker(
            config, "attention", 1, "--prompt-ids", long_ids, "--max-new-tokens", str(LONG_NEW_TOKENS),
            "--output", str(out1),
        ),
        afd_worker(config, "ffn", 0),
    ]  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        replica0_done = None
        while any(p.poll() is None for p in procs):
            if replica0_done is None and out0.exists():
                replica0_done = time.monotonic()
            assert time.monotonic() < deadline, "the run did not end within 180 s"
            time.sleep(0.1)
        errs = [p.communicate()[1] for p in procs]
        for p, err in zip(procs, errs, strict=True):
            assert p.returncode == 0, err[-3000:]
        assert replica0_done is not None
        replica1_done = out1.stat().st_mtime - (time.time() - time.monotonic())
        # the scenario happened: replica 1 worked on for longer than the bound on every wait
        assert replica1_done - replica0_done > 1.5 * TIMEOUT_S, (replica0_done, replica1_done)
        got = json.loads(out1.read_text())["outputs"]
        want = reference(LONG_PROMPTS, LONG_NEW_TOKENS)
        for g, w in zip(got, want, strict=True):
            assert g["token_ids"] == w.token_ids, "replica 1's tokens differ from the reference engine"
            assert max(abs(a - b) for a, b in zip(g["logprobs"], w.logprobs, strict=True)) <= TOLERANCE
        leftovers.check()  # no rank and no /dev/shm segment of this run is left
    finally:
        kill_all(procs)
        leftovers.cleanup()
