"""p2p wiring without processes: who sends how many rows to whom, the fused row payload, and the
expert all-to-all sizes."""

from types import SimpleNamespace

import pytest
import torch
from helpers.p2p_fakes import P2pStandInFFN, RecordingPG, fake_world

from afd.connectors.p2p.attention import (
    TAG_OUT,
    TAG_ROWS,
    P2pAttentionExchange,
    RowPayload,
    RowSend,
    ep_send_matrix,
    ffn_rows,
    plan_ep_dispatch,
    plan_layer,
)
from afd.connectors.p2p.ffn import P2pFFNLoop
from afd.topology import SyncTopology, expert_ranges


def _check_covering(topo: SyncTopology, attn_tokens: list[int]) -> list[RowSend]:
    """Every attention row goes to exactly one FFN rank; each FFN rank's input is packed without gaps."""
    plan = plan_layer(topo, attn_tokens)
    for a, num_tokens in enumerate(attn_tokens):
        mine = sorted((s for s in plan if s.attn_rank == a), key=lambda s: s.attn_offset)
        covered = [i for s in mine for i in range(s.attn_offset, s.attn_offset + s.num_rows)]
        assert covered == list(range(num_tokens)), (a, mine)
        assert all(s.ffn_rank in topo.group("attention", a).ffn_ranks for s in mine)
    for f in range(topo.num_ffn):
        into = [s for s in plan if s.ffn_rank == f]
        assert [s.attn_rank for s in into] == sorted(s.attn_rank for s in into)  # hub concat order
        offset = 0
        for s in into:
            assert s.ffn_offset == offset
            offset += s.num_rows
    return plan


def _table(plan: list[RowSend]) -> set[tuple[int, int, int]]:
    return {(s.attn_rank, s.ffn_rank, s.num_rows) for s in plan}


def test_4a2f_hubs_concatenate_their_spokes() -> None:
    plan = _check_covering(SyncTopology(4, 2), [3, 0, 5, 2])
    assert _table(plan) == {(0, 0, 3), (1, 0, 0), (2, 1, 5), (3, 1, 2)}
    assert [s.ffn_offset for s in plan] == [0, 3, 0, 5]
    assert ffn_rows(SyncTopology(4, 2), [3, 0, 5, 2]) == [3, 7]


def test_3a2f_uneven_groups() -> None:
    plan = _check_covering(SyncTopology(3, 2), [4, 1, 6])
    assert _table(plan) == {(0, 0, 4), (1, 0, 1), (2, 1, 6)}
    assert ffn_rows(SyncTopology(3, 2), [4, 1, 6]) == [5, 6]


def test_5a2f_per_peer_counts_not_one_reused() -> None:
    counts = [1, 2, 3, 4, 5]
    plan = _check_covering(SyncTopology(5, 2), counts)
    assert _table(plan) == {(0, 0, 1), (1, 0, 2), (2, 0, 3), (3, 1, 4), (4, 1, 5)}
    assert ffn_rows(SyncTopology(5, 2), counts) == [6, 9]


@pytest.mark.parametrize(("num_tokens", "shares"), [(7, [4, 3]), (1, [1, 0]), (0, [0, 0])])
def test_1a2f_attention_hub_splits(num_tokens: int, shares: list[int]) -> None:
    plan = _check_covering(SyncTopology(1, 2), [num_tokens])
    assert [s.num_rows for s in plan] == shares
    assert [s.attn_offset for s in plan] == [0, shares[0]]


@pytest.mark.parametrize(("num_tokens", "shares"), [(10, [3, 3, 2, 2]), (2, [1, 1, 0, 0]), (1, [1, 0, 0, 0])])
def test_1a4f_zero_share_ranks_still_listed(num_tokens: int, shares: list[int]) -> None:
    topo = SyncTopology(1, 4)
    plan = _check_covering(topo, [num_tokens])
    assert [(s.ffn_rank, s.num_rows) for s in plan] == list(enumerate(shares))
    assert ffn_rows(topo, [num_tokens]) == shares


