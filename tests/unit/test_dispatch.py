"""plan_dispatch / combine_scatter / expert_pass: pure functions of the `async` connector (wire version 3)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from afd.connectors.asynchronous.dispatch import ExpertMap, combine_scatter, destinations, plan_dispatch, shared_owner
from afd.connectors.expert_pass import WorkRows, expert_pass
from afd.routing import Routing
from afd.topology import expert_ranges


def random_routing(num_tokens: int, num_experts: int, topk: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(num_experts, generator=g)[:topk] for _ in range(num_tokens)]
    ids = torch.stack(rows) if rows else torch.zeros(0, topk, dtype=torch.int64)  # [T, K] int64
    return ids, torch.rand(num_tokens, topk, generator=g)  # [T, K] fp32


def check_plan(ids: torch.Tensor, num_experts: int, num_ffn: int) -> None:
    """Every property the FFN ranks and the combine rely on."""
    ranges = expert_ranges(num_experts, num_ffn)
    plan = plan_dispatch(ids, ExpertMap.from_ranges(ranges))
    num_tokens, topk = ids.shape
    assert plan.offsets[0] == 0 and plan.offsets[-1] == plan.token_index.numel() == sum(plan.rows)
    shared_seen: list[int] = []
    for f, r in enumerate(ranges):
        tokens = plan.token_index[plan.segment(f)].tolist()
        # exactly the tokens owning at least one of f's experts, each once
        want = [t for t in range(num_tokens) if any(e in r for e in ids[t].tolist())]
        assert sorted(tokens) == want and len(set(tokens)) == len(tokens)
        shared, rest = tokens[: plan.shared_rows[f]], tokens[plan.shared_rows[f] :]
        assert shared == sorted(shared) and rest == sorted(rest)  # shared rows lead, tokens ascending
        shared_seen += shared
        for t in shared:  # the first destination at or cyclically after t % F
            path = [(t % num_ffn + i) % num_ffn for i in range(num_ffn)]
            first = next(g for g in path if any(e in ranges[g] for e in ids[t].tolist()))
            assert first == f
    assert sorted(shared_seen) == list(range(num_tokens))  # every token's shared experts run once, no extra row
    assert sum(plan.rows) <= num_tokens * min(topk, num_ffn)
    assert plan.dest_ranks() == [f for f in range(num_ffn) if plan.rows[f]]


CASES = [(0, 8, 2, 2), (1, 8, 2, 3), (5, 7, 3, 3), (33, 64, 6, 4), (17, 10, 4, 1), (9, 7, 2, 7)]


@pytest.mark.parametrize(("num_tokens", "num_experts", "topk", "num_ffn"), CASES)
def test_each_token_once_per_destination_with_its_shared_rows_first(
    num_tokens: int, num_experts: int, topk: int, num_ffn: int
) -> None:
    ids, _ = random_routing(num_tokens, num_experts, topk, seed=num_tokens)
    check_plan(ids, num_experts, num_ffn)


@given(
    num_experts=st.integers(1, 12),
    num_ffn=st.integers(1, 6),
    topk=st.integers(1, 4),
    data=st.data(),
)
def test_plan_properties_hold_for_any_routing(num_experts: int, num_ffn: int, topk: int, data) -> None:
    num_ffn, topk = min(num_ffn, num_experts), min(topk, num_experts)
    num_tokens = data.draw(st.integers(0, 12))
    rows = [data.draw(st.permutations(range(num_experts)))[:topk] for _ in range(num_tokens)]
    ids = torch.tensor(rows, dtype=torch.int64).view(num_tokens, topk)
    check_plan(ids, num_experts, num_ffn)


def test_shared_experts_keep_the_round_robin_where_the_token_goes_anyway() -> None:
    emap = ExpertMap.from_ranges(expert_ranges(6, 3))  # experts 0-1 on FFN 0, 2-3 on FFN 1, 4-5 on FFN 2
    ids = torch.tensor([[0, 1], [2, 5], [4, 5], [0, 3], [1, 0]])
    assert shared_owner(destinations(ids, emap.owner, 3)).tolist() == [0, 1, 2, 0, 0]  # token 4: 1, 2 skipped
    plan = plan_dispatch(ids, emap)
    assert plan.rows == (3, 2, 2) and plan.shared_rows == (3, 1, 1)
    assert plan.token_index.tolist() == [0, 3, 4, 1, 3, 2, 1]


def test_empty_destination_and_fewer_tokens_than_ffn_ranks() -> None:
    emap = ExpertMap.from_ranges(expert_ranges(6, 3))
    plan = plan_dispatch(torch.tensor([[0, 1]]), emap)  # one token, top-k all on FFN rank 0
    assert plan.rows == (1, 0, 0) and plan.shared_rows == (1, 0, 0)
    assert plan.dest_ranks() == [0]  # nothing sent to (or awaited from) ranks 1 and 2
    empty = plan_dispatch(torch.zeros(0, 2, dtype=torch.int64), emap)
    assert empty.dest_ranks() == [] and empty.rows == (0, 0, 0)


def test_expert_map_of_uneven_ranges() -> None:
    emap = ExpertMap.from_ranges(expert_ranges(7, 3))  # 3 + 2 + 2
    assert emap.num_local == (3, 2, 2) and emap.starts == (0, 3, 5)
    assert emap.owner.tolist() == [0, 0, 0, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="contiguous"):
        ExpertMap.from_ranges([range(0, 2), range(3, 4)])


class LinearExperts:
    """expert e(x) = x * (e + 1); shared(x) = 0.5 x: the combined answer has a closed form."""

    def __init__(self, expert_range: range) -> None:
        self.expert_range = expert_range

    def experts_topk(self, layer_idx: int, x: torch.Tensor, routing) -> torch.Tensor:
        ids, w = routing.topk_ids, routing.topk_weights
        is_local = (ids >= self.expert_range.start) & (ids < self.expert_range.stop)
        scale = (torch.where(is_local, w * (ids + 1), 0.0)).sum(1, keepdim=True)  # [R, 1]
        return x.float() * scale

    def shared(self, layer_idx: int, x: torch.Tensor) -> torch.Tensor:
        return x * 0.5


@pytest.mark.parametrize(("num_tokens", "num_experts", "topk", "num_ffn"), CASES)
def test_partials_recombine_to_the_whole_layer(num_tokens: int, num_experts: int, topk: int, num_ffn: int) -> None:
    ranges = expert_ranges(num_experts, num_ffn)
    ids, w = random_routing(num_tokens, num_experts, topk, seed=7)
    x = torch.randn(num_tokens, 16, dtype=torch.bfloat16)
    plan = plan_dispatch(ids, ExpertMap.from_ranges(ranges))
    acc = torch.zeros(num_tokens, 16)
    for f in range(num_ffn):
        tok = plan.token_index[plan.segment(f)]
        item = WorkRows(x[tok], ids[tok].to(torch.int32), w[tok], plan.shared_rows[f])
        (partial,) = expert_pass(LinearExperts(ranges[f]), 0, [item])
        assert partial.dtype == torch.float32
        combine_scatter(acc, partial, tok)
    expected = x.float() * ((w * (ids + 1)).sum(1, keepdim=True) + 0.5)
    torch.testing.assert_close(acc, expected)


def test_combine_scatter_accumulates_in_fp32() -> None:
    acc = torch.zeros(2, 1)
    rows = torch.tensor([[1.0], [2.0]], dtype=torch.bfloat16)
    combine_scatter(acc, rows, torch.tensor([1, 0]))
    combine_scatter(acc, rows * 0.5, torch.tensor([0, 1]))
    assert acc.dtype == torch.float32 and acc.flatten().tolist() == [2.5, 2.0]
    combine_scatter(acc, rows[:0], torch.zeros(0, dtype=torch.int64))  # nothing arrives: no-op
    assert acc.flatten().tolist() == [2.5, 2.0]


# --------------------------------------------------------------------------------------------- cross-replica batching


def tiny_ffn(expert_range: range):
    from afd.model.weights import load_ffn_model

    return load_ffn_model("tiny", expert_range=expert_range, dtype="float32", device="cpu", seed=0)


def test_one_pass_over_items_of_one_layer_equals_each_alone() -> None:
    """Three replicas' items of one MoE layer through one expert pass (the real FFN model, fp32 CPU): every
    row's answer equals the answer it gets alone, and the routed experts run once."""
    model = tiny_ffn(range(3, 8))  # an FFN rank holding experts 3..7 of 10
    config = model.config
    layer = config.moe_layers[0]
    g = torch.Generator().manual_seed(0)
    items = []
    for num_rows, shared in ((5, 2), (1, 1), (12, 0)):
        ids = torch.stack([torch.randperm(config.n_routed_experts, generator=g)[:3] for _ in range(num_rows)])
        x = torch.randn(num_rows, config.hidden_size, generator=g)
        items.append(WorkRows(x, ids.to(torch.int32), torch.rand(num_rows, 3, generator=g), shared))
    calls = []
    real = model.experts_topk
    model.experts_topk = lambda *a: calls.append(a[1].shape[0]) or real(*a)
    together = expert_pass(model, layer, items)
    assert calls == [18]  # one routed pass over every item's rows
    for item, got in zip(items, together, strict=True):
        (alone,) = expert_pass(model, layer, [item])
        torch.testing.assert_close(got, alone, atol=1e-6, rtol=1e-6)  # BLAS may tile another M otherwise
        want = model.experts_topk(layer, item.x, _routing(item)) + torch.cat(
            [model.shared(layer, item.x[: item.shared_rows]), torch.zeros(len(item.x) - item.shared_rows, 64)]
        )
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def _routing(item: WorkRows):
    return Routing(item.topk_ids.long(), item.topk_weights)


def test_one_ffn_rank_plans_every_token_without_reading_counts() -> None:
    """F = 1: every token is one row with its shared experts, in token order (the send needs no device read)."""
    expert_map = ExpertMap.from_ranges([range(8)])
    topk_ids = torch.tensor([[3, 1], [7, 0], [2, 5]])
    plan = plan_dispatch(topk_ids, expert_map)
    assert plan.rows == (3,) and plan.shared_rows == (3,) and plan.offsets == (0, 3)
    assert plan.token_index.tolist() == [0, 1, 2]
    empty = plan_dispatch(torch.zeros(0, 2, dtype=torch.long), expert_map)
    assert empty.rows == (0,) and empty.dest_ranks() == []
