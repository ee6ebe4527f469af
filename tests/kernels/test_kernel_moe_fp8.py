"""Block-scaled FP8 experts in the decode MoE kernels (afd.kernels.fused_moe with `scales`: fp8 rows, fp8 x fp8 MMAs)
against an eager loop over the same quantized values (helpers.kernels_moe_fp8: rows and SwiGLU outputs quantized per
row in groups of b1, weights dequantized), and the MoE's choice of them (any batch size).

CPU: Triton's interpreter. Weights and rows really are float8_e4m3fn there (the fp8 loads, the MMAs and every
block-scale index run as on the GPU), the activations around them fp32: this Triton's interpreter computes bf16
`tl.dot` wrongly (garbage, checked by hand), so bf16 activations are covered only on CUDA
(tests/e2e/test_kernel_moe_fp8_gpu.py, V2-Lite shapes, CUDA graphs); it also takes fp8 dots of a K step under 32,
which the GPU's compiler refuses, so only b1 multiples of 32 are tested. Blocks (16, 32), 128 x 128 and a ragged
(24, 32), on sizes that split into row groups evenly and raggedly; each weight block's magnitude differs
(`helpers.kernels_moe_fp8`), so a scale read from the wrong block fails the 1e-5 bound.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from helpers.kernels_moe import _routing  # noqa: E402
from helpers.kernels_moe_fp8 import (  # noqa: E402
    dequantized_rows,
    fp8_experts,
    fp8_rows_grouped_reference,
    fp8_rows_routed_reference,
)

import afd.kernels.fused_moe as kmoe  # noqa: E402
import afd.model.moe as moe  # noqa: E402
from afd.kernels.moe_down import expert_down  # noqa: E402
from afd.kernels.moe_gate_up import expert_gate_up  # noqa: E402
from afd.kernels.moe_tiles import TileConfig, fp8_block_supported, quantize_row_groups, scaled_block_k  # noqa: E402
from afd.model.fp8 import FP8Experts  # noqa: E402
from afd.model.weights import load_ffn_model  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
cpu_only = pytest.mark.skipif(not INTERPRET, reason="interpreter test (runs where there is no GPU)")

E = 8
# (block, H, I): 160 and 144 are two 128-wide blocks, the second partial, and 144 is ragged against 32 too; the
# release's block on sizes it divides
SHAPES = [((16, 32), 160, 144), ((128, 128), 160, 144), ((24, 32), 160, 144), ((128, 128), 256, 128)]
SHAPE_IDS = ["16x32", "128x128-ragged", "24x32", "128x128"]
SMALL_TILES = (TileConfig(16, 16, 32), TileConfig(16, 32, 32))  # several chunks, N tiles and K steps per block


def _scales(q: FP8Experts) -> kmoe.ExpertScales:
    return kmoe.ExpertScales(q.w13_scale_inv, q.w2_scale_inv, q.block)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@cpu_only
@pytest.mark.parametrize(("block", "hidden", "inter"), SHAPES, ids=SHAPE_IDS)
# one token on all experts with the table's tiles, 17 on a shard with small ones: each value of each once beside
# every block (the interpreter is slow)
@pytest.mark.parametrize(
    ("T", "expert_range", "tiles"), [(1, (0, 8), None), (17, (3, 6), SMALL_TILES)], ids=["T1-all", "T17-shard-small"]
)
def test_fp8_fused_routed_experts_equal_the_loop_over_quantized_rows(block, hidden, inter, T, expert_range, tiles):
    """FP8 weights with their scales in the four launches (rows and SwiGLU outputs quantized per row in groups of b1,
    fp8 x fp8) = the eager loop on the same quantized values within 1e-5 (relative to the largest output), on all
    experts and on a shard, with the table's tiles and small ones; within 10% of the loop on unquantized rows (what
    quantizing the activations costs)."""
    start, stop = expert_range
    q = fp8_experts(E, hidden, inter, block, seed=T).shard(start, stop)
    x = torch.randn(T, hidden, generator=torch.Generator().manual_seed(T))
    r = _routing(T, E, 2, seed=T)
    ref = fp8_rows_routed_reference(x, r.topk_ids, r.topk_weights, q, start)
    got = kmoe.fused_routed_experts(x, r.topk_ids, r.topk_weights, q.w13, q.w2, start, configs=tiles, scales=_scales(q))
    assert got.dtype == torch.float32 and got.shape == (T, hidden)
    assert _rel(got, ref) <= 1e-5, f"relative error {_rel(got, ref):.2e}"
    w13, w2 = q.dequantized(torch.float32)
    plain = moe.routed_experts(x, r.topk_ids, r.topk_weights, w13, w2, start, fixed_shape=False)
    assert 0 < _rel(got, plain) <= 0.1, f"against unquantized rows {_rel(got, plain):.2e}"


@cpu_only
@pytest.mark.parametrize(("block", "hidden", "inter"), SHAPES[:3], ids=SHAPE_IDS[:3])
def test_fp8_fused_grouped_expert_mlp_equals_the_loop_over_quantized_rows(block, hidden, inter):
    """The async form (rows grouped, device offsets, unweighted), empty experts and padding rows included."""
    sizes = [3, 0, 5, 1, 0, 2]
    q = fp8_experts(len(sizes), hidden, inter, block, seed=2)
    n = sum(sizes)
    x = torch.randn(n + 3, hidden, generator=torch.Generator().manual_seed(n))
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    ref = fp8_rows_grouped_reference(x, sizes, q)
    got = kmoe.fused_grouped_expert_mlp(x, offs, q.w13, q.w2, scales=_scales(q))
    assert got.dtype == x.dtype and got.shape == x.shape
    assert _rel(got[:n], ref) <= 1e-5, f"relative error {_rel(got[:n], ref):.2e}"


def test_fp8_reduction_step_stays_inside_a_scale_block():
    """The K step is the largest power of two up to the table's that divides b1, at least 16 for 16/32-bit rows (the
    FP8 linear) and 32 for fp8 rows (the MoE); b1 not a multiple of that is refused."""
    assert [scaled_block_k(128, b) for b in (128, 256, 16, 48, 96, 64)] == [128, 128, 16, 16, 32, 64]
    assert [scaled_block_k(k, b, 32) for k, b in ((128, 96), (128, 64), (16, 128), (64, 32))] == [32, 64, 32, 32]
    assert fp8_block_supported((128, 128)) and fp8_block_supported((1, 16)) and fp8_block_supported((24, 32))
    assert not fp8_block_supported((128, 24)) and not fp8_block_supported((16, 8))
    assert fp8_block_supported((128, 128), 32) and fp8_block_supported((24, 32), 32)
    assert not fp8_block_supported((16, 16), 32) and not fp8_block_supported((128, 48), 32)
    with pytest.raises(ValueError, match="multiple of 16"):
        scaled_block_k(128, 24)
    with pytest.raises(ValueError, match="multiple of 32"):
        scaled_block_k(128, 16, 32)


@cpu_only
def test_fp8_weights_without_fitting_scales_or_fp8_rows_are_refused():
    """FP8 weights need their scales, of the shape the block size gives, both weights FP8, and (the kernels
    themselves) fp8 rows with their scales; fp8 rows need FP8 weights."""
    q = fp8_experts(4, 160, 144, (128, 128))
    x = torch.randn(3, 160)
    r = _routing(3, 4, 2)
    args = (x, r.topk_ids, r.topk_weights, q.w13, q.w2)
    with pytest.raises(ValueError, match="needs its block scales"):
        kmoe.fused_routed_experts(*args)
    bad = kmoe.ExpertScales(q.w13_scale_inv[:, :1], q.w2_scale_inv, q.block)
    with pytest.raises(ValueError, match="do not fit"):
        kmoe.fused_routed_experts(*args, scales=bad)
    for block in ((128, 24), (128, 16)):  # b1 not a multiple of 32
        with pytest.raises(ValueError, match="not supported.*multiple of 32"):
            kmoe.fused_routed_experts(*args, scales=kmoe.ExpertScales(q.w13_scale_inv, q.w2_scale_inv, block))
    with pytest.raises(ValueError, match="does not fit"):
        kmoe.fused_routed_experts(x, r.topk_ids, r.topk_weights, q.w13, q.w2.float(), scales=_scales(q))
    w13, w2 = q.dequantized(torch.float32)
    with pytest.raises(ValueError, match="fp8 rows need fp8 weights"):  # scales beside 16/32-bit weights
        kmoe.fused_routed_experts(x, r.topk_ids, r.topk_weights, w13, w2, scales=_scales(q))

    offs = torch.tensor([1, 2, 3, 3], dtype=torch.int32)
    scale = {"scale": q.w13_scale_inv, "block": q.block}
    with pytest.raises(ValueError, match="fp8 weights need fp8 rows"):  # 16/32-bit rows into FP8 weights
        expert_gate_up(x, offs, q.w13, **scale)
    rows, x_scale = quantize_row_groups(x, 128)
    with pytest.raises(ValueError, match="do not fit groups of 128"):
        expert_gate_up(rows, offs, q.w13, x_scale=x_scale[:, :1], **scale)
    with pytest.raises(ValueError, match="fp8 rows need fp8 weights"):
        expert_gate_up(rows, offs, w13, x_scale=x_scale)
    act = torch.randn(3, 144)
    with pytest.raises(ValueError, match="fp8 weights need fp8 rows"):
        expert_down(act, offs, q.w2, scale=q.w2_scale_inv, block=q.block)
    act_fp8, act_scale = quantize_row_groups(act, 128)
    with pytest.raises(ValueError, match="fp8 rows need fp8 weights"):
        expert_down(act_fp8, offs, w2, act_scale=act_scale)


def test_quantize_row_groups_scales_each_group_the_last_one_partial():
    """Per row and group of `group` columns (the last one partial when it does not divide the width): scale =
    amax / 448 (1 for an all-zero group), the largest value at +-448 exactly, every value within e4m3's rounding."""
    x = torch.randn(3, 40, generator=torch.Generator().manual_seed(0))
    x[1, 16:32] = 0.0
    q, scale = quantize_row_groups(x, 16)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (3, 40) and scale.shape == (3, 3)
    groups = [x[:, 0:16], x[:, 16:32], x[:, 32:40]]
    amax = torch.stack([g.abs().amax(dim=1) for g in groups], dim=1)  # [3, 3]
    want = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
    torch.testing.assert_close(scale, want, rtol=0, atol=0)
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((3,), 448.0))
    back = dequantized_rows(x, 16)
    bound = (scale * 16).repeat_interleave(16, dim=1)[:, :40]  # half e4m3's largest step (32, in [256, 448])
    assert ((back - x).abs() <= bound).all()
    assert torch.equal(back[1, 16:32], torch.zeros(16))


