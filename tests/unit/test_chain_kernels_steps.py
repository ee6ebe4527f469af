"""The device-driven exchange's PyTorch steps serve only the request they expect."""

from __future__ import annotations

import pytest
from helpers.chain_kernels import CASES, run_steps

SERVED = ("serves", "fewer shared rows")


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
