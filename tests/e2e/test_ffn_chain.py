"""Device-driven FFN passes (`asynchronous.ffn_chain`) on CPU, where `connector_extra_config.cpu_device_passes`
runs the same items eagerly behind a host wait: real 1A1F async runs over shared memory equal the reference, serve
most layers in whole passes, hand a pass back to the host when the prediction breaks, and end cleanly when the
attention rank dies mid-pass (`tests/e2e/test_async_e2e.py`)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from helpers.async_runs import tokens
from helpers.e2e import MODEL, assert_matches_reference, hand_config, launch_checked

from afd.config import parse_config
from afd.engine.generate import generate
from afd.runtime.launch import free_port, launch
from afd.runtime.spec import RunSpec

SHARED_TEST_TAG = True  # one zygote for the module's launches (tests/conftest.py)

DEVICE_LINE = re.compile(r"(\d+) work items served on the device in whole passes, (\d+) passes handed back")


def chain_counts(run_dir: Path) -> tuple[int, int]:
    """(items served on the device, passes handed back to the host) from the FFN rank's log."""
    found = DEVICE_LINE.search((run_dir / "ffn0.log").read_text())
    assert found, "the FFN rank did not serve passes on the device"
    return int(found[1]), int(found[2])


@pytest.mark.timeout(120)
def test_one_sequence_at_a_time_grows_and_shrinks_the_rows(tmp_path: Path) -> None:
    """max_num_seqs=1: each prompt's prefill (20-30 rows) follows decode steps of 1 row, so a pass queued at the
    decode bucket meets a prefill it cannot hold: it is handed back, the host serves that request and starts over.
    Every token and logprob still equals the single-process reference."""
    prompts = [tokens(30, 1), tokens(20, 2), [5, 9]]
    outputs, _ = launch_checked(
        "async", 1, 1, prompts, max_new_tokens=6, max_num_batched_tokens=2048, run_dir=tmp_path, max_num_seqs=1,
        recv_poll_timeout_ms=100, cpu_device_passes=True,
    )  # fmt: skip
    assert_matches_reference(outputs, generate(MODEL, prompts, max_new_tokens=6, prompt_logprobs=True))
    on_device, handed_back = chain_counts(tmp_path)
    assert handed_back >= 2, "the prefills after 1-row decode steps must break the predicted bucket"
    assert on_device >= 30, f"only {on_device} items were served on the device"


@pytest.mark.timeout(120)
def test_off_by_default_on_cpu(tmp_path: Path) -> None:
    """Without `cpu_device_passes` a CPU FFN rank discovers every request from the host (the chain is a CUDA path)."""
    config = parse_config(hand_config("async", 1, 1, port=free_port(), recv_poll_timeout_ms=100))
    prompts = [[3, 1, 4], [1, 5]]
    outputs, _ = launch(config, RunSpec(model=MODEL, max_new_tokens=3, timeout_s=90), prompts, run_dir=tmp_path)
    assert len(outputs) == 2
    assert not DEVICE_LINE.search((tmp_path / "ffn0.log").read_text())


# ---------------------------------------------------------------- on two GPUs: whole captured steps + device passes
@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_captured_steps_equal_the_reference(tmp_path: Path) -> None:
    """async 1A1F on CUDA, fp32: decode steps captured whole (exchanges included) give the tokens and logprobs
    (within 1e-4) of the single-process reference on CUDA. The FFN rank serves from the host here: fp32 experts
    have no capture-safe path, so no device passes (bf16 runs them: `afd bench`)."""
    lens = [23, 2, 9, 1, 14, 5, 30, 3, 7]
    prompts = [tokens(n, i) for i, n in enumerate(lens)]
    spec = RunSpec(model=MODEL, dtype="float32", device="cuda", max_new_tokens=12, prompt_logprobs=True, timeout_s=300)
    config = parse_config(hand_config("async", 1, 1, port=free_port(), timeout_s=120))
    outputs, _ = launch(config, spec, prompts, run_dir=tmp_path)
    attention_log = (tmp_path / "attention0.log").read_text()
    assert "exchanges included" in attention_log, attention_log[-2000:]
    assert "captured the decode CUDA graph" in attention_log and "decode runs eager" not in attention_log
    want = generate(MODEL, prompts, max_new_tokens=12, prompt_logprobs=True, dtype="float32", device="cuda")
    assert_matches_reference(outputs, want)