def test_2a3f_mixed_groups() -> None:
    topo = SyncTopology(2, 3)  # {F0, F1, A0} {F2, A1}
    plan = _check_covering(topo, [5, 0])
    assert _table(plan) == {(0, 0, 3), (0, 1, 2), (1, 2, 0)}
    assert ffn_rows(topo, [5, 0]) == [3, 2, 0]


@pytest.mark.parametrize(("num_attn", "num_ffn"), [(4, 2), (3, 2), (1, 2), (1, 4), (5, 2), (2, 3), (1, 1), (7, 3)])
def test_covering_on_many_counts(num_attn: int, num_ffn: int) -> None:
    topo = SyncTopology(num_attn, num_ffn)
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        counts = torch.randint(0, 9, (num_attn,), generator=g).tolist()
        _check_covering(topo, counts)
        assert sum(ffn_rows(topo, counts)) == sum(counts)


def test_wrong_number_of_counts_is_rejected() -> None:
    with pytest.raises(ValueError, match="need 2 token counts"):
        plan_layer(SyncTopology(2, 2), [1])


def test_ep_dispatch_sorts_pairs_by_owner_and_local_expert() -> None:
    num_experts, num_ffn = 7, 3  # ranges [0,3) [3,5) [5,7)
    ids = torch.tensor([[6, 0, 3], [0, 4, 5]])  # [T=2, K=3]
    weights = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]])
    plan = plan_ep_dispatch(ids, weights, num_experts, num_ffn)
    assert plan.counts.tolist() == [[2, 0, 0], [1, 1, 0], [1, 1, 0]]  # [F, max_local]
    assert plan.send_splits == [2, 2, 2]
    assert ids.reshape(-1)[plan.order].tolist() == [0, 0, 3, 4, 5, 6]
    assert plan.token.tolist() == [0, 1, 0, 1, 1, 0]
    assert plan.weight.tolist() == pytest.approx([0.2, 0.4, 0.3, 0.5, 0.6, 0.1])


def test_ep_send_matrix_for_4a2f_summed_counts() -> None:
    """Each FFN rank dispatches the pairs of ALL rows it holds (its spokes' summed count)."""
    num_experts = 5  # F0 owns [0,3), F1 owns [3,5)
    rows_f0 = torch.tensor([[0, 3], [1, 4], [2, 0]])  # 3 + 0 rows from A0, A1
    rows_f1 = torch.tensor([[4, 3]] * 7)  # 5 + 2 rows from A2, A3
    assert ep_send_matrix([rows_f0, rows_f1], num_experts) == [[4, 2], [0, 14]]


def test_ep_dispatch_zero_rows_still_has_sizes() -> None:
    plan = plan_ep_dispatch(torch.empty(0, 2, dtype=torch.long), torch.empty(0, 2), 5, 2)
    assert plan.counts.shape == (2, 3)
    assert plan.send_splits == [0, 0]


def test_ep_dispatch_rejects_bad_expert_ids() -> None:
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        plan_ep_dispatch(torch.tensor([[4]]), torch.ones(1, 1), 4, 2)


def test_expert_count_not_divisible_by_ffn_ranks() -> None:
    assert [len(r) for r in expert_ranges(7, 4)] == [2, 2, 2, 1]
    plan = plan_ep_dispatch(torch.arange(7).view(7, 1), torch.ones(7, 1), 7, 4)
    assert plan.counts.tolist() == [[1, 1], [1, 1], [1, 1], [1, 0]]


def test_plan_ep_dispatch_rejects_expert_ids_out_of_range() -> None:
    ids = torch.tensor([[0, 7]])
    with pytest.raises(ValueError, match=r"expert ids must lie in \[0, 7\)"):
        plan_ep_dispatch(ids, torch.ones(1, 2), num_experts=7, num_ffn=2)


