"""Micro-batch ping-pong over the p2p connector, launched: the CLI refuses a bad count in one sentence, and launched
runs (gloo on CPU, NCCL on GPUs) equal the reference."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.e2e import MODEL, assert_matches_reference

from afd.config import parse_config
from afd.engine.generate import generate


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 256) for _ in range(n)]  # the tiny preset's vocabulary


@pytest.mark.timeout(60)
def test_cli_refuses_a_bad_micro_batch_count_in_one_sentence() -> None:
    config = {"connector": "p2p", "connector_extra_config": {"p2p_ubatching": True, "p2p_num_ubatches": 1}}
    cmd = [sys.executable, "-m", "afd", "launch", "--connector", "p2p", "--config", json.dumps(config)]
    cmd += ["--model", "tiny", "--prompt-ids", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=50)
    assert proc.returncode == 2, proc.stderr
    assert "p2p_num_ubatches must be at least 2 when p2p_ubatching is true" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


# ---------------------------------------------------------------- launched runs

# The launched runs of every topology (1A1F, 2A2F, 3A1F, 1A3F) with 2 and 3 micro-batches, against the reference,
# are `tests/e2e/test_ubatch_launch.py`.


@pytest.mark.timeout(120)
def test_launched_p2p_with_micro_batches_and_the_gate_on_ffn_equals_the_reference(tmp_path: Path) -> None:
    """The gate on FFN: every layer crosses (dense ones too) and the FFN ranks route each micro-batch's rows;
    2A2F with 3 micro-batches, replica 1 holding a single prompt (whole steps beside replica 0's split ones)."""
    from afd.runtime.launch import free_port, launch
    from afd.runtime.spec import RunSpec

    config = parse_config(
        {
            "connector": "p2p",
            "num_attention_ranks": 2,
            "num_ffn_ranks": 2,
            "port": free_port(),
            "compute_gate_on_attention": False,
            "connector_extra_config": {"timeout_s": 60, "p2p_ubatching": True, "p2p_num_ubatches": 3},
        }
    )
    prompts = [tokens(11, 0), tokens(3, 1), tokens(6, 2)]  # prompt i goes to replica i % 2: replica 1 has one
    spec = RunSpec(model=MODEL, max_new_tokens=4, prompt_logprobs=True, timeout_s=90)
    outputs, _ = launch(config, spec, prompts, run_dir=tmp_path)
    reference = generate(MODEL, prompts, max_new_tokens=4, prompt_logprobs=True, gate_on_attention=False)
    assert_matches_reference(outputs, reference)
    split = [
        re.search(r"(\d+) of \d+ steps ran as micro-batches", (tmp_path / f"attention{a}.log").read_text())
        for a in (0, 1)
    ]
    assert split[0] and int(split[0][1]) > 0 and split[1] and int(split[1][1]) == 0


# ---------------------------------------------------------------- on the device


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_1a1f_with_micro_batches_equals_without(tmp_path: Path) -> None:
    """NCCL data plane (rows on `data`, answers on `back`), one GPU per rank, fp32, decode CUDA graphs on (their
    steps stay whole, in slot 0) beside split eager steps: 2 and 3 micro-batches give the tokens of the run without
    micro-batches and its logprobs within 1e-4; the gap to the CPU reference is printed."""
    from afd.runtime.launch import free_port, launch
    from afd.runtime.spec import RunSpec

    lens = [23, 2, 9, 1, 14, 5, 30, 3, 7]
    prompts = [tokens(n, i) for i, n in enumerate(lens)]
    spec = RunSpec(
        model=MODEL, dtype="float32", device="cuda", max_new_tokens=6, prompt_logprobs=True,
        max_num_batched_tokens=32, timeout_s=300,
    )  # fmt: skip
    runs = {}
    for m in (1, 2, 3):
        extra = {"timeout_s": 120} | ({"p2p_ubatching": True, "p2p_num_ubatches": m} if m > 1 else {})
        config = parse_config({"connector": "p2p", "port": free_port(), "connector_extra_config": extra})
        run_dir = tmp_path / f"m{m}"
        runs[m], _ = launch(config, spec, prompts, run_dir=run_dir)
        if m > 1:
            split = re.search(r"(\d+) of \d+ steps ran as micro-batches", (run_dir / "attention0.log").read_text())
            assert split and int(split[1]) > 0
    for m in (2, 3):
        assert_matches_reference(runs[m], runs[1])
    cpu = generate(MODEL, prompts, max_new_tokens=6, prompt_logprobs=True, max_num_batched_tokens=32)
    gap = max(
        abs(a - b) for g, w in zip(runs[3], cpu, strict=True) for a, b in zip(g.logprobs, w.logprobs, strict=False)
    )
    print(f"p2p m=3 on CUDA fp32 vs the CPU reference: largest |dlogprob| {gap:.3g}")