def test_fp8_moe_off_the_kernels_is_the_dequantized_path():
    """Where the kernels do not run (CPU here), the fp8 entry points are the 16/32-bit ones on the dequantized
    weights, bit for bit."""
    q = fp8_experts(E, 160, 144, (16, 32)).shard(2, 7)
    x = torch.randn(5, 160)
    r = _routing(5, E, 3, seed=1)
    w13, w2 = q.dequantized(torch.float32)
    got = moe.fp8_routed_experts(x, r.topk_ids, r.topk_weights, q, 2)
    assert torch.equal(got, moe.routed_experts(x, r.topk_ids, r.topk_weights, w13, w2, 2))
    sizes = [1, 0, 2, 2, 0]
    assert torch.equal(moe.fp8_grouped_expert_mlp(x, sizes, q), moe.grouped_expert_mlp(x, sizes, w13, w2))


class _Calls:
    """Spies on the fused kernels' entry points: which ran, with FP8 scales or not."""

    def __init__(self, monkeypatch) -> None:
        self.seen: list[str] = []
        real_routed, real_grouped = kmoe.fused_routed_experts, kmoe.fused_grouped_expert_mlp

        def routed(*args, scales=None, **kw):
            self.seen.append("routed" if scales is not None else "routed-16bit")
            return real_routed(*args, scales=scales, **kw)

        def grouped(*args, scales=None, **kw):
            self.seen.append("grouped" if scales is not None else "grouped-16bit")
            return real_grouped(*args, scales=scales, **kw)

        monkeypatch.setattr(kmoe, "fused_routed_experts", routed)
        monkeypatch.setattr(kmoe, "fused_grouped_expert_mlp", grouped)


