"""Device-driven FFN passes (`afd.connectors.ffn_chain`) on CPU, where `AFD_FFN_CHAIN=1` runs the same items
eagerly behind a host wait: real 1A1F async runs over shared memory equal the reference, serve most layers in
whole passes, hand a pass back to the host when the prediction breaks, and end cleanly when the attention rank
dies mid-pass."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
from e2e_util import MODEL, Leftovers, afd_worker, assert_matches_reference, hand_config, kill_all, wait_until_mapped
from test_async_e2e import tokens

from afd.config import parse_config
from afd.generate import generate
from afd.kv_cache import CacheOptions
from afd.runtime.launch import RunSpec, free_port, launch

DEVICE_LINE = re.compile(r"(\d+) work items served on the device in whole passes, (\d+) passes handed back")


def chain_counts(run_dir: Path) -> tuple[int, int]:
    """(items served on the device, passes handed back to the host) from the FFN rank's log."""
    found = DEVICE_LINE.search((run_dir / "ffn0.log").read_text())
    assert found, "the FFN rank did not serve passes on the device"
    return int(found[1]), int(found[2])


@pytest.mark.timeout(120)
def test_one_sequence_at_a_time_grows_and_shrinks_the_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """max_num_seqs=1: each prompt's prefill (20-30 rows) follows decode steps of 1 row, so a pass queued at the
    decode bucket meets a prefill it cannot hold: it is handed back, the host serves that request and starts over.
    Every token and logprob still equals the single-process reference."""
    monkeypatch.setenv("AFD_FFN_CHAIN", "1")
    prompts = [tokens(30, 1), tokens(20, 2), [5, 9]]
    config = parse_config(hand_config("async", 1, 1, port=free_port(), recv_poll_timeout_ms=100))
    spec = RunSpec(
        model=MODEL, dtype="float32", max_new_tokens=6, prompt_logprobs=True, timeout_s=90,
        cache=CacheOptions(max_num_seqs=1),
    )  # fmt: skip
    leftovers = Leftovers()
    try:
        outputs, _ = launch(config, spec, prompts, run_dir=tmp_path)
        leftovers.check()
    finally:
        leftovers.cleanup()
    assert_matches_reference(outputs, generate(MODEL, prompts, max_new_tokens=6, prompt_logprobs=True))
    on_device, handed_back = chain_counts(tmp_path)
    assert handed_back >= 2, "the prefills after 1-row decode steps must break the predicted bucket"
    assert on_device >= 30, f"only {on_device} items were served on the device"


@pytest.mark.timeout(120)
def test_off_by_default_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without AFD_FFN_CHAIN=1 a CPU FFN rank discovers every request from the host (the chain is a CUDA path)."""
    monkeypatch.delenv("AFD_FFN_CHAIN", raising=False)
    config = parse_config(hand_config("async", 1, 1, port=free_port(), recv_poll_timeout_ms=100))
    prompts = [[3, 1, 4], [1, 5]]
    outputs, _ = launch(config, RunSpec(model=MODEL, max_new_tokens=3, timeout_s=90), prompts, run_dir=tmp_path)
    assert len(outputs) == 2
    assert not DEVICE_LINE.search((tmp_path / "ffn0.log").read_text())


@pytest.mark.timeout(100)
def test_attention_killed_while_passes_are_queued(monkeypatch: pytest.MonkeyPatch) -> None:
    """An FFN rank waiting in a queued pass notices its attention rank died, exits non-zero naming it, in bounded
    time, and unlinks its window."""
    monkeypatch.setenv("AFD_FFN_CHAIN", "1")
    config = hand_config("async", 1, 1, port=free_port(), recv_poll_timeout_ms=100)
    leftovers = Leftovers()
    ffn = afd_worker(config, "ffn", 0)
    attn = afd_worker(config, "attention", 0, "--prompt-ids", "1,2,3", "--max-new-tokens", "4000")
    try:
        wait_until_mapped({ffn.pid, attn.pid}, 2, [ffn, attn])
        time.sleep(1.0)
        assert attn.poll() is None, "the attention rank ended before the kill"
        killed = time.monotonic()
        os.kill(attn.pid, signal.SIGKILL)
        _, err = ffn.communicate(timeout=20)
        assert time.monotonic() - killed < 20
        assert ffn.returncode != 0
        assert "attention rank 0" in err and "died" in err and "Traceback" not in err, err
        assert not leftovers.new_segments(), f"segments left behind: {sorted(leftovers.new_segments())}"
    finally:
        kill_all([ffn, attn])
        leftovers.cleanup()
