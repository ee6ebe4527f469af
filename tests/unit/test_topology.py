"""Topology arithmetic: property tests over 1 <= A, F <= 64 and hand-written tables."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from afd.connectors.asynchronous.dispatch import shared_owner
from afd.connectors.p2p.attention import ffn_recvs
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
    going_everywhere = torch.ones(37, num_ffn, dtype=torch.bool)  # shared experts: round robin t % F
    assert shared_owner(going_everywhere).tolist() == [t % num_ffn for t in range(37)]


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


def test_gpu_placement_uses_every_gpu_before_sharing_one() -> None:
    from afd.topology import gpu_placement

    # 3A2F on 4 GPUs: the old packing put F1 and A0 on GPU 1 and left GPU 3 idle
    placement = gpu_placement("p2p", 3, 2, 4)
    assert sorted(set(placement)) == [0, 1, 2, 3], placement
    assert max(placement.count(g) for g in range(4)) == 2


@given(st.integers(1, 12), st.integers(1, 12), st.integers(1, 16))
def test_gpu_placement_properties(num_attn: int, num_ffn: int, num_gpus: int) -> None:
    """Whenever p2p packing succeeds: every GPU is busy before any holds two ranks, and no communicator
    (sync group, FFN expert group) holds two ranks of one GPU."""
    from afd.topology import gpu_placement

    try:
        placement = gpu_placement("p2p", num_attn, num_ffn, num_gpus)
    except ValueError as exc:
        assert "needs more than" in str(exc)
        return
    world = num_attn + num_ffn
    assert len(placement) == world and all(0 <= g < num_gpus for g in placement)
    assert len(set(placement)) == min(world, num_gpus), placement
    for ranks in _communicators(num_attn, num_ffn):
        used = [placement[r] for r in ranks]
        assert len(set(used)) == len(used), (ranks, used)


def _communicators(num_attn: int, num_ffn: int) -> list[list[int]]:
    topo = SyncTopology(num_attn, num_ffn)
    return [topo.group_world_ranks(g) for g in topo.groups] + [list(range(num_ffn))]


SMALL_LAYOUTS = [(a, f, g) for a in (1, 2, 3, 4) for f in (1, 2, 3) for g in (2, 3, 4)]


@pytest.mark.parametrize("num_attn, num_ffn, num_gpus", SMALL_LAYOUTS)
def test_gpu_placement_is_as_light_as_any(num_attn: int, num_ffn: int, num_gpus: int) -> None:
    """Against brute force over every assignment: the busiest GPU holds no more ranks than it must."""
    import itertools

    from afd.topology import gpu_placement

    world, comms = num_attn + num_ffn, _communicators(num_attn, num_ffn)
    valid = [
        p
        for p in itertools.product(range(num_gpus), repeat=world)
        if all(len({p[r] for r in c}) == len(c) for c in comms)
    ]
    if not valid:
        with pytest.raises(ValueError, match="needs more than"):
            gpu_placement("p2p", num_attn, num_ffn, num_gpus)
        return
    best = min(max(p.count(g) for g in range(num_gpus)) for p in valid)
    placement = gpu_placement("p2p", num_attn, num_ffn, num_gpus)
    assert max(placement.count(g) for g in range(num_gpus)) == best, placement


def test_local_gpu_index_follows_torchrun_conventions() -> None:
    from afd.topology import local_gpu_index

    assert local_gpu_index(3, 1, None, 4) == 3  # --device-index wins
    assert local_gpu_index(None, 1, None, 4) == 1  # then LOCAL_RANK
    assert local_gpu_index(None, None, ["1"], 1) == 0  # then the only visible GPU
    # one rank per host on four single-GPU hosts: each sees one GPU, whatever the world size
    assert all(local_gpu_index(None, None, None, 1) == 0 for _ in range(4))
    with pytest.raises(ValueError, match="cannot tell which is its own"):
        local_gpu_index(None, None, ["0", "1"], 2)
    with pytest.raises(ValueError, match="LOCAL_RANK=2 is outside"):
        local_gpu_index(None, 2, None, 2)
    with pytest.raises(ValueError, match="--device-index=5 is outside"):
        local_gpu_index(5, None, None, 2)
    with pytest.raises(ValueError, match="no CUDA device"):
        local_gpu_index(0, None, None, 0)
