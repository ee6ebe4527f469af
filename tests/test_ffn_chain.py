"""Device-driven FFN passes (`afd.connectors.ffn_chain`) on CPU, where `AFD_FFN_CHAIN=1` runs the same items
eagerly behind a host wait: real 1A1F async runs over shared memory equal the reference, serve most layers in
whole passes, hand a pass back to the host when the prediction breaks, and end cleanly when the attention rank
dies mid-pass (`tests/test_async_e2e.py`)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from e2e_util import MODEL, assert_matches_reference, hand_config, launch_checked
from test_async_e2e import reference, run_async, tokens, uneven_prompts

from afd.config import parse_config
from afd.generate import generate
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
    outputs, _ = launch_checked(
        "async", 1, 1, prompts, max_new_tokens=6, max_num_batched_tokens=2048, run_dir=tmp_path, max_num_seqs=1,
        recv_poll_timeout_ms=100,
    )  # fmt: skip
    assert_matches_reference(outputs, generate(MODEL, prompts, max_new_tokens=6, prompt_logprobs=True))
    on_device, handed_back = chain_counts(tmp_path)
    assert handed_back >= 2, "the prefills after 1-row decode steps must break the predicted bucket"
    assert on_device >= 30, f"only {on_device} items were served on the device"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_attn", [2, 3])
def test_several_replicas_each_get_their_passes(num_attn: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """nA1F, uneven replicas (one gets long prompts, one short ones, the third none): every replica's requests are
    served in passes of its own (on CUDA each on its own stream), and the outputs equal the reference."""
    monkeypatch.setenv("AFD_FFN_CHAIN", "1")
    prompts = uneven_prompts(num_attn)
    outputs, stats = run_async(num_attn, 1, prompts, run_dir=tmp_path)
    assert_matches_reference(outputs, reference(prompts))
    on_device, _ = chain_counts(tmp_path)
    busy = sum(1 for r in stats["replicas"] if r["num_steps"])
    assert on_device >= busy, f"only {on_device} items were served on the device for {busy} busy replicas"


@pytest.mark.timeout(120)
def test_off_by_default_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without AFD_FFN_CHAIN=1 a CPU FFN rank discovers every request from the host (the chain is a CUDA path)."""
    monkeypatch.delenv("AFD_FFN_CHAIN", raising=False)
    config = parse_config(hand_config("async", 1, 1, port=free_port(), recv_poll_timeout_ms=100))
    prompts = [[3, 1, 4], [1, 5]]
    outputs, _ = launch(config, RunSpec(model=MODEL, max_new_tokens=3, timeout_s=90), prompts, run_dir=tmp_path)
    assert len(outputs) == 2
    assert not DEVICE_LINE.search((tmp_path / "ffn0.log").read_text())


# ---------------------------------------------------------------- the kernels against their PyTorch steps
def _request(rows: int, shared: int, layer: int, seq: int, *, flags: int = 0, magic: int | None = None):
    from afd.connectors.wire import (
        HEADER_WORDS,
        MAGIC_WORD,
        VERSION,
        W_FLAGS,
        W_LAYER,
        W_MAGIC,
        W_ROWS,
        W_SEQ,
        W_SHARED,
        W_VERSION,
    )

    h = torch.zeros(HEADER_WORDS, dtype=torch.int32)
    h[W_MAGIC], h[W_VERSION], h[W_FLAGS], h[W_LAYER] = MAGIC_WORD if magic is None else magic, VERSION, flags, layer
    h[W_ROWS], h[W_SHARED], h[W_SEQ] = rows, shared, seq
    return h


CASES = {  # name: (header arguments, flag, abort): whether the item serves it follows
    "serves": (dict(rows=5, shared=5, layer=3, seq=7), 7, 0),
    "fewer shared rows": (dict(rows=6, shared=2, layer=3, seq=9), 9, 0),
    "other layer": (dict(rows=5, shared=5, layer=4, seq=7), 7, 0),
    "too many rows": (dict(rows=9, shared=9, layer=3, seq=7), 7, 0),
    "seq differs from flag": (dict(rows=5, shared=5, layer=3, seq=6), 7, 0),
    "a reply": (dict(rows=5, shared=5, layer=3, seq=7, flags=1), 7, 0),
    "bad magic": (dict(rows=5, shared=5, layer=3, seq=7, magic=12345), 7, 0),
    "aborted before": (dict(rows=5, shared=5, layer=3, seq=7), 7, 1),
    "flag not set": (dict(rows=5, shared=5, layer=3, seq=0), 0, 0),
}


SERVED = ("serves", "fewer shared rows")
OUTPUTS = ["ids", "mask", "ok", "out", "reply header", "flag", "stats", "reply flag"]


