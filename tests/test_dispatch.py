"""plan_dispatch / combine_scatter: pure functions of the `async` connector."""

from __future__ import annotations

import pytest
import torch

from afd.connectors.dispatch import ExpertMap, combine_scatter, plan_dispatch, shared_token_index
from afd.topology import expert_ranges


def random_routing(num_tokens: int, num_experts: int, topk: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(num_experts, generator=g)[:topk] for _ in range(num_tokens)]
    ids = torch.stack(rows) if rows else torch.zeros(0, topk, dtype=torch.int64)  # [T, K] int64
    return ids, torch.rand(num_tokens, topk, generator=g)  # [T, K] fp32


CASES = [(0, 8, 2, 2), (1, 8, 2, 3), (5, 7, 3, 3), (33, 64, 6, 4), (17, 10, 4, 1), (9, 7, 2, 7)]


@pytest.mark.parametrize(("num_tokens", "num_experts", "topk", "num_ffn"), CASES)
def test_every_partial_routed_once_grouped_by_local_expert(
    num_tokens: int, num_experts: int, topk: int, num_ffn: int
) -> None:
    ranges = expert_ranges(num_experts, num_ffn)
    emap = ExpertMap.from_ranges(ranges)
    ids, _ = random_routing(num_tokens, num_experts, topk, seed=num_tokens)
    plan = plan_dispatch(ids, emap)
    flat = ids.reshape(-1)
    assert sorted(plan.order.tolist()) == list(range(num_tokens * topk))  # each (t, k) exactly once
    assert plan.dest_offsets[-1] == num_tokens * topk
    assert torch.equal(plan.token_index, plan.order // topk)
    for f, r in enumerate(ranges):
        seg_experts = flat[plan.order[plan.segment(f)]]  # global expert per row of f's segment
        assert all(e in r for e in seg_experts.tolist())  # rows go to the owner
        local = (seg_experts - r.start).tolist()
        assert local == sorted(local)  # grouped by local expert
        assert len(plan.group_sizes[f]) == len(r)
        assert plan.group_sizes[f] == [local.count(i) for i in range(len(r))]
        assert plan.dest_counts[f] == sum(plan.group_sizes[f])
    # stable: within one expert group, partials keep (t, k) order
    for f in range(num_ffn):
        seg = plan.order[plan.segment(f)].tolist()
        groups = flat[plan.order[plan.segment(f)]].tolist()
        for e in set(groups):
            idx = [p for p, g in zip(seg, groups, strict=True) if g == e]
            assert idx == sorted(idx)


@pytest.mark.parametrize(("num_tokens", "num_experts", "topk", "num_ffn"), CASES)
def test_identity_experts_recombine_to_weighted_sum(num_tokens: int, num_experts: int, topk: int, num_ffn: int) -> None:
    emap = ExpertMap.from_ranges(expert_ranges(num_experts, num_ffn))
    ids, w = random_routing(num_tokens, num_experts, topk, seed=7)
    x = torch.randn(num_tokens, 16, dtype=torch.bfloat16)
    plan = plan_dispatch(ids, emap)
    weights = w.reshape(-1)[plan.order]
    acc = torch.zeros(num_tokens, 16)
    for f in range(num_ffn):
        seg = plan.segment(f)
        rows = x.index_select(0, plan.token_index[seg])  # identity experts: output == input
        combine_scatter(acc, rows, plan.token_index[seg], weights[seg])
        shared = shared_token_index(f, num_tokens, num_ffn, "cpu")
        combine_scatter(acc, x.index_select(0, shared), shared)
    expected = x.float() * w.sum(1, keepdim=True) + x.float()
    torch.testing.assert_close(acc, expected)


def test_expert_count_not_divisible_by_ffn_ranks() -> None:
    emap = ExpertMap.from_ranges(expert_ranges(7, 3))  # 3 + 2 + 2
    assert emap.num_local == (3, 2, 2) and emap.experts_per_rank == 3
    assert emap.owner.tolist() == [0, 0, 0, 1, 1, 2, 2]
    assert emap.local.tolist() == [0, 1, 2, 0, 1, 0, 1]
    ids = torch.tensor([[6, 0], [4, 5], [2, 3]])
    plan = plan_dispatch(ids, emap)
    assert plan.group_sizes == [[1, 0, 1], [1, 1], [1, 1]]
    assert plan.dest_counts == [2, 2, 2]


def test_empty_destination_and_fewer_tokens_than_ffn_ranks() -> None:
    emap = ExpertMap.from_ranges(expert_ranges(6, 3))
    plan = plan_dispatch(torch.tensor([[0, 1]]), emap)  # one token, top-k all on FFN rank 0
    assert plan.dest_counts == [2, 0, 0]
    assert plan.shared_counts == [1, 0, 0]
    assert plan.dest_ranks() == [0]  # nothing sent to (or awaited from) ranks 1 and 2
    plan = plan_dispatch(torch.tensor([[0, 1], [0, 1]]), emap)
    assert plan.dest_ranks() == [0, 1]  # rank 1 only gets its shared row
    empty = plan_dispatch(torch.zeros(0, 2, dtype=torch.int64), emap)
    assert empty.dest_ranks() == [] and empty.dest_counts == [0, 0, 0]


def test_shared_rows_round_robin_cover_every_token_once() -> None:
    for num_tokens in range(0, 9):
        rows = [shared_token_index(f, num_tokens, 3, "cpu").tolist() for f in range(3)]
        assert sorted(sum(rows, [])) == list(range(num_tokens))
        assert rows[1] == list(range(1, num_tokens, 3))


def test_combine_scatter_accumulates_in_fp32() -> None:
    acc = torch.zeros(2, 1)
    rows = torch.tensor([[1.0], [2.0], [4.0]], dtype=torch.bfloat16)
    combine_scatter(acc, rows, torch.tensor([1, 1, 0]), torch.tensor([0.5, 0.25, 1.0]))
    assert acc.dtype == torch.float32 and acc.flatten().tolist() == [4.0, 1.0]
    combine_scatter(acc, rows[:0], torch.zeros(0, dtype=torch.int64))  # nothing arrives: no-op
    assert acc.flatten().tolist() == [4.0, 1.0]
