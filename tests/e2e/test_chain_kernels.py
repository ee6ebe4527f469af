"""The device-driven exchange's kernels (`asynchronous.chain_kernels`) against their PyTorch steps and the wire.

On a GPU they run as compiled; on CPU through Triton's interpreter (`TRITON_INTERPRET=1`, in a process of its own:
the variable is read when the kernels are defined), so their flag and header logic is checked without a GPU.
The interpreter has no bf16 of its own, so its bf16 rows may differ from PyTorch's rounding by one unit in the last
place: there, and only there, rows are compared within that.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from afd.connectors.asynchronous import wire

HERE = Path(__file__).resolve().parent


def _request(rows: int, shared: int, layer: int, seq: int, *, flags: int = 0, magic: int | None = None):
    h = torch.zeros(wire.HEADER_WORDS, dtype=torch.int32)
    h[wire.W_MAGIC] = wire.MAGIC_WORD if magic is None else magic
    h[wire.W_VERSION], h[wire.W_FLAGS], h[wire.W_LAYER] = wire.VERSION, flags, layer
    h[wire.W_ROWS], h[wire.W_SHARED], h[wire.W_SEQ] = rows, shared, seq
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
OUTPUTS = ["ids", "mask", "ok", "out", "reply header", "flag", "stats", "reply flag", "arrive"]


def run_steps(steps, case: str, dev: str, *, with_shared: bool = True) -> list[torch.Tensor]:  # noqa: ANN001
    """One item's two steps (PyTorch's or the kernels') on a request made for `case`; every output."""
    header_args, flag_value, abort = CASES[case]
    n, k, hidden = 8, 6, 48
    gen = torch.Generator().manual_seed(len(case))
    header = _request(**header_args).to(dev)
    topk_ids = torch.randint(0, 64, (12, k), generator=gen, dtype=torch.int32).to(dev)
    routed = torch.randn(n, hidden, generator=gen).to(dev)
    shared = torch.randn(n, hidden, generator=gen).to(dev, torch.bfloat16) if with_shared else None
    flag = torch.tensor([flag_value], dtype=torch.int64, device=dev)
    stats = torch.tensor([abort, 4, 2], dtype=torch.int64, device=dev)
    ids = torch.full((n, k), 99, dtype=torch.int64, device=dev)
    mask = torch.full((n,), 7.0, device=dev)
    ok = torch.zeros(1, dtype=torch.int32, device=dev)
    out = torch.zeros(10, hidden, dtype=torch.bfloat16, device=dev)
    reply_header = torch.zeros_like(header)
    reply_flag = torch.tensor([3], dtype=torch.int64, device=dev)
    arrive = torch.zeros(1, dtype=torch.int32, device=dev)
    steps.check_request(header, flag, stats, topk_ids, 3, n, ids, mask, ok)
    steps.reply_item(routed, shared, mask, out, header, reply_header, flag, stats, ok, reply_flag, arrive)
    return [ids, mask, ok, out, reply_header, flag, stats, reply_flag, arrive]


def assert_rows_equal(a: torch.Tensor, b: torch.Tensor, what: str, *, one_ulp: bool) -> None:
    if one_ulp and a.dtype == torch.bfloat16:  # the interpreter's bf16 rounding (see the module's docstring)
        torch.testing.assert_close(b, a, rtol=2**-7, atol=1e-6, msg=what)
    else:
        assert torch.equal(a, b), f"{what}: {a} vs {b}"


@pytest.mark.parametrize("case", list(CASES))
def test_pytorch_steps_serve_only_the_expected_request(case: str) -> None:
    """An item serves (flag reset to 0, reply flag = the request's seq, served + 1) only a request for its layer
    within its bucket whose header seq is the flag's, with nothing aborted before; otherwise it leaves the flag
    and the reply flag alone and sets the abort word. Rows past the count route nowhere."""
    from afd.connectors.asynchronous.ffn_chain import _TorchSteps

    ids, mask, ok, out, reply_header, flag, stats, reply_flag, _ = run_steps(_TorchSteps(), case, "cpu")
    header_args, flag_value, abort = CASES[case]
    rows, shared = header_args["rows"], header_args["shared"]
    if case in SERVED:
        assert ok.item() == 1 and flag.item() == 0 and reply_flag.item() == flag_value
        assert stats.tolist() == [0, 5, max(2, rows)]
        assert reply_header[2].item() == 1 and reply_header[8].item() == header_args["seq"]  # response, echo
        assert (ids[rows:] == -1).all() and (ids[:rows] >= 0).all()
        assert mask.tolist() == [1.0] * shared + [0.0] * (8 - shared)
        assert (out[:rows] != 0).any(dim=1).all() and (out[rows:] == 0).all()  # the bucket's padding: unwritten
    else:
        assert ok.item() == 0 and flag.item() == flag_value and reply_flag.item() == 3
        assert stats[0].item() == 1 and stats[1].item() == 4