def run_steps(steps, case: str, dev: str) -> list[torch.Tensor]:  # noqa: ANN001
    """One item's three steps (PyTorch's or the kernels') on a request made for `case`; every output."""
    header_args, flag_value, abort = CASES[case]
    n, k, hidden = 8, 6, 48
    gen = torch.Generator().manual_seed(len(case))
    header = _request(**header_args).to(dev)
    topk_ids = torch.randint(0, 64, (12, k), generator=gen, dtype=torch.int32).to(dev)
    routed = torch.randn(n, hidden, generator=gen).to(dev)
    shared = torch.randn(n, hidden, generator=gen).to(dev, torch.bfloat16)
    flag = torch.tensor([flag_value], dtype=torch.int64, device=dev)
    stats = torch.tensor([abort, 4, 2], dtype=torch.int64, device=dev)
    ids = torch.full((n, k), 99, dtype=torch.int64, device=dev)
    mask = torch.full((n,), 7.0, device=dev)
    ok = torch.zeros(1, dtype=torch.int32, device=dev)
    out = torch.zeros(10, hidden, dtype=torch.bfloat16, device=dev)
    reply_header = torch.zeros_like(header)
    reply_flag = torch.tensor([3], dtype=torch.int64, device=dev)
    steps.check_request(header, flag, stats, topk_ids, 3, n, ids, mask, ok)
    steps.combine_reply(routed, shared, mask, out, header, reply_header)
    steps.finish_item(header, flag, stats, ok, reply_flag)
    return [ids, mask, ok, out, reply_header, flag, stats, reply_flag]


@pytest.mark.parametrize("case", list(CASES))
def test_pytorch_steps_serve_only_the_expected_request(case: str) -> None:
    """An item serves (flag reset to 0, reply flag = the request's seq, served + 1) only a request for its layer
    within its bucket whose header seq is the flag's, with nothing aborted before; otherwise it leaves the flag
    and the reply flag alone and sets the abort word. Rows past the count route nowhere."""
    from afd.connectors.ffn_chain import _TorchSteps

    ids, mask, ok, out, reply_header, flag, stats, reply_flag = run_steps(_TorchSteps(), case, "cpu")
    header_args, flag_value, abort = CASES[case]
    rows, shared = header_args["rows"], header_args["shared"]
    if case in SERVED:
        assert ok.item() == 1 and flag.item() == 0 and reply_flag.item() == flag_value
        assert stats.tolist() == [0, 5, max(2, rows)]
        assert reply_header[2].item() == 1 and reply_header[8].item() == header_args["seq"]  # response, echo
        assert (ids[rows:] == -1).all() and (ids[:rows] >= 0).all()
        assert mask.tolist() == [1.0] * shared + [0.0] * (8 - shared)
    else:
        assert ok.item() == 0 and flag.item() == flag_value and reply_flag.item() == 3
        assert stats[0].item() == 1 and stats[1].item() == 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", list(CASES))
def test_kernels_equal_the_pytorch_steps(case: str) -> None:
    """check_request / combine_reply / finish_item (Triton) leave every output and state word exactly as the
    PyTorch steps (the CPU path) do, for a request served and for each reason not to serve one."""
    from afd.connectors.ffn_chain import _TorchSteps
    from afd.kernels import chain

    want, got = run_steps(_TorchSteps(), case, "cuda"), run_steps(chain, case, "cuda")
    for name, a, b in zip(OUTPUTS, want, got, strict=True):
        assert torch.equal(a, b), f"{case}: {name} differs: {a} vs {b}"


# ---------------------------------------------------------------- on two GPUs: whole captured steps + device passes
@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_captured_steps_and_device_passes_equal_the_eager_exchange(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """async 1A1F on CUDA, fp32: decode steps captured whole (exchanges included) give the tokens and logprobs
    (within 1e-4) of the same run with pieces between eager exchanges (AFD_EXCHANGE_GRAPHS=0). The FFN rank serves
    from the host here: fp32 experts have no capture-safe path, so no device passes (bf16 runs them: `afd bench`)."""
    lens = [23, 2, 9, 1, 14, 5, 30, 3, 7]
    prompts = [tokens(n, i) for i, n in enumerate(lens)]
    spec = RunSpec(model=MODEL, dtype="float32", device="cuda", max_new_tokens=12, prompt_logprobs=True, timeout_s=300)
    runs = {}
    for mode in ("eager", "device"):
        for var in ("AFD_EXCHANGE_GRAPHS", "AFD_FFN_CHAIN"):
            if mode == "eager":
                monkeypatch.setenv(var, "0")
            else:
                monkeypatch.delenv(var, raising=False)
        config = parse_config(hand_config("async", 1, 1, port=free_port(), timeout_s=120))
        run_dir = tmp_path / mode
        runs[mode], _ = launch(config, spec, prompts, run_dir=run_dir)
        attention_log = (run_dir / "attention0.log").read_text()
        assert ("exchanges included" in attention_log) == (mode == "device"), attention_log[-2000:]
        assert "captured the decode CUDA graph" in attention_log and "decode runs eager" not in attention_log
    assert_matches_reference(runs["device"], runs["eager"])
