"""Shared experts on the attention rank, launched: runs equal the reference, and the CLI reads the connector and the
default place of the shared experts as documented."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.e2e import MODEL
from helpers.ubatch_runs import launch_mixed_lengths

from afd.engine.generate import generate

KEY = "shared_experts_on_attention"
SHARED_TEST_TAG = True  # one zygote for the module's launches (tests/conftest.py)


# ---------------------------------------------------------------- launched


RUNS = [(1, 1, 1), (2, 2, 2), (1, 3, 1), (3, 1, 2)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_attn, num_ffn, m", RUNS, ids=[f"{a}A{f}F-m{m}" for a, f, m in RUNS])
def test_launched_runs_with_shared_experts_here_equal_the_reference(
    num_attn: int, num_ffn: int, m: int, tmp_path: Path
) -> None:
    ubatching = {"async_moe_ubatching": True, "async_moe_num_ubatches": m} if m > 1 else {}
    launch_mixed_lengths("async", num_attn, num_ffn, tmp_path, recv_poll_timeout_ms=100, **{KEY: True}, **ubatching)
    for a in range(num_attn):
        log = (tmp_path / f"attention{a}.log").read_text()
        assert "shared experts run here" in log, log[-2000:]


@pytest.mark.timeout(120)
def test_cli_reads_a_config_without_a_connector_as_the_flags_connector(tmp_path: Path) -> None:
    """`--connector async --config '{"connector_extra_config": {...}}'`: the keys are async's (they were checked as
    p2p's, and refused), and the launch equals the reference."""
    config = {"connector_extra_config": {KEY: True, "async_moe_ubatching": True, "recv_poll_timeout_ms": 100}}
    args = ["--model", "tiny", "--prompt-ids", "5,17,33,2,9;4,8", "--max-new-tokens", "4", "--prompt-logprobs"]
    cmd = [sys.executable, "-m", "afd", "launch", "--connector", "async", "--config", json.dumps(config), *args]
    proc = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=100, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)["outputs"]
    want = generate(MODEL, [[5, 17, 33, 2, 9], [4, 8]], max_new_tokens=4, prompt_logprobs=True)
    assert [o["token_ids"] for o in got] == [o.token_ids for o in want]
    for o, w in zip(got, want, strict=True):
        assert max(abs(a - b) for a, b in zip(o["logprobs"], w.logprobs, strict=True)) < 1e-4
    as_p2p = [*cmd[:5], "p2p", *cmd[6:]]  # the same keys under p2p: one sentence, exit 2
    p2p = subprocess.run(as_p2p, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert p2p.returncode == 2 and "in connector_extra_config for p2p" in p2p.stderr and "Traceback" not in p2p.stderr


@pytest.mark.timeout(120)
def test_cli_puts_the_shared_experts_on_the_attention_ranks_by_default(tmp_path: Path) -> None:
    """`afd launch --connector async` (no flag): the attention rank runs them (its log says so) and the outputs
    equal the reference; `--shared-experts attention` with another connector: one sentence and exit 2 before
    anything starts."""
    args = ["--model", "tiny", "--prompt-ids", "5,17,33,2,9;4,8", "--max-new-tokens", "4", "--prompt-logprobs"]
    cmd = [sys.executable, "-m", "afd", "launch", "--connector", "async", "--shared-experts", "attention", *args]
    verbose = [*cmd[:3], "-v", *cmd[3:6], *args, "--json"]  # -v: every rank's log lines on stderr; no flag
    proc = subprocess.run(verbose, capture_output=True, text=True, timeout=100, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "shared experts run here" in proc.stderr
    got = [o["token_ids"] for o in json.loads(proc.stdout)["outputs"]]
    assert got == [o.token_ids for o in generate(MODEL, [[5, 17, 33, 2, 9], [4, 8]], max_new_tokens=4)]
    for connector in ("p2p", "none"):
        bad = subprocess.run([*cmd[:5], connector, *cmd[6:]], capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert bad.returncode == 2 and "--shared-experts attention needs --connector async" in bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr
