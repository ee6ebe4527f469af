"""Block-scaled FP8 experts in the decode MoE kernels (afd.kernels.fused_moe with `scales`) against the eager code
on the dequantized weights (afd.model.fp8.FP8Experts.dequantized, then afd.model.moe), and the MoE's choice of them.

CPU: Triton's interpreter. The weights really are float8_e4m3fn there (the fp8 loads, the conversion and every
block-scale index run as on the GPU), but the activations are fp32: this Triton's interpreter computes bf16 `tl.dot`
wrongly (garbage, checked by hand), so bf16 activations are covered only on CUDA (tests/e2e/test_kernel_moe_fp8_gpu.py,
V2-Lite shapes, CUDA graphs). Blocks 16 x 16, 128 x 128 and a ragged (24, 32); each block's magnitude differs
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
from helpers.kernels_moe_fp8 import fp8_experts  # noqa: E402

import afd.kernels.fused_moe as kmoe  # noqa: E402
import afd.model.moe as moe  # noqa: E402
from afd.kernels.moe_tiles import TileConfig, fp8_block_supported, scaled_block_k  # noqa: E402
from afd.model.fp8 import FP8Experts  # noqa: E402
from afd.model.weights import load_ffn_model  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
cpu_only = pytest.mark.skipif(not INTERPRET, reason="interpreter test (runs where there is no GPU)")

E, H, INTER = 8, 160, 144  # two 128-wide scale blocks along H and I, the second partial; ragged against 16 too
BLOCKS = [(16, 16), (128, 128), (24, 32)]
SMALL_TILES = (TileConfig(16, 16, 32), TileConfig(16, 32, 16))  # several chunks, N tiles and K steps per block


def _scales(q: FP8Experts) -> kmoe.ExpertScales:
    return kmoe.ExpertScales(q.w13_scale_inv, q.w2_scale_inv, q.block)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@cpu_only
@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: f"{b[0]}x{b[1]}")
# one token on all experts, 17 on a shard: each value of each once beside every block (the interpreter is slow)
@pytest.mark.parametrize(("T", "expert_range"), [(1, (0, 8)), (17, (3, 6))], ids=["T1-all", "T17-shard"])
@pytest.mark.parametrize("tiles", [None, SMALL_TILES], ids=["table", "small_tiles"])
def test_fp8_fused_routed_experts_equal_the_dequantized_loop(block, T, expert_range, tiles):
    """FP8 weights with their scales in the four launches = the exact loop on the dequantized fp32 weights within
    1e-5 (relative to the largest output), on all experts and on a shard, with the table's tiles and small ones."""
    start, stop = expert_range
    q = fp8_experts(E, H, INTER, block, seed=T).shard(start, stop)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(T))
    r = _routing(T, E, 2, seed=T)
    ref = moe.routed_experts(x, r.topk_ids, r.topk_weights, *q.dequantized(torch.float32), start, fixed_shape=False)
    got = kmoe.fused_routed_experts(x, r.topk_ids, r.topk_weights, q.w13, q.w2, start, configs=tiles, scales=_scales(q))
    assert got.dtype == torch.float32 and got.shape == (T, H)
    assert _rel(got, ref) <= 1e-5, f"relative error {_rel(got, ref):.2e}"


@cpu_only
@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: f"{b[0]}x{b[1]}")
def test_fp8_fused_grouped_expert_mlp_equals_the_dequantized_loop(block):
    """The async form (rows grouped, device offsets, unweighted), empty experts and padding rows included."""
    sizes = [3, 0, 5, 1, 0, 2]
    q = fp8_experts(len(sizes), H, INTER, block, seed=2)
    n = sum(sizes)
    x = torch.randn(n + 3, H, generator=torch.Generator().manual_seed(n))
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    ref = moe.grouped_expert_mlp(x[:n], sizes, *q.dequantized(torch.float32), use_grouped_mm=False)
    got = kmoe.fused_grouped_expert_mlp(x, offs, q.w13, q.w2, scales=_scales(q))
    assert got.dtype == x.dtype and got.shape == x.shape
    assert _rel(got[:n], ref) <= 1e-5


def test_fp8_reduction_step_stays_inside_a_scale_block():
    """The K step is the largest power of two up to the table's that divides b1; b1 not a multiple of 16 is refused."""
    assert [scaled_block_k(128, b) for b in (128, 256, 16, 48, 96, 64)] == [128, 128, 16, 16, 32, 64]
    assert fp8_block_supported((128, 128)) and fp8_block_supported((1, 16)) and fp8_block_supported((24, 32))
    assert not fp8_block_supported((128, 24)) and not fp8_block_supported((16, 8))
    with pytest.raises(ValueError, match="multiple of 16"):
        scaled_block_k(128, 24)


@cpu_only
def test_fp8_weights_without_fitting_scales_are_refused():
    """FP8 weights need their scales, of the shape the block size gives, and both weights FP8."""
    q = fp8_experts(4, H, INTER, (128, 128))
    x = torch.randn(3, H)
    r = _routing(3, 4, 2)
    args = (x, r.topk_ids, r.topk_weights, q.w13, q.w2)
    with pytest.raises(ValueError, match="needs its block scales"):
        kmoe.fused_routed_experts(*args)
    bad = kmoe.ExpertScales(q.w13_scale_inv[:, :1], q.w2_scale_inv, q.block)
    with pytest.raises(ValueError, match="do not fit"):
        kmoe.fused_routed_experts(*args, scales=bad)
    with pytest.raises(ValueError, match="not supported"):
        kmoe.fused_routed_experts(*args, scales=kmoe.ExpertScales(q.w13_scale_inv, q.w2_scale_inv, (128, 24)))
    with pytest.raises(ValueError, match="does not fit"):
        kmoe.fused_routed_experts(x, r.topk_ids, r.topk_weights, q.w13, q.w2.float(), scales=_scales(q))


def test_fp8_moe_off_the_kernels_is_the_dequantized_path():
    """Where the kernels do not run (CPU here), the fp8 entry points are the 16/32-bit ones on the dequantized
    weights, bit for bit."""
    q = fp8_experts(E, H, INTER, (16, 16)).shard(2, 7)
    x = torch.randn(5, H)
    r = _routing(5, E, 3, seed=1)
    w13, w2 = q.dequantized(torch.float32)
    got = moe.fp8_routed_experts(x, r.topk_ids, r.topk_weights, q, 2)
    assert torch.equal(got, moe.routed_experts(x, r.topk_ids, r.topk_weights, w13, w2, 2))
    sizes = [1, 0, 2, 2, 0]
    assert torch.equal(moe.fp8_grouped_expert_mlp(x, sizes, q), moe.grouped_expert_mlp(x, sizes, w13, w2))


@cpu_only
def test_fp8_ffn_model_takes_the_kernels_where_they_run(monkeypatch):
    """An FFN model with FP8 experts (`quantization="fp8"`) hands the FP8 weights and scales to the kernels in all
    three forms (p2p top-k, async grouped, device offsets) where `_fused_moe_enabled` says so (forced on here; on
    CUDA it is the device and the batch size), within 1e-5 of the dequantized path; a block size the kernels do not
    take falls back to it."""
    ffn = load_ffn_model("tiny", quantization="fp8")
    layer = next(i for i in range(ffn.config.num_hidden_layers) if ffn.config.is_moe_layer(i))
    x = torch.randn(6, ffn.config.hidden_size, generator=torch.Generator().manual_seed(0))
    r = _routing(6, ffn.config.n_routed_experts, ffn.config.num_experts_per_tok, seed=3)
    sizes = [1, 0, 2, 0, 3] + [0] * (ffn.num_local_experts - 5)
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    ref = (ffn(layer, x, r), ffn.experts(layer, x, sizes), ffn.experts_offsets(layer, x, offs))

    calls: list[str] = []
    real_routed, real_grouped = kmoe.fused_routed_experts, kmoe.fused_grouped_expert_mlp

    def routed(*args, scales=None, **kw):
        calls.append("routed" if scales is not None else "routed-16bit")
        return real_routed(*args, scales=scales, **kw)

    def grouped(*args, scales=None, **kw):
        calls.append("grouped" if scales is not None else "grouped-16bit")
        return real_grouped(*args, scales=scales, **kw)

    monkeypatch.setattr(moe, "_fused_moe_enabled", lambda x, n: True)
    monkeypatch.setattr(moe, "_grouped_mm_supported", lambda device, dtype: True)
    monkeypatch.setattr(kmoe, "fused_routed_experts", routed)
    monkeypatch.setattr(kmoe, "fused_grouped_expert_mlp", grouped)
    got = (ffn(layer, x, r), ffn.experts(layer, x, sizes), ffn.experts_offsets(layer, x, offs))
    assert calls == ["routed", "grouped", "grouped"]
    n = sum(sizes)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[2][:n], ref[2][:n], rtol=1e-5, atol=1e-5)

    odd = fp8_experts(4, ffn.config.hidden_size, 40, (16, 24))  # b1 = 24: the kernels refuse it
    w13, w2 = odd.dequantized(torch.float32)
    calls.clear()
    got = moe.fp8_routed_experts(x, r.topk_ids, r.topk_weights, odd, 0, fixed_shape=True)
    assert calls == ["routed-16bit"]  # the 16/32-bit kernels, on the dequantized weights
    torch.testing.assert_close(got, moe.routed_experts(x, r.topk_ids, r.topk_weights, w13, w2, 0), rtol=1e-5, atol=1e-5)


