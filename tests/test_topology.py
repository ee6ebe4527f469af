"""Topology arithmetic: property tests over 1 <= A, F <= 64 and hand-written tables."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from afd.connectors.dispatch import shared_token_index
from afd.connectors.p2p import ffn_recvs
from afd.topology import AsyncTopology, SyncTopology, even_split, expert_ranges

sizes = st.integers(min_value=1, max_value=64)


@given(sizes, sizes)
def test_every_rank_in_exactly_one_nonempty_group(num_attn: int, num_ffn: int) -> None:
    topo = SyncTopology(num_attn, num_ffn)
    groups = topo.groups
    assert len(groups) == min(num_attn, num_ffn)
    assert sorted(a for g in groups for a in g.attn_ranks) == list(range(num_attn))
    assert sorted(f for g in groups for f in g.ffn_ranks) == list(range(num_ffn))
    for g in groups:
        assert g.attn_ranks and g.ffn_ranks
        smaller = g.ffn_ranks if num_ffn <= num_attn else g.attn_ranks
        assert len(smaller) == 1
        for a in g.attn_ranks:
            assert topo.group_of_attn(a) == g.index
        for f in g.ffn_ranks:
            assert topo.group_of_ffn(f) == g.index


@given(st.integers(1, 16), st.integers(1, 8))
def test_classic_grouping_when_ffn_divides_attention(ratio: int, num_ffn: int) -> None:
    topo = SyncTopology(ratio * num_ffn, num_ffn)
    for g in topo.groups:
        assert g.ffn_ranks == (g.index,)
        assert g.attn_ranks == tuple(range(g.index * ratio, (g.index + 1) * ratio))


@given(sizes, sizes, st.integers(0, 10_000))
def test_splits_sum_to_tokens_and_are_even(num_attn: int, num_ffn: int, tokens: int) -> None:
    topo = SyncTopology(num_attn, num_ffn)
    for a in range(num_attn):
        split = topo.splits(a, tokens)
        assert sum(split) == tokens
        assert len(split) == len(topo.group("attention", a).ffn_ranks)
        assert max(split) - min(split) <= 1
        assert split == sorted(split, reverse=True)  # earlier members take the remainder


@given(sizes, sizes, st.integers(1, 300))
def test_async_expert_ownership_covers_each_expert_once(num_attn: int, num_ffn: int, num_experts: int) -> None:
    if num_experts < num_ffn:
        with pytest.raises(ValueError, match="cannot be spread"):
            AsyncTopology(num_attn, num_ffn, num_experts)
        return
    topo = AsyncTopology(num_attn, num_ffn, num_experts)
    owned = [e for r in topo.expert_ranges for e in r]
    assert owned == list(range(num_experts))
    assert all(len(r) >= 1 for r in topo.expert_ranges)
    assert max(len(r) for r in topo.expert_ranges) == topo.experts_per_rank
    assert topo.num_regions == max(num_attn, num_ffn)
    shared = sorted(t for f in range(num_ffn) for t in shared_token_index(f, 37, num_ffn, "cpu").tolist())
    assert shared == list(range(37))


@pytest.mark.parametrize(
    "num_attn, num_ffn, groups",
    [
        (4, 2, [([0, 1], [0]), ([2, 3], [1])]),
        (3, 2, [([0, 1], [0]), ([2], [1])]),
        (1, 2, [([0], [0, 1])]),
        (1, 4, [([0], [0, 1, 2, 3])]),
        (5, 2, [([0, 1, 2], [0]), ([3, 4], [1])]),
        (2, 3, [([0], [0, 1]), ([1], [2])]),
    ],
)
def test_group_tables(num_attn: int, num_ffn: int, groups: list) -> None:
    got = SyncTopology(num_attn, num_ffn).to_json()["groups"]
    assert got == [{"attention": a, "ffn": f} for a, f in groups]


@pytest.mark.parametrize(
    "num_attn, num_ffn, tokens, splits",
    [
        (4, 2, 5, {"0": [5], "1": [5], "2": [5], "3": [5]}),
        (1, 2, 5, {"0": [3, 2]}),
        (1, 4, 3, {"0": [1, 1, 1, 0]}),
        (1, 4, 10, {"0": [3, 3, 2, 2]}),
        (2, 3, 5, {"0": [3, 2], "1": [5]}),
        (5, 2, 0, {"0": [0], "1": [0], "2": [0], "3": [0], "4": [0]}),
    ],
)
def test_split_tables(num_attn: int, num_ffn: int, tokens: int, splits: dict) -> None:
    assert SyncTopology(num_attn, num_ffn).to_json(tokens)["splits"] == splits


def test_world_order_ffn_first_for_p2p_attention_first_for_async() -> None:
    sync = SyncTopology(3, 2)
    assert [sync.world_rank("ffn", f) for f in range(2)] == [0, 1]
    assert [sync.world_rank("attention", a) for a in range(3)] == [2, 3, 4]
    assert sync.role_of_world(3) == ("attention", 1)
    asyn = AsyncTopology(3, 2, 10)
    assert [asyn.world_rank("attention", a) for a in range(3)] == [0, 1, 2]
    assert asyn.role_of_world(4) == ("ffn", 1)


def test_ffn_rows_use_each_peers_own_count() -> None:
    """Per-peer counts, never one replica's count reused for every peer (a prior 2A1F hang)."""
    rows = [(s.attn_rank, s.num_rows) for s in ffn_recvs(SyncTopology(2, 1), 0, {0: 7, 1: 2})]
    assert rows == [(0, 7), (1, 2)]
    topo = SyncTopology(1, 3)
    assert [[s.num_rows for s in ffn_recvs(topo, f, {0: 4})] for f in range(3)] == [[2], [1], [1]]


def test_expert_ranges_spread_the_remainder_over_earlier_ranks() -> None:
    assert [list(r) for r in expert_ranges(10, 3)] == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert even_split(7, 3) == [3, 2, 2]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_bad_sizes_rejected(bad: object) -> None:
    with pytest.raises(ValueError, match="num_attention_ranks must be a positive integer"):
        SyncTopology(bad, 2)  # type: ignore[arg-type]


def test_gpu_placement_packs_p2p_without_sharing_a_communicator_gpu() -> None:
    from afd.topology import gpu_placement

    assert gpu_placement("p2p", 2, 2, 4) == [0, 1, 2, 3]
    # world order F0 F1 A0 A1: groups {F0, A0} and {F1, A1}, EP {F0, F1}
    assert gpu_placement("p2p", 2, 2, 2) == [0, 1, 1, 0]
    assert gpu_placement("p2p", 1, 1, 2) == [0, 1]
    assert gpu_placement("async", 2, 2, 2) == [0, 1, 0, 1]  # one attention and one FFN rank per GPU
    with pytest.raises(ValueError, match="needs more than 2 GPUs"):
        gpu_placement("p2p", 2, 1, 2)  # {F0, A0, A1} cannot fit on 2 GPUs
    with pytest.raises(ValueError, match="same number on every GPU"):
        gpu_placement("async", 2, 1, 2)  # 3 PEs on 2 GPUs hung in NVSHMEM init
    assert gpu_placement("async", 6, 2, 2) == [0, 1] * 4
    with pytest.raises(ValueError, match="no GPU"):
        gpu_placement("p2p", 1, 1, 0)
