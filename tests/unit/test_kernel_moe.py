"""Decode-shaped MoE kernels (afd.kernels.fused_moe) against the eager code they replace (afd.model.moe).

CPU: Triton's interpreter, fp32, tiny shapes (H=64, I=48, E=8), within 1e-5 of `routed_experts(fixed_shape=False)`
and of the eager grouped loop. GPU (`-m gpu`): DeepSeek-V2-Lite shapes in bf16 against an fp32 oracle and the
`torch._grouped_mm` path, bit-identical reruns, CUDA-graph capture + replay equal to eager, no host sync
(tests/e2e/test_kernel_moe_gpu.py).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402

pytest.importorskip("triton")

from helpers.kernels_moe import INTER, E, H, _experts, _routing

import afd.model.moe as moe  # noqa: E402
from afd.kernels import fused_moe as kmoe  # noqa: E402
from afd.kernels.moe_combine import combine_sorted_pairs  # noqa: E402
from afd.kernels.moe_sort import sort_pairs  # noqa: E402
from afd.kernels.moe_tiles import TileConfig  # noqa: E402
from afd.model.moe import grouped_expert_mlp, routed_experts  # noqa: E402
from afd.routing import sort_pairs_by_expert  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


cpu_only = pytest.mark.skipif(not INTERPRET, reason="interpreter test (runs where there is no GPU)")
SMALL_TILES = (TileConfig(16, 16, 16), TileConfig(16, 16, 32))  # several chunks, N tiles and K steps


# ----------------------------------------------------------------------------------------------- CPU (interpreter)


@cpu_only
@pytest.mark.parametrize("T", [0, 1, 3, 17])
@pytest.mark.parametrize("K", [2, 3])
@pytest.mark.parametrize("expert_range", [(0, 8), (2, 5), (7, 8), (0, 0)])
def test_sort_pairs_equals_sort_pairs_by_expert(T, K, expert_range):
    """One-launch counting sort = `sort_pairs_by_expert`: same slots (stable, non-local pairs last), same offsets."""
    start, stop = expert_range
    r = _routing(T, E, K, seed=T + K)
    ref = sort_pairs_by_expert(r.topk_ids, start, stop)
    pair_idx, token_idx, offs = sort_pairs(r.topk_ids, start, stop - start)
    assert pair_idx.long().tolist() == ref.pair_idx.tolist()
    assert token_idx.long().tolist() == ref.token_idx.tolist()
    assert offs.tolist() == ref.offs.tolist()


@cpu_only
@pytest.mark.parametrize("T", [1, 3, 17])
@pytest.mark.parametrize("K", [2, 3])
@pytest.mark.parametrize("expert_range", [(0, 8), (2, 5), (5, 6)])
@pytest.mark.parametrize("tiles", [None, SMALL_TILES], ids=["table", "small_tiles"])
def test_fused_routed_experts_equals_routed_experts_fp32(T, K, expert_range, tiles):
    """Same result as the exact loop within 1e-5, on the whole expert set and on shards that exclude experts
    (pairs owned elsewhere add nothing), with the table's tiles (one chunk, masked N and K) and with small tiles
    (several row chunks per expert, several N tiles, several K steps)."""
    start, stop = expert_range
    w13, w2 = _experts(E, H, INTER, seed=K)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(T))
    r = _routing(T, E, K, seed=T)
    args = (x, r.topk_ids, r.topk_weights, w13[start:stop], w2[start:stop], start)
    ref = routed_experts(*args, fixed_shape=False)
    got = kmoe.fused_routed_experts(*args, configs=tiles and (tiles[0], tiles[1]))
    assert got.dtype == torch.float32 and got.shape == (T, H)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


@cpu_only
def test_fused_routed_experts_empty_and_foreign_cases():
    """No tokens, no local experts, and a batch none of whose pairs is local (every expert group empty, every
    row of the pair buffer unwritten): zeros of the right shape, never garbage."""
    w13, w2 = _experts(E, H, INTER)
    r = _routing(5, E, 2)
    x = torch.randn(5, H)
    assert kmoe.fused_routed_experts(x[:0], r.topk_ids[:0], r.topk_weights[:0], w13, w2).shape == (0, H)
    assert torch.equal(kmoe.fused_routed_experts(x, r.topk_ids, r.topk_weights, w13[:0], w2[:0], 3), torch.zeros(5, H))
    ids = torch.tensor([[0, 1], [1, 0], [0, 2], [2, 1], [1, 2]])  # experts 0..2 only; the shard holds 4..7
    got = kmoe.fused_routed_experts(x, ids, r.topk_weights, w13[4:], w2[4:], 4)
    assert torch.equal(got, torch.zeros(5, H))


@cpu_only
@pytest.mark.parametrize("sizes", [[3, 0, 5, 1, 0, 2], [0, 0, 17, 0], [1], [0, 0, 0]])
@pytest.mark.parametrize("tiles", [None, SMALL_TILES], ids=["table", "small_tiles"])
def test_fused_grouped_expert_mlp_equals_the_grouped_loop(sizes, tiles):
    """The async form (rows already grouped, device offsets, unweighted, x.dtype out) equals the eager loop on
    every row inside a group, including empty experts and padding rows past the last group (left alone)."""
    w13, w2 = _experts(len(sizes), H, INTER, seed=len(sizes))
    n = sum(sizes)
    x = torch.randn(n + 3, H, generator=torch.Generator().manual_seed(n))  # 3 padding rows belong to no group
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    ref = grouped_expert_mlp(x[:n], sizes, w13, w2, use_grouped_mm=False)
    got = kmoe.fused_grouped_expert_mlp(x, offs, w13, w2, configs=tiles and (tiles[0], tiles[1]))
    assert got.dtype == x.dtype and got.shape == x.shape
    torch.testing.assert_close(got[:n], ref, rtol=0, atol=1e-5)
    assert kmoe.fused_grouped_expert_mlp(x[:0], offs * 0, w13, w2).shape == (0, H)


@cpu_only
@pytest.mark.parametrize("T", [0, 1, 5, 33])
@pytest.mark.parametrize("expert_range", [(0, 8), (2, 5), (3, 3)])
def test_combine_sorted_pairs_equals_weigh_scatter_and_sum(T, expert_range):
    """The prefill-sized combine after `torch._grouped_mm`: from expert-sorted rows (non-local rows hold NaN, as
    the grouped GEMM leaves them) to the fp32 sum over local k, equal to weigh + scatter back + sum."""
    K, (start, stop) = 3, expert_range
    r = _routing(T, E, K, seed=T + start)
    pairs = sort_pairs_by_expert(r.topk_ids, start, stop)
    y = torch.randn(T * K, H)
    y[pairs.offs[-1] if stop > start else 0 :] = float("nan")  # never read
    got = combine_sorted_pairs(y, pairs.pair_idx, r.topk_weights, pairs.offs)
    local = (r.topk_ids >= start) & (r.topk_ids < stop)  # [T, K]
    by_pair = torch.zeros(T * K, H).index_copy_(0, pairs.pair_idx, torch.nan_to_num(y, nan=0.0))
    want = (by_pair.view(T, K, H) * (r.topk_weights * local)[..., None]).sum(1)
    assert got.shape == (T, H) and not got.isnan().any()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@cpu_only
def test_moe_dispatches_decode_batches_to_the_kernels(monkeypatch):
    """`routed_experts(fixed_shape=True)` and `grouped_expert_mlp_offsets` hand their arguments to the kernels
    when `_fused_moe_enabled` says so (forced on here; on CUDA it is the device, the batch size and
    `afd.kernels.enabled`), and the results equal the exact loop."""
    calls = []
    real = moe._fused_moe_enabled

    def forced(x, top_k=1):
        calls.append((x.shape[0], top_k))
        return True

    monkeypatch.setattr(moe, "_fused_moe_enabled", forced)
    w13, w2 = _experts(E, H, INTER)
    x = torch.randn(9, H)
    r = _routing(9, E, 3, seed=4)
    args = (x, r.topk_ids, r.topk_weights, w13[2:7], w2[2:7], 2)
    torch.testing.assert_close(
        routed_experts(*args, fixed_shape=True), routed_experts(*args, fixed_shape=False), rtol=0, atol=1e-5
    )
    sizes = [2, 0, 4, 1, 0, 2, 0, 0]
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    got = moe.grouped_expert_mlp_offsets(x, offs, w13, w2)
    torch.testing.assert_close(got, grouped_expert_mlp(x, sizes, w13, w2, use_grouped_mm=False), rtol=0, atol=1e-5)
    assert calls == [(9, 3), (9, 1)]
    monkeypatch.setattr(moe, "_fused_moe_enabled", real)
    assert not moe._fused_moe_enabled(x, 1)  # CPU never takes them
    assert moe.FUSED_MOE_MAX_PAIRS >= 256 * 6  # decode batches of DeepSeek-V2 up to 256 tokens do


@pytest.mark.parametrize(("top_k", "num_local"), [(6, 64), (8, 256), (2, 4), (8, 32)])
def test_the_warm_up_token_counts_reach_every_routed_variant(top_k: int, num_local: int) -> None:
    """Every token count up to the step budget launches variants that one of the warm-up's counts compiled first,
    and the counts are few (V2-Lite: 24 for an 8,192-token budget, the last four FP8's row tiles)."""
    budget = 8192
    counts = kmoe.warm_up_token_counts(top_k, num_local, budget)
    made = {kmoe.routed_compile_key(t, top_k, num_local) for t in counts}
    needed = {kmoe.routed_compile_key(t, top_k, num_local) for t in range(1, budget + 1)}
    assert needed == made and len(counts) == len(made) <= 40
    assert counts == sorted(counts) and counts[0] == 1 and counts[-1] <= budget
    assert kmoe.warm_up_token_counts(6, 64, 8192) == [1, 3, 6, 8, 11, 16, 22, 24, 41, 43, 48, 83, 86, 88, 126, 128,
                                                      129, 136, 169, 256, 513, 520, 553, 640]  # fmt: skip


def test_the_moe_path_does_not_depend_on_padding_to_a_graph_bucket(monkeypatch):
    """A step's rows reach the MoE padded to the engine's prefill or decode buckets on one side and to an FFN
    rank's pass buckets (powers of two) on the other: for every count up to 2,000 rows, each padded count picks
    the path the real count picks (16-bit experts: kernels or grouped GEMM; FP8: decode kernels or row tiles), so
    padding never moves a step to the other path. The bound itself falls on a power of two."""
    from afd.buckets import batch_buckets, path_rows, pick_bucket, token_buckets
    from afd.connectors.asynchronous.ffn_chain import pass_buckets

    monkeypatch.setattr(moe, "_moe_kernels_run", lambda x: True)
    families = [token_buckets(8192), batch_buckets(1024), pass_buckets(8192), token_buckets(2000)]
    scales = kmoe.ExpertScales(None, None, (128, 128))

    def paths(rows: int) -> tuple[bool, bool, bool]:
        x = torch.empty(rows, 1)
        return moe._fused_moe_enabled(x, 6), moe._fused_moe_enabled(x), kmoe.takes_row_tiles(rows, 6, 64, scales)

    for rows in range(1, 2001):
        want = paths(rows)
        for buckets in families:
            padded = pick_bucket(rows, buckets)
            if padded is not None:
                assert paths(padded) == want, (rows, padded)
    assert [path_rows(n) for n in (1, 2, 3, 512, 513, 640, 1024)] == [1, 2, 4, 512, 1024, 1024, 1024]
    assert paths(512)[0] and not paths(513)[0]  # 16-bit experts: kernels up to 512 tokens at top-6
    assert not paths(512)[2] and paths(513)[2]  # FP8: row tiles from 513 tokens at top-6 of 64