def _dequantize_rows(x: torch.Tensor, group: int) -> torch.Tensor:
    """What fp8 rows stand for: `quantize_row_groups`, then each value times its group's scale (fp32)."""
    from afd.kernels.moe_tiles import quantize_row_groups

    q, scale = quantize_row_groups(x, group)
    return q.float() * scale.repeat_interleave(group, dim=1)


def _expert_on_fp8_rows(w13: torch.Tensor, w2: torch.Tensor, row: torch.Tensor, group: int) -> torch.Tensor:
    """One expert on one already quantized row, its SwiGLU output quantized as the kernels do (fp32)."""
    gate, up = (w13 @ row).split(w2.shape[1])
    return w2 @ _dequantize_rows((torch.nn.functional.silu(gate) * up)[None], group)[0]


# (block, H, I, T): b1 divides H and I; several tokens where the interpreter is quick, one on the release's blocks
ROW_SHAPES = [((16, 16), 160, 144, 9), ((32, 32), 128, 96, 5), ((128, 128), 256, 128, 1)]


@cpu_only
@pytest.mark.parametrize(("block", "hidden", "inter", "T"), ROW_SHAPES, ids=["16x16", "32x32", "128x128"])
def test_fp8_rows_equal_the_loop_over_quantized_rows(block, hidden, inter, T):
    """`fp8_rows`: x and each pair's SwiGLU output quantized per row in groups of b1, both GEMMs on fp8 x fp8 = a
    loop over the pairs in fp32 on the same quantized values (1e-5 of the largest output), and within a few percent
    of the bf16-rows path (the cost of quantizing the activations)."""
    q = fp8_experts(E, hidden, inter, block, seed=T)
    x = torch.randn(T, hidden, generator=torch.Generator().manual_seed(T))
    r = _routing(T, E, 2, seed=T)
    w13, w2 = q.dequantized(torch.float32)
    ref = torch.zeros(T, hidden)
    xs = _dequantize_rows(x, block[1])
    for t in range(T):
        for k in range(2):
            e = int(r.topk_ids[t, k])
            ref[t] += r.topk_weights[t, k] * _expert_on_fp8_rows(w13[e], w2[e], xs[t], block[1])
    got = kmoe.fused_routed_experts(x, r.topk_ids, r.topk_weights, q.w13, q.w2, 0, scales=_scales(q), fp8_rows=True)
    assert got.shape == (T, hidden) and _rel(got, ref) <= 1e-5, f"relative error {_rel(got, ref):.2e}"
    plain = kmoe.fused_routed_experts(x, r.topk_ids, r.topk_weights, q.w13, q.w2, 0, scales=_scales(q))
    assert _rel(got, plain) <= 0.1


@cpu_only
def test_fp8_rows_in_the_grouped_form_equal_the_loop_over_quantized_rows():
    """The async form with `fp8_rows`: grouped rows (empty experts, padding rows) against the same loop per row."""
    block, hidden, inter, _ = ROW_SHAPES[1]
    sizes = [3, 0, 5, 1, 0, 2]
    q = fp8_experts(len(sizes), hidden, inter, block, seed=4)
    n = sum(sizes)
    x = torch.randn(n + 3, hidden, generator=torch.Generator().manual_seed(n))
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    w13, w2 = q.dequantized(torch.float32)
    xs = _dequantize_rows(x[:n], block[1])
    experts = [e for e, size in enumerate(sizes) for _ in range(size)]
    ref = torch.stack([_expert_on_fp8_rows(w13[e], w2[e], xs[r], block[1]) for r, e in enumerate(experts)])
    got = kmoe.fused_grouped_expert_mlp(x, offs, q.w13, q.w2, scales=_scales(q), fp8_rows=True)
    assert got.dtype == x.dtype and _rel(got[:n], ref) <= 1e-5, f"relative error {_rel(got[:n], ref):.2e}"


def test_fp8_rows_are_refused_where_they_cannot_be_grouped():
    from afd.kernels.moe_tiles import quantize_row_groups

    with pytest.raises(ValueError, match="groups of 128"):
        quantize_row_groups(torch.randn(2, 160), 128)
    x = torch.randn(2, 32)
    with pytest.raises(ValueError, match="need FP8 experts"):
        kmoe.fused_routed_experts(x, torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1), torch.randn(1, 8, 32),
                                  torch.randn(1, 32, 4), fp8_rows=True)  # fmt: skip
