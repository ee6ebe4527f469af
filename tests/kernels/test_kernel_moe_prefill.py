"""FP8 experts at prefill sizes (afd.kernels.moe_prefill: row tiles over every expert's rows, each tile's expert
found on the device) against the eager loop over the same quantized values (helpers.kernels_moe_fp8), and the size
at which `fused_moe` hands them over.

CPU: Triton's interpreter, fp32 activations around fp8 rows and weights (as in test_kernel_moe_fp8.py). The SwiGLU
output's quantization inside gate/up's epilogue is checked on CUDA only (tests/e2e/test_kernel_moe_fp8_gpu.py): the
interpreter converts fp32 to e4m3 wrongly.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from helpers.kernels_moe import _routing  # noqa: E402
from helpers.kernels_moe_fp8 import fp8_experts, fp8_rows_grouped_reference, fp8_rows_routed_reference  # noqa: E402

import afd.kernels.fused_moe as kmoe  # noqa: E402
from afd.kernels.moe_prefill import RowTileConfig, down_rows, gate_up_rows, max_row_tiles  # noqa: E402
from afd.kernels.moe_sort import COUNTING_SORT_MAX_PAIRS, sort_pairs  # noqa: E402
from afd.kernels.moe_tiles import quantize_row_groups  # noqa: E402
from afd.routing import sort_pairs_by_expert  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
cpu_only = pytest.mark.skipif(not INTERPRET, reason="interpreter test (runs where there is no GPU)")

# (block, H, I) as in test_kernel_moe_fp8.py: 160 and 144 are ragged against 128 and 144 against 32 too
SHAPES = [((16, 32), 160, 144), ((128, 128), 160, 144), ((24, 32), 160, 144)]
SHAPE_IDS = ["16x32", "128x128-ragged", "24x32"]
SMALL = RowTileConfig(16, 64, 32, num_warps=4, num_stages=2)  # several row tiles per expert, column tiles, K steps


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _scales(q) -> kmoe.ExpertScales:
    return kmoe.ExpertScales(q.w13_scale_inv, q.w2_scale_inv, q.block)


def test_row_tiles_bound_covers_every_split_of_the_rows():
    """`max_row_tiles` bounds `sum_e ceil(n_e / block_m)` for any group sizes adding up to N, empty groups included,
    and is reached within one tile per expert when every group is a tile plus one row."""
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        num_experts = int(torch.randint(1, 20, (1,), generator=g))
        sizes = torch.randint(0, 70, (num_experts,), generator=g)
        sizes[torch.rand(num_experts, generator=g) < 0.3] = 0
        need = int((-(-sizes // 16)).sum())
        assert need <= max_row_tiles(int(sizes.sum()), num_experts, 16)
    assert max_row_tiles(8 * 17, 8, 16) - int(8 * -(-17 // 16)) == 1


@cpu_only
@pytest.mark.parametrize(("block", "hidden", "inter"), SHAPES[2:], ids=SHAPE_IDS[2:])  # 128 x 128: the tests below
def test_row_tile_kernels_equal_the_loop_over_quantized_rows(block, hidden, inter):
    """gate/up then down on small row tiles (several per expert, the last partial), empty experts and padding rows
    past the last group (never written) = the eager loop on the same quantized values within 1e-5."""
    sizes = [21, 0, 16, 1, 0, 34]
    q = fp8_experts(len(sizes), hidden, inter, block, seed=3)
    n = sum(sizes)
    x = torch.randn(n + 5, hidden, generator=torch.Generator().manual_seed(n))
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    rows, x_scale = quantize_row_groups(x, block[1])
    act, act_scale = gate_up_rows(rows, x_scale, offs, q.w13, q.w13_scale_inv, block, out_dtype=x.dtype, config=SMALL)
    assert act.dtype == torch.float32 and act.shape == (n + 5, inter) and act_scale is None
    act_q, act_s = quantize_row_groups(act, block[1])
    out = torch.full((n + 5, hidden), 7.0)
    down_rows(act_q, act_s, offs, q.w2, q.w2_scale_inv, block, out, config=SMALL)
    ref = fp8_rows_grouped_reference(x, sizes, q)
    assert _rel(out[:n], ref) <= 1e-5, f"relative error {_rel(out[:n], ref):.2e}"
    assert torch.equal(out[n:], torch.full((5, hidden), 7.0))


@cpu_only
def test_prefill_sized_routed_experts_take_row_tiles_and_equal_the_loop(monkeypatch):
    """A batch past `PREFILL_ROWS_PER_EXPERT` rows per expert takes the row tiles (128-row tiles) on a shard: = the
    decode kernels on the same batch within 1e-5, and = the loop within 1e-5 but for rows where an fp8 code of the
    SwiGLU output lands the other side of a rounding tie (fp32 sums in another order; the decode kernels flip the
    same ones): one row at most, within 1e-3."""
    (block, hidden, inter), num_experts, top_k, T = SHAPES[1], 8, 2, 160
    assert kmoe.takes_row_tiles(T, top_k, 3, kmoe.ExpertScales(None, None, block))
    q = fp8_experts(num_experts, hidden, inter, block, seed=1).shard(2, 5)
    x = torch.randn(T, hidden, generator=torch.Generator().manual_seed(T))
    r = _routing(T, num_experts, top_k, seed=4)
    got = kmoe.fused_routed_experts(x, r.topk_ids, r.topk_weights, q.w13, q.w2, 2, scales=_scales(q))
    ref = fp8_rows_routed_reference(x, r.topk_ids, r.topk_weights, q, 2)
    row_err = (got - ref).abs().amax(dim=1) / ref.abs().max()  # [T]
    assert (row_err > 1e-5).sum() <= 1 and row_err.max() <= 1e-3, f"rows off: {row_err.topk(3).values}"
    monkeypatch.setattr(kmoe, "PREFILL_ROWS_PER_EXPERT", T + 1)  # the same batch on the decode kernels
    decode = kmoe.fused_routed_experts(x, r.topk_ids, r.topk_weights, q.w13, q.w2, 2, scales=_scales(q))
    assert _rel(got, decode) <= 1e-5, f"against the decode kernels {_rel(got, decode):.2e}"


@cpu_only
def test_prefill_sized_grouped_rows_take_row_tiles_and_equal_the_loop():
    """The async form (rows grouped by device offsets, unweighted) at prefill sizes, an empty expert included."""
    sizes = [300, 0, 260, 140]
    assert kmoe.takes_row_tiles(sum(sizes), 1, len(sizes), kmoe.ExpertScales(None, None, (128, 128)))
    q = fp8_experts(len(sizes), 160, 144, (128, 128), seed=5)
    n = sum(sizes)
    x = torch.randn(n, 160, generator=torch.Generator().manual_seed(6))
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    got = kmoe.fused_grouped_expert_mlp(x, offs, q.w13, q.w2, scales=_scales(q))
    ref = fp8_rows_grouped_reference(x, sizes, q)
    assert got.dtype == x.dtype and _rel(got, ref) <= 1e-5, f"relative error {_rel(got, ref):.2e}"


def test_decode_sizes_and_16bit_experts_keep_the_decode_kernels():
    """Row tiles only for FP8 experts at `PREFILL_ROWS_PER_EXPERT` rows per expert or more."""
    scales = kmoe.ExpertScales(None, None, (128, 128))
    assert not kmoe.takes_row_tiles(256, 6, 64, scales)  # a decode batch: ~24 rows per expert
    assert kmoe.takes_row_tiles(8192, 6, 64, scales)
    assert not kmoe.takes_row_tiles(8192, 6, 64, None)


@cpu_only
def test_sort_past_the_counting_bound_is_the_same_order():
    """Past `COUNTING_SORT_MAX_PAIRS` `sort_pairs` argsorts: the same int32 slots and offsets as the stable sort."""
    r = _routing(COUNTING_SORT_MAX_PAIRS // 2 + 3, 16, 2, seed=7)
    pair_idx, token_idx, offs = sort_pairs(r.topk_ids, 4, 9)
    ref = sort_pairs_by_expert(r.topk_ids, 4, 13)
    assert pair_idx.dtype == token_idx.dtype == offs.dtype == torch.int32
    assert torch.equal(pair_idx.long(), ref.pair_idx) and torch.equal(token_idx.long(), ref.token_idx)
    assert torch.equal(offs, ref.offs)
