"""`afd bench exchange`'s echo FFN, in this process: it answers each row with itself."""

from __future__ import annotations


def test_echo_ffn_answers_each_row_with_itself() -> None:
    import torch

    from afd.bench.exchange_rank import EchoFFN
    from afd.connectors.expert_pass import WorkRows, expert_pass

    x = torch.randn(5, 8)
    ids, weights = torch.zeros(5, 2, dtype=torch.int32), torch.ones(5, 2)
    (out,) = expert_pass(EchoFFN(), 0, [WorkRows(x, ids, weights, 3)])
    assert torch.equal(out, x)
