"""The device-driven exchange's kernels checked against their PyTorch steps and the wire, on a given device: run in this
process on a GPU, or in a child process under Triton's interpreter on CPU."""

from __future__ import annotations

import pytest
import torch

from afd.connectors.asynchronous import wire

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
OUTPUTS = ["ids", "mask", "ok", "out", "reply header", "flag", "stats", "reply flag", "arrive"]


def _request(rows: int, shared: int, layer: int, seq: int, *, flags: int = 0, magic: int | None = None):
    h = torch.zeros(wire.HEADER_WORDS, dtype=torch.int32)
    h[wire.W_MAGIC] = wire.MAGIC_WORD if magic is None else magic
    h[wire.W_VERSION], h[wire.W_FLAGS], h[wire.W_LAYER] = wire.VERSION, flags, layer
    h[wire.W_ROWS], h[wire.W_SHARED], h[wire.W_SEQ] = rows, shared, seq
    return h


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