# --------------------------------------------------------------------------------------------- fused payload


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("num_rows", "hidden", "topk"), [(0, 8, 2), (1, 7, 3), (5, 3, 1), (4, 5, 6)])
def test_row_payload_round_trip(dtype: torch.dtype, num_rows: int, hidden: int, topk: int) -> None:
    g = torch.Generator().manual_seed(num_rows)
    x = torch.randn(num_rows, hidden, generator=g).to(dtype)
    ids = torch.randint(0, 64, (num_rows, topk), generator=g)  # int64 in, int32 on the wire
    weights = torch.rand(num_rows, topk, generator=g)
    layout = RowPayload(hidden, topk, dtype)
    buf = layout.pack(x, ids, weights)
    item = torch.empty((), dtype=dtype).element_size()
    assert buf.dtype == torch.uint8 and buf.numel() == layout.nbytes(num_rows) == num_rows * (hidden * item + 8 * topk)
    got_x, got_ids, got_w = layout.unpack(buf, num_rows)
    assert torch.equal(got_x, x) and torch.equal(got_ids, ids.int()) and torch.equal(got_w, weights)
    assert got_x.data_ptr() >= buf.data_ptr() and got_x.is_contiguous()  # views of the one buffer
    with pytest.raises(ValueError, match="payload of"):
        layout.unpack(buf, num_rows + 1)


def test_row_payload_without_routing_is_the_rows_alone() -> None:
    x = torch.randn(3, 4)
    layout = RowPayload(4, 0, torch.float32)
    assert layout.nbytes(3) == x.numel() * 4
    assert torch.equal(layout.unpack(layout.pack(x), 3)[0], x)


# --------------------------------------------------------------------------------------------- one message per peer


def test_attention_sends_one_fused_message_per_ffn_peer_and_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """1A2F: the hub splits 5 tokens 3 + 2; each FFN rank gets ONE message holding rows, ids and weights
    (before: three, one per tensor)."""
    topo, pg = SyncTopology(1, 2), RecordingPG({(0, TAG_OUT): [torch.zeros(3, 4)], (1, TAG_OUT): [torch.zeros(2, 4)]})
    ex = P2pAttentionExchange(fake_world(monkeypatch, "attention", 0, pg), topo, gate_on_attention=True, topk=2)
    ex.begin_step(5)
    x, ids, weights = torch.randn(5, 4), torch.randint(0, 6, (5, 2)), torch.rand(5, 2)
    ex(1, x, SimpleNamespace(topk_ids=ids, topk_weights=weights))
    data = [(dst, buf) for dst, tag, buf in pg.sent if tag == TAG_ROWS]
    assert [dst for dst, _ in data] == [0, 1]  # world ranks of FFN 0 and 1: one message each
    layout = RowPayload(4, 2, torch.float32)
    for (_, buf), rows in zip(data, (slice(0, 3), slice(3, 5)), strict=True):
        got_x, got_ids, got_w = layout.unpack(buf, rows.stop - rows.start)
        assert (
            torch.equal(got_x, x[rows]) and torch.equal(got_ids.long(), ids[rows]) and torch.equal(got_w, weights[rows])
        )


def test_ffn_hub_takes_one_fused_message_per_spoke_and_answers_each(monkeypatch: pytest.MonkeyPatch) -> None:
    """2A1F: the FFN hub receives one message per attention spoke, concatenates, computes once, answers."""
    topo = SyncTopology(2, 1)
    g = torch.Generator().manual_seed(0)
    model, layout, inbox, want = P2pStandInFFN(), RowPayload(16, 3, torch.float32), {}, []
    for a, n in enumerate((4, 2)):
        x = torch.randn(n, 16, generator=g)
        routing = model.route(1, x)
        inbox[(topo.world_rank("attention", a), TAG_ROWS)] = [layout.pack(x, routing.topk_ids, routing.topk_weights)]
        want.append(model.reference(1, x, gate_on_attention=True))
    pg = RecordingPG(inbox)
    loop = P2pFFNLoop(
        fake_world(monkeypatch, "ffn", 0, pg),
        topo,
        model,
        num_experts=7,
        topk=3,
        hidden_size=16,
        dtype=torch.float32,
        boundary_layers=[1],
        gate_on_attention=True,
    )
    loop._layer(1, {0: 4, 1: 2})  # the step's counts from the control plane
    assert pg.recvd == [(1, TAG_ROWS), (2, TAG_ROWS)]
    assert [(dst, tag) for dst, tag, _ in pg.sent] == [(1, TAG_OUT), (2, TAG_OUT)]
    for (_, _, out), expected in zip(pg.sent, want, strict=True):
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