@cpu_only
def test_fp8_ffn_model_takes_the_kernels_where_they_run(monkeypatch):
    """An FFN model with FP8 experts (`quantization="fp8"`, the tiny preset: H 64 and I 32 in one partial 128 group)
    hands the FP8 weights and scales to the kernels in all three forms (p2p top-k, async grouped, device offsets)
    where `_moe_kernels_run` says so (forced on here; on CUDA it is the device, dtype and `afd.kernels.enabled`), each
    within 1e-5 of the loop over quantized rows; a block size the kernels do not take falls back to the dequantized
    weights (in the 16-bit kernels at this size)."""
    ffn = load_ffn_model("tiny", quantization="fp8")
    layer = next(i for i in range(ffn.config.num_hidden_layers) if ffn.config.is_moe_layer(i))
    q = ffn._layer(layer).experts.fp8()
    x = torch.randn(6, ffn.config.hidden_size, generator=torch.Generator().manual_seed(0))
    r = _routing(6, ffn.config.n_routed_experts, ffn.config.num_experts_per_tok, seed=3)
    sizes = [1, 0, 2, 0, 3] + [0] * (ffn.num_local_experts - 5)
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)

    calls = _Calls(monkeypatch)
    monkeypatch.setattr(moe, "_moe_kernels_run", lambda x: True)
    monkeypatch.setattr(moe, "_grouped_mm_supported", lambda device, dtype: True)
    got = (ffn.experts_topk(layer, x, r), ffn.experts(layer, x, sizes), ffn.experts_offsets(layer, x, offs))
    assert calls.seen == ["routed", "grouped", "grouped"]
    n = sum(sizes)
    torch.testing.assert_close(
        got[0], fp8_rows_routed_reference(x, r.topk_ids, r.topk_weights, q), rtol=1e-5, atol=1e-5
    )
    grouped_ref = fp8_rows_grouped_reference(x, sizes, q)
    torch.testing.assert_close(got[1], grouped_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[2][:n], grouped_ref, rtol=1e-5, atol=1e-5)

    for block in ((16, 24), (16, 16)):  # b1 not a multiple of 32: the kernels refuse it with fp8 rows
        odd = fp8_experts(4, ffn.config.hidden_size, 48, block)
        w13, w2 = odd.dequantized(torch.float32)
        calls.seen.clear()
        got = moe.fp8_routed_experts(x, r.topk_ids, r.topk_weights, odd, 0, fixed_shape=True)
        assert calls.seen == ["routed-16bit"]  # the 16/32-bit kernels, on the dequantized weights
        want = moe.routed_experts(x, r.topk_ids, r.topk_weights, w13, w2, 0)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@cpu_only