def check_ffn_kernels(dev: str) -> None:
    """check_request / reply_item (Triton) leave every output and state word as the PyTorch steps (the CPU path)
    do, for a request served and for each reason not to serve one, with and without shared experts."""
    from afd.connectors.asynchronous import chain_kernels as chain
    from afd.connectors.asynchronous.ffn_chain import _TorchSteps

    for case in CASES:
        for with_shared in (True, False):
            want = run_steps(_TorchSteps(), case, dev, with_shared=with_shared)
            got = run_steps(chain, case, dev, with_shared=with_shared)
            for name, a, b in zip(OUTPUTS, want, got, strict=True):
                assert_rows_equal(a, b, f"{case} (shared {with_shared}): {name}", one_ulp=dev == "cpu")


def check_send_kernel(dev: str) -> None:
    """send_request copies the rows (any row stride), ids (to int32) and weights into the slot, leaves the rows
    past T alone, takes the next seq and writes the header and the flag; its arrival count is 0 again after."""
    from afd.connectors.asynchronous import chain_kernels as chain

    hidden, k, cap = 40, 6, 12
    for num_tokens, shared_on_ffn, stride in ((1, True, hidden), (5, False, hidden), (7, True, hidden + 8)):
        gen = torch.Generator().manual_seed(num_tokens)
        base = torch.randn(num_tokens, stride, generator=gen).to(dev, torch.bfloat16)
        x = base[:, :hidden]
        ids = torch.randint(0, 64, (num_tokens, k), generator=gen).to(dev)  # int64, as the router makes them
        weights = torch.rand(num_tokens, k, generator=gen).to(dev)
        dst_x = torch.full((cap, hidden), -3.0, dtype=torch.bfloat16, device=dev)
        dst_ids = torch.full((cap, k), -5, dtype=torch.int32, device=dev)
        dst_w = torch.full((cap, k), -7.0, device=dev)
        counter = torch.tensor([41], dtype=torch.int64, device=dev)
        arrive = torch.zeros(1, dtype=torch.int32, device=dev)
        header = torch.full((wire.HEADER_WORDS,), 99, dtype=torch.int32, device=dev)
        flag = torch.zeros(1, dtype=torch.int64, device=dev)
        chain.send_request(x, ids, weights, dst_x, dst_ids, dst_w, counter, arrive, header, flag, 4,
                           shared_on_ffn=shared_on_ffn)  # fmt: skip
        want = _request(rows=num_tokens, shared=num_tokens if shared_on_ffn else 0, layer=4, seq=42)
        want[wire.W_NUM_TOKENS] = num_tokens
        what = f"T={num_tokens}"
        assert torch.equal(header.cpu(), want), f"{what}: header {header.tolist()} vs {want.tolist()}"
        assert counter.item() == 42 and flag.item() == 42 and arrive.item() == 0, what
        assert torch.equal(dst_x[:num_tokens], x) and (dst_x[num_tokens:] == -3.0).all(), what
        assert torch.equal(dst_ids[:num_tokens], ids.int()) and (dst_ids[num_tokens:] == -5).all(), what
        assert torch.equal(dst_w[:num_tokens], weights) and (dst_w[num_tokens:] == -7.0).all(), what
    with pytest.raises(ValueError, match="at least one row"):
        chain.send_request(x[:0], ids[:0], weights[:0], dst_x, dst_ids, dst_w, counter, arrive, header, flag, 4)


def _interpreted(check: str) -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path])}
    code = f"import test_chain_kernels as t; t.{check}('cpu'); print('passed')"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and "passed" in done.stdout, done.stderr[-3000:]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("check", ["check_ffn_kernels", "check_send_kernel"])
def test_kernels_interpreted_on_cpu(check: str) -> None:
    _interpreted(check)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("check", ["check_ffn_kernels", "check_send_kernel"])
def test_kernels_on_the_gpu(check: str) -> None:
    globals()[check]("cuda")
