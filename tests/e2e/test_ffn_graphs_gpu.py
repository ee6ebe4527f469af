"""The GPU half of tests/unit/test_ffn_graphs.py: bf16 and real model shapes on CUDA, graphs and host syncs."""

from __future__ import annotations

import pytest
import torch
from helpers.ffn_graphs import _items

from afd.connectors.expert_pass import expert_pass
from afd.engine.graphs.ffn import ExpertPassGraphs
from afd.model.weights import load_ffn_model


def _assert_replays_equal_eager(ffn, graphs: ExpertPassGraphs, cases) -> None:
    """V2-Lite bf16 on CUDA, experts 0-31: each case's items through the replayed pass equal the eager pass."""
    layer = graphs.moe_layers[0]
    with torch.inference_mode():
        for sizes_shared in cases:
            items = _items(ffn.config, sizes_shared, expert_range=(0, 32), device="cuda", dtype=torch.bfloat16)
            want = [w.clone() for w in expert_pass(ffn, layer, items)]
            got = [g.clone() for g in expert_pass(ffn, layer, items, graphs)]
            for g, w in zip(got, want, strict=True):
                # a bucket's GEMMs may tile differently than the eager rows': bf16 products, fp32 sums
                torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2)
                assert (g - w).abs().mean() < 2e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_prefill_buckets_replay_the_eager_pass_bf16() -> None:
    """V2-Lite bf16, half the experts: passes of 300, 1,000 and 2,048 rows replayed from the prefill buckets of a
    2,048-token budget equal the eager pass (a bucket's GEMMs tile apart: bf16 products, fp32 sums)."""
    ffn = load_ffn_model("deepseek-v2-lite", dtype="bfloat16", device="cuda", expert_range=(0, 32))
    graphs = ExpertPassGraphs(ffn, max_rows=2048)
    graphs.capture_all()
    _assert_replays_equal_eager(ffn, graphs, [[(300, 300)], [(600, 0), (400, 400)], [(2048, 2048)]])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_replay_equals_the_eager_expert_pass_bf16() -> None:
    ffn = load_ffn_model("deepseek-v2-lite", dtype="bfloat16", device="cuda", expert_range=(0, 32))
    assert ExpertPassGraphs.usable(ffn)
    graphs = ExpertPassGraphs(ffn, buckets=(1, 8, 64))
    _assert_replays_equal_eager(ffn, graphs, [[(1, 1)], [(5, 2)], [(40, 40), (9, 4)]])
    assert len(graphs._graphs) >= 2