def test_fp8_experts_take_the_kernels_at_every_size(monkeypatch):
    """FP8 experts take the fused kernels at every size where they run, past 16-bit experts' `FUSED_MOE_MAX_PAIRS`
    too: the decode kernels, then the row tiles from `PREFILL_ROWS_PER_EXPERT` rows per expert (the bounds moved to
    sizes the interpreter runs quickly), in all three forms, within 1e-5 of the loop over quantized rows."""
    monkeypatch.setattr(moe, "_moe_kernels_run", lambda x: True)
    monkeypatch.setattr(moe, "_grouped_mm_supported", lambda device, dtype: True)
    monkeypatch.setattr(moe, "FUSED_MOE_MAX_PAIRS", 16)
    monkeypatch.setattr(kmoe, "PREFILL_ROWS_PER_EXPERT", 21)
    row_tiles = []
    real_down_rows = kmoe.down_rows
    monkeypatch.setattr(kmoe, "down_rows", lambda *a, **kw: row_tiles.append(1) or real_down_rows(*a, **kw))
    q = fp8_experts(12, 32, 32, (16, 32), seed=5)
    calls = _Calls(monkeypatch)
    for num_tokens, rows_path in ((8, False), (30, True)):  # 8 and 30 rows per expert (the hint), 64 and 240 pairs
        x = torch.randn(num_tokens, 32, generator=torch.Generator().manual_seed(5))
        r = _routing(num_tokens, 12, 8, seed=5)
        calls.seen.clear(), row_tiles.clear()
        got = moe.fp8_routed_experts(x, r.topk_ids, r.topk_weights, q, 0, fixed_shape=True)
        ref = fp8_rows_routed_reference(x, r.topk_ids, r.topk_weights, q)
        assert calls.seen == ["routed"] and bool(row_tiles) == rows_path, num_tokens
        assert _rel(got, ref) <= 1e-5, f"{num_tokens} tokens: {_rel(got, ref):.2e}"

    for sizes, rows_path in (([30, 0, 20, 14] + [0] * 8, False), ([30, 0, 20, 25] + [0] * 8, True)):
        rows = torch.randn(sum(sizes), 32, generator=torch.Generator().manual_seed(6))
        calls.seen.clear(), row_tiles.clear()
        grouped = moe.fp8_grouped_expert_mlp(rows, sizes, q)
        offsets = moe.fp8_grouped_expert_mlp_offsets(rows, torch.tensor(sizes).cumsum(0).to(torch.int32), q)
        ref = fp8_rows_grouped_reference(rows, sizes, q)
        assert calls.seen == ["grouped", "grouped"] and len(row_tiles) == 2 * rows_path, sum(sizes)
        assert _rel(grouped, ref) <= 1e-5 and torch.equal(offsets, grouped), sum(sizes)


