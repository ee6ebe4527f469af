"""Ranks started by hand: an FFN rank without `--dtype` runs the attention rank's bfloat16 (it learns it at
rendezvous) and the tokens equal the bfloat16 reference, over p2p and async; one given another dtype stops
both ranks, saying so in one sentence."""

from __future__ import annotations

import json

import pytest
from helpers.e2e import Leftovers, afd_worker, hand_config, kill_all

from afd.engine.generate import generate
from afd.runtime.launch import free_port

PROMPT = [5, 17, 33, 2, 9]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("connector", ["p2p", "async"])
def test_ffn_rank_runs_the_attention_dtype(connector: str, tmp_path) -> None:
    config = hand_config(connector, 1, 1, port=free_port(), timeout_s=60)
    out = tmp_path / "out.json"
    leftovers = Leftovers()
    procs = [afd_worker(config, "ffn", 0)]
    procs.append(
        afd_worker(config, "attention", 0, "--dtype", "bfloat16", "--prompt-ids", "5,17,33,2,9", "--output", str(out))
    )
    try:
        logs = [p.communicate(timeout=90)[1] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], logs
        assert "torch.bfloat16" in logs[0]  # "FFN model loaded: ... torch.bfloat16"
        got = json.loads(out.read_text())["outputs"][0]["token_ids"]
        assert got == generate("tiny", [PROMPT], max_new_tokens=16, dtype="bfloat16")[0].token_ids
        leftovers.check()
    finally:
        kill_all(procs)
        leftovers.cleanup()


@pytest.mark.timeout(120)
def test_ffn_rank_given_another_dtype_is_refused() -> None:
    config = hand_config("async", 1, 1, port=free_port(), timeout_s=60)
    leftovers = Leftovers()
    procs = [afd_worker(config, "ffn", 0, "--dtype", "float32")]
    procs.append(afd_worker(config, "attention", 0, "--dtype", "bfloat16", "--prompt-ids", "1,2"))
    try:
        logs = [p.communicate(timeout=90)[1] for p in procs]
        assert procs[0].returncode == 1 and procs[1].returncode != 0, logs
        sentence = (
            "ffn rank 0 was started with --dtype float32 but the attention side runs bfloat16; leave --dtype out "
            "(an FFN rank takes the attention side's) or give bfloat16"
        )
        assert f"ffn rank 0: error: {sentence}" in logs[0]
        assert sentence in logs[1]  # the attention rank names the FFN rank's failure
        leftovers.check()
    finally:
        kill_all(procs)
        leftovers.cleanup()
