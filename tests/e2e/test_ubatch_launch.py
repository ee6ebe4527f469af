"""Micro-batch ping-pong on the attention side, launched: runs with micro batches equal the reference."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers.ubatch_runs import launch_mixed_lengths

SHARED_TEST_TAG = True  # one zygote for the module's launches (tests/conftest.py)

# ---------------------------------------------------------------- launched runs

# topology and micro-batch count: both counts, every topology of the evidence, each once (runtime)
RUNS = [(1, 1, 2), (2, 2, 3), (3, 1, 2), (1, 3, 3)]


def ubatch_keys(connector: str, m: int) -> dict:
    """The launch options that turn on m micro-batches for `connector`."""
    if connector == "async":
        return {"recv_poll_timeout_ms": 100, "async_moe_ubatching": True, "async_moe_num_ubatches": m}
    return {"timeout_s": 60, "p2p_ubatching": True, "p2p_num_ubatches": m}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("connector", ["async", "p2p"])
@pytest.mark.parametrize("num_attn, num_ffn, m", RUNS, ids=[f"{a}A{f}F-m{m}" for a, f, m in RUNS])
def test_launched_micro_batches_equal_the_reference(
    connector: str, num_attn: int, num_ffn: int, m: int, tmp_path: Path
) -> None:
    """`afd launch` with micro-batching on (`async_moe_ubatching` / `p2p_ubatching`): every replica gets three
    prompts of different lengths and a 16-token budget, so its steps mix decodes and prompt chunks, its
    micro-batches differ from its peers' (and some steps are whole: one sequence left); p2p's DP wave stays in
    lockstep."""
    launch_mixed_lengths(connector, num_attn, num_ffn, tmp_path, **ubatch_keys(connector, m))
    for a in range(num_attn):  # each replica says how many of its steps ran as micro-batches
        log = (tmp_path / f"attention{a}.log").read_text()
        split = re.search(r"attention rank \d+: (\d+) of (\d+) steps ran as micro-batches", log)
        assert split and int(split[1]) > 0, f"replica {a} never split a step: {log[-2000:]}"