@cpu_only
def test_row_group_quantization_kernel_computes_the_reference_values_before_the_cast():
    """`afd.kernels.fp8_quant`'s kernel, run by the interpreter into an fp32 buffer (its fp32 -> e4m3 conversion is
    wrong there; the GPU test checks the cast): each group's scale, and its values divided, clamped and ready for
    the cast, are the reference's bit for bit, on full, ragged (160 in 128) and small (32) groups, a zero group and
    rows of very different magnitudes, one row a program and 16; an fp32 buffer rounds nothing."""
    import triton

    from afd.kernels.fp8_quant import _quantize_kernel
    from afd.kernels.moe_tiles import FP8_MAX

    torch.manual_seed(0)
    # (rows, width, group, rows a program): one row a program, and 16 with the last program's rows partial
    for rows, width, group, per in ((3, 256, 128, 1), (4, 160, 128, 1), (5, 160, 32, 1), (21, 160, 128, 16)):
        x = torch.randn(rows, width) * torch.logspace(-3, 3, rows)[:, None]
        x[0, :group] = 0
        num_groups = -(-width // group)
        values, scale = torch.empty(rows, width), torch.empty(rows, num_groups)
        _quantize_kernel[(triton.cdiv(rows, per), num_groups)](
            x, values, scale, rows, width, x.stride(0), values.stride(0), scale.stride(0),
            GROUP=group, BLOCK=triton.next_power_of_2(group), ROWS=per, FMAX=FP8_MAX, ROUND=False,
        )  # fmt: skip
        _, scale_ref = quantize_row_groups(x, group)
        assert torch.equal(scale, scale_ref), (rows, width, group)
        expanded = scale_ref.repeat_interleave(group, dim=1)[:, :width]
        assert torch.equal(values, (x / expanded).clamp(-FP8_MAX, FP8_MAX)), (rows, width, group)
