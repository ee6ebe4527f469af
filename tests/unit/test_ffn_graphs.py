"""The FFN rank's replayed expert pass (`afd.engine.graphs.ffn`): its padding and shared-row mask on CPU (run eagerly,
`capture=False`), and on CUDA capture + replay against the eager expert pass."""

from __future__ import annotations

import pytest
import torch
from helpers.ffn_graphs import _items
from helpers.p2p_fakes import RecordingPG, fake_world

from afd.connectors.expert_pass import expert_pass
from afd.engine.graphs.ffn import ExpertPassGraphs
from afd.model.weights import load_ffn_model


@pytest.mark.parametrize(
    "expert_range, sizes_shared",
    [
        (None, [(5, 5)]),  # one item, every row with its shared experts (F = 1)
        ((2, 6), [(3, 1)]),  # a subset of the experts; one row with the shared experts
        ((0, 4), [(2, 2), (7, 3), (1, 0)]),  # items from three replicas in one pass
    ],
)
def test_padded_pass_equals_the_eager_expert_pass(expert_range, sizes_shared) -> None:
    ffn = load_ffn_model("tiny", expert_range=expert_range)
    graphs = ExpertPassGraphs(ffn, buckets=(1, 4, 16), capture=False)
    items = _items(ffn.config, sizes_shared, expert_range=expert_range)
    layer = graphs.moe_layers[0]
    with torch.inference_mode():
        want = expert_pass(ffn, layer, items)
        got = expert_pass(ffn, layer, items, graphs)
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)  # fp32 GEMMs over other row counts round apart


def test_rows_beyond_the_largest_bucket_or_a_dense_layer_fall_back() -> None:
    ffn = load_ffn_model("tiny")
    graphs = ExpertPassGraphs(ffn, buckets=(1, 2), capture=False)
    x = torch.randn(3, ffn.config.hidden_size)
    ids, weights = torch.zeros(3, ffn.config.num_experts_per_tok, dtype=torch.long), torch.ones(3, 2)
    assert graphs.run(graphs.moe_layers[0], x, ids, weights, [(0, 3)]) is None
    dense = [i for i in range(ffn.config.num_hidden_layers) if not ffn.config.is_moe_layer(i)]
    if dense:
        assert graphs.run(dense[0], x[:1], ids[:1], weights[:1], [(0, 1)]) is None
    assert not ExpertPassGraphs.usable(ffn)  # CPU: never captured


def test_prefill_buckets_share_one_output_and_equal_the_eager_pass() -> None:
    """`max_rows`: buckets above the decode ones up to the token budget (`token_buckets`), their results in one
    shared output buffer; a pass of 5-290 rows (items of two replicas, shared rows too) equals the eager pass, and a
    set of prefill buckets alone (`buckets=()`, the chained FFN rank's) starts at the smallest token bucket."""
    ffn = load_ffn_model("tiny")
    graphs = ExpertPassGraphs(ffn, buckets=(1, 4), max_rows=300, capture=False)
    assert graphs.buckets == [1, 4, 128, 256, 300]
    assert ExpertPassGraphs(ffn, (), max_rows=300, capture=False).buckets == [128, 256, 300]
    layer = graphs.moe_layers[0]
    for sizes_shared in ([(5, 5)], [(100, 10), (90, 0)], [(290, 290)]):
        items = _items(ffn.config, sizes_shared, expert_range=None, seed=len(sizes_shared))
        with torch.inference_mode():
            want = expert_pass(ffn, layer, items)
            got = expert_pass(ffn, layer, items, graphs)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        rows = sum(r for r, _ in sizes_shared)
        assert (got[0].data_ptr() == graphs._prefill_out.data_ptr()) == (rows > 4)  # prefill sizes: the shared one
    assert (graphs._ids[290:300] == -1).all()  # padding pairs route to no rank's expert


@pytest.mark.parametrize("with_graphs", [False, True])
def test_p2p_ffn_rank_sends_the_same_answers_through_the_graphed_pass(monkeypatch, with_graphs: bool) -> None:
    """One p2p FFN rank (2A1F): the hub's answers with the replayed pass (run padded, `capture=False`) equal
    the eager MoE's."""
    from afd.connectors.p2p.attention import TAG_OUT, TAG_ROWS, RowPayload
    from afd.connectors.p2p.ffn import P2pFFNLoop
    from afd.topology import SyncTopology

    ffn = load_ffn_model("tiny")
    config, topo = ffn.config, SyncTopology(2, 1)
    layer = next(i for i in range(config.num_hidden_layers) if config.is_moe_layer(i))
    items = _items(config, [(4, 4), (3, 3)], expert_range=None)
    layout = RowPayload(config.hidden_size, config.num_experts_per_tok, torch.float32)
    inbox = {
        (topo.world_rank("attention", a), TAG_ROWS): [layout.pack(it.x, it.topk_ids.long(), it.topk_weights)]
        for a, it in enumerate(items)
    }
    pg = RecordingPG(inbox)
    graphs = ExpertPassGraphs(ffn, buckets=(2, 8), capture=False) if with_graphs else None
    loop = P2pFFNLoop(
        fake_world(monkeypatch, "ffn", 0, pg),
        topo,
        ffn,
        num_experts=config.n_routed_experts,
        topk=config.num_experts_per_tok,
        hidden_size=config.hidden_size,
        dtype=torch.float32,
        boundary_layers=[layer],
        gate_on_attention=True,
        expert_graphs=graphs,
    )
    with torch.inference_mode():
        loop._layer(layer, {0: 4, 1: 3})
        want = [o.float() for o in expert_pass(ffn, layer, items)]
    sent = [out for _, tag, out in pg.sent if tag == TAG_OUT]
    assert len(sent) == 2
    assert graphs is None or torch.equal(graphs._x[:7], torch.cat([it.x for it in items]))  # the pass ran padded
    for got, expected in zip(sent, want, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
