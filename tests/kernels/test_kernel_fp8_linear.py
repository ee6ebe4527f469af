"""The block-scaled FP8 linear kernel (afd.kernels.fp8_linear) against its PyTorch reference and the model's own
dequantized path, its tile choice, its refusals, and FP8Linear's choice of it.

CPU: Triton's interpreter. The weights really are float8_e4m3fn there (the fp8 loads, the conversion and every
block-scale index run as on the GPU), and the rows are quantized to fp8 per b1 group by the PyTorch reference (the
interpreter converts fp32 to e4m3 wrongly); 16-bit rows are covered on CUDA only
(tests/e2e/test_kernel_fp8_linear_gpu.py). Blocks 32 x 32, 128 x 128 and a ragged (24, 32), N and K not multiples
of any of them; each block's magnitude differs by up to 64x, so a scale read from the wrong block fails the 1e-5
bound. Blocks 16 wide take the dequantized path (fp8 x fp8 MMAs step at least 32 along K).
"""

from __future__ import annotations

import itertools
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402
from helpers.kernels_fp8_linear import fp8_weight  # noqa: E402

import afd.kernels.fp8_linear as kfl  # noqa: E402
import afd.model.fp8 as fp8  # noqa: E402
from afd.kernels.fp8_linear import LinearConfig, choose_config, fp8_linear, fp8_linear_reference  # noqa: E402
from afd.kernels.moe_tiles import quantize_row_groups  # noqa: E402
from afd.model.fp8 import FP8Linear, dequantize  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
cpu_only = pytest.mark.skipif(not INTERPRET, reason="interpreter test (runs where there is no GPU)")

N, K = 200, 288  # two 128-blocks plus a ragged one along K, one plus a ragged one along N; ragged for 16 and 24 too
BLOCKS = [(32, 32), (128, 128), (24, 32)]
ROWS = [7, 20, 33]  # the 16, 32 and 64 buckets, each with a partial row tile (past 64: the dense path, own test)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _linear(block: tuple[int, int], bias: bool = False, seed: int = 0) -> FP8Linear:
    layer = FP8Linear(K, N, block, bias=bias)
    w, s = fp8_weight(N, K, block, seed=seed)
    layer.weight.data, layer.weight_scale_inv.data = w, s
    if bias:
        layer.bias.data = torch.randn(N, generator=torch.Generator().manual_seed(seed))
    return layer


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: f"{b[0]}x{b[1]}")
def test_reference_is_the_model_dequantized_path_on_quantized_rows(block):
    """The kernel's oracle beside it equals afd.model.fp8's dequantize + matmul (fp32, bias included) on rows
    quantized per b1 group; rows already on that grid come through unchanged."""
    layer = _linear(block, bias=True)
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(1))
    q, q_scale = quantize_row_groups(x, block[1])
    on_grid = q.float() * q_scale.repeat_interleave(block[1], dim=1)[:, :K]
    assert 0 < (on_grid - x).abs().max() < 0.1 * x.abs().max()  # quantizing moved the rows, a little
    w = dequantize(layer.weight, layer.weight_scale_inv, block)
    ref = fp8_linear_reference(x, layer.weight, layer.weight_scale_inv, block, layer.bias)
    torch.testing.assert_close(ref, F.linear(on_grid, w, layer.bias))
    again = fp8_linear_reference(on_grid, layer.weight, layer.weight_scale_inv, block)
    torch.testing.assert_close(again, on_grid @ w.T)


@cpu_only
@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: f"{b[0]}x{b[1]}")
@pytest.mark.parametrize("rows", ROWS)
def test_fp8_linear_equals_the_reference(block, rows):
    """The table's tiles (every bucket, K splits) = the fp32 reference within 1e-5 of the largest output."""
    w, s = fp8_weight(N, K, block, seed=rows)
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
    got = fp8_linear(x, w, s, block)
    assert got.dtype == x.dtype and got.shape == (rows, N)
    assert _rel(got, fp8_linear_reference(x, w, s, block)) <= 1e-5


@cpu_only
@pytest.mark.parametrize("tile", [kfl.DEQUANT_TILE, (64, 256), (16, 32)], ids=lambda t: f"tile{t[0]}x{t[1]}")
@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: f"{b[0]}x{b[1]}")
def test_dequantize_weight_is_the_model_dequantize_bit_for_bit(block, tile):
    """The one-launch dequantization the dense path multiplies by equals afd.model.fp8.dequantize exactly, ragged
    edges included, at the default tile and at the sweep's others, inside one block or across several (fp32 here:
    the interpreter truncates to bf16 where the GPU rounds, so bf16 is a GPU test)."""
    w, s = fp8_weight(N, K, block, seed=5)
    assert torch.equal(kfl.dequantize_weight(w, s, block, torch.float32, tile=tile), dequantize(w, s, block))


@cpu_only
@pytest.mark.parametrize(("inter", "hidden", "block"), [(40, 48, (16, 32)), (200, 288, (128, 128))])
def test_dequantize_weight_takes_stacks_and_their_halves(inter, hidden, block):
    """A stack of experts `[E, 2I, H]` read as views of its gate and up halves (each half's own ragged scale rows):
    the same bits as the model's dequantize, half by half; with blocks the tiles fit in (one scale a tile) and
    blocks smaller than a tile."""
    from afd.model.fp8 import quantize_experts

    w13 = torch.randn(3, 2 * inter, hidden, generator=torch.Generator().manual_seed(7))
    q = quantize_experts(w13, torch.randn(3, hidden, inter), block)
    half = q.w13_scale_inv.shape[1] // 2
    for rows, scales in ((slice(0, inter), slice(0, half)), (slice(inter, 2 * inter), slice(half, None))):
        w, s = q.w13[:, rows], q.w13_scale_inv[:, scales]
        assert torch.equal(kfl.dequantize_weight(w, s, q.block, torch.float32), dequantize(w, s, q.block))


@cpu_only
def test_where_the_kernel_does_not_take_the_rows_the_dense_path_runs(monkeypatch):
    """Past NARROW_MAX_ROWS for a weight narrower than WIDE_MIN_N, past KERNEL_MAX_ROWS for any: F.linear on the
    dequantized weight (bias included) and the rows as they are, bit for bit; a weight as wide as WIDE_MIN_N takes
    the kernel (fp8 rows) up to KERNEL_MAX_ROWS."""
    layer = _linear((128, 128), bias=True, seed=4)
    for rows in (kfl.NARROW_MAX_ROWS + 1, kfl.KERNEL_MAX_ROWS + 1):
        x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
        got = fp8_linear(x, layer.weight, layer.weight_scale_inv, layer.block, layer.bias)
        assert torch.equal(got, F.linear(x, layer.dequantized(torch.float32), layer.bias))
    monkeypatch.setattr(kfl, "WIDE_MIN_N", N)  # this weight counts as wide: the kernel's 256-row bucket
    x = torch.randn(kfl.NARROW_MAX_ROWS + 1, K, generator=torch.Generator().manual_seed(5))
    got = fp8_linear(x, layer.weight, layer.weight_scale_inv, layer.block, layer.bias)
    assert _rel(got, fp8_linear_reference(x, layer.weight, layer.weight_scale_inv, layer.block, layer.bias)) <= 1e-5
    assert not torch.equal(got, F.linear(x, layer.dequantized(torch.float32), layer.bias))


def test_padding_to_a_graph_bucket_never_changes_the_path():
    """A step's rows reach a linear padded to the engine's prefill or decode buckets in one process and to an FFN
    rank's pass buckets in another: for every count up to 2,000 rows and both a narrow and a wide weight, each
    padded count takes the path (kernel or dense) the real count takes, so padding never moves a step to the other
    path."""
    from afd.buckets import batch_buckets, pick_bucket, token_buckets
    from afd.connectors.asynchronous.ffn_chain import pass_buckets

    families = [token_buckets(8192), batch_buckets(1024), pass_buckets(8192), token_buckets(2000)]
    for out_features in (kfl.WIDE_MIN_N - 1, kfl.WIDE_MIN_N):
        for rows in range(1, 2001):
            want = kfl.takes_kernel(rows, out_features)
            for buckets in families:
                padded = pick_bucket(rows, buckets)
                if padded is not None:
                    assert kfl.takes_kernel(padded, out_features) == want, (rows, padded, out_features)
    assert kfl.takes_kernel(kfl.NARROW_MAX_ROWS, 1) and not kfl.takes_kernel(kfl.NARROW_MAX_ROWS + 1, 1)


CONFIGS = [
    LinearConfig(16, 16, 32),  # several N tiles, K steps per scale block
    LinearConfig(16, 32, 32, split_k=3),  # K split, fp32 partials summed after
    LinearConfig(32, 16, 64, split_k=2),
    LinearConfig(64, 64, 128),  # one wide step, cut to the block's width
]


@cpu_only
@pytest.mark.parametrize(
    ("block", "config"),
    list(zip(itertools.cycle(BLOCKS), CONFIGS)),  # each tile shape once, the blocks in turn (the interpreter is slow)
    ids=lambda v: f"{v[0]}x{v[1]}" if isinstance(v, tuple) else f"{v.block_m}x{v.block_n}x{v.block_k}s{v.split_k}",
)
def test_fp8_linear_tile_shapes_with_bias_and_leading_dims(block, config):
    """Tile shapes, K splits, a bias and rows `[2, 9, K]` (any leading shape; 18 rows, a partial
    row tile for every block_m) = the reference; a second call gives the same bits (a split's last program sums the
    partials and leaves its tile's counter at zero again)."""
    layer = _linear(block, bias=True, seed=3)
    x = torch.randn(2, 9, K, generator=torch.Generator().manual_seed(2))
    got = fp8_linear(x, layer.weight, layer.weight_scale_inv, block, layer.bias, config=config)
    ref = fp8_linear_reference(x, layer.weight, layer.weight_scale_inv, block, layer.bias)
    assert got.shape == (2, 9, N)
    assert _rel(got, ref) <= 1e-5
    assert torch.equal(got, fp8_linear(x, layer.weight, layer.weight_scale_inv, block, layer.bias, config=config))
    assert not kfl.split_counters(x.device, 1).any()


def test_tile_choice_depends_on_the_row_bucket_only():
    """Every M of a bucket gets one configuration (one compiled kernel); the K step divides the block's width (at
    least 32, an fp8 MMA's); a narrow N on many SMs splits K (each split at least 4 steps, at most 4 splits); past
    the last bucket the kernel is not chosen."""
    for bucket in kfl.ROW_BUCKETS:
        lo = bucket // 2 + 1 if bucket > 16 else 1
        assert choose_config(lo, 2048, 2048, (128, 128), 132) == choose_config(bucket, 2048, 2048, (128, 128), 132)

    def tile(n: int, k: int, rows: int = 1) -> tuple[int, int]:
        cfg = choose_config(rows, n, k, (128, 128), 132)
        return cfg.block_n, cfg.split_k

    # the H200 sweep's best at V2-Lite's shapes: q_proj, kv_a_proj, kv_b_proj (4 K steps: no split), dense gate/up
    # (171 tiles fill the GPU alone), dense down_proj
    assert [tile(3072, 2048), tile(576, 2048), tile(4096, 512), tile(10944, 2048), tile(2048, 10944)] == [
        (64, 4),
        (32, 4),
        (32, 1),
        (64, 1),
        (64, 4),
    ]
    assert tile(3072, 2048, rows=64) == (64, 1)  # four 16-row tiles of 48 weight tiles: no split
    kv_a = choose_config(1, 576, 7168, (128, 128), 132)  # V3's kv_a_proj at decode
    assert kv_a.split_k > 1 and kv_a.block_k == 128
    assert -(-7168 // 128) // kv_a.split_k >= kfl.MIN_K_STEPS_PER_SPLIT
    wide = choose_config(1, 24576, 1536, (128, 128), 132)  # V3's q_b_proj: N alone fills the GPU
    assert wide.split_k == 1 and wide.block_n == 64
    assert choose_config(1, 64, 96, (16, 96), 132).block_k == 32
    # 65-128 rows: 32-row tiles on a narrow weight, one 128-row tile on a wide one (V3's o_proj: its 112 weight
    # tiles leave SMs idle, so K splits)
    assert choose_config(100, 3072, 2048, (128, 128), 132) == kfl.LinearConfig(32, 64, 128, 1)
    assert choose_config(100, 7168, 16384, (128, 128), 132) == kfl.LinearConfig(128, 64, 128, 4, num_stages=3)
    assert choose_config(200, 7168, 16384, (128, 128), 132) == kfl.LinearConfig(128, 64, 128, 1, num_stages=3)
    with pytest.raises(ValueError, match="at most 256"):
        choose_config(kfl.KERNEL_MAX_ROWS + 1, 2048, 2048, (128, 128), 132)
    assert kfl.warm_up_rows(8192) == [16, 32, 64, 128, 256, 8192]
    assert kfl.warm_up_rows(40) == [16, 32, 64] and kfl.warm_up_rows(1) == [16] and kfl.warm_up_rows(100)[-1] == 128
    # past 128 rows (the smallest prefill bucket) only wide weights take the kernel; past 256 none
    assert [kfl.takes_kernel(m, n) for m, n in ((128, 576), (129, 576), (129, 4096), (256, 7168), (257, 7168))] == [
        True,
        False,
        True,
        True,
        False,
    ]


@cpu_only
def test_unsupported_inputs_are_refused_in_one_sentence():
    """16-bit weights, integer rows, a wrong width, scales of the wrong shape or dtype, a block width the kernel
    cannot step inside and a bias of the wrong size: ValueError naming the problem."""
    w, s = fp8_weight(N, K, (128, 128))
    x = torch.randn(3, K)
    with pytest.raises(ValueError, match="needs a 2-d"):
        fp8_linear(x, w.float(), s, (128, 128))
    with pytest.raises(ValueError, match="takes rows in one of"):
        fp8_linear(x.to(torch.int32), w, s, (128, 128))
    with pytest.raises(ValueError, match="do not fit weight"):
        fp8_linear(torch.randn(3, K + 1), w, s, (128, 128))
    with pytest.raises(ValueError, match="do not fit"):
        fp8_linear(x, w, s[:1], (128, 128))
    with pytest.raises(ValueError, match="do not fit"):
        fp8_linear(x, w, s.double(), (128, 128))
    with pytest.raises(ValueError, match="not supported"):
        fp8_linear(x, w, s, (128, 24))
    w16, s16 = fp8_weight(N, K, (16, 16))
    with pytest.raises(ValueError, match="not supported"):  # 16 wide: an fp8 MMA steps at least 32 along K
        fp8_linear(x, w16, s16, (16, 16))
    with pytest.raises(ValueError, match="bias"):
        fp8_linear(x, w, s, (128, 128), torch.zeros(N + 1))


def test_fp8_linear_off_the_kernel_is_the_dequantized_path():
    """Where the kernel does not run (CPU here), FP8Linear is F.linear on the dequantized weight, bit for bit."""
    layer = _linear((16, 16), bias=True)
    x = torch.randn(4, K)
    assert not layer.uses_kernel(x)
    assert torch.equal(layer(x), F.linear(x, layer.dequantized(torch.float32), layer.bias))
    assert fp8.warm_up_fp8_linears(torch.nn.Sequential(layer), torch.float32, 64) == 0


@cpu_only
def test_fp8_linear_takes_the_kernel_where_it_runs(monkeypatch):
    """With the kernel switched on (on CUDA: the device, the dtype and sm89+), FP8Linear calls it on its FP8 weight
    and scales, within 1e-5 of the reference (the dequantized path on rows quantized per b1 group); a block width it
    cannot step inside (24; 16) falls back; the warm-up compiles each distinct shape once, at every tile bucket."""
    calls: list[tuple[int, ...]] = []
    real = kfl.fp8_linear

    def recording(x, weight, scale, block, bias=None, **kw):
        calls.append(tuple(weight.shape))
        return real(x, weight, scale, block, bias, **kw)

    monkeypatch.setattr(fp8, "_fp8_linear_enabled", lambda device, dtype: True)
    monkeypatch.setattr(kfl, "fp8_linear", recording)
    layer = _linear((128, 128), bias=True)
    x = torch.randn(7, K, generator=torch.Generator().manual_seed(4))
    assert layer.uses_kernel(x)
    got = layer(x)
    assert calls == [(N, K)]
    ref = fp8_linear_reference(x, layer.weight, layer.weight_scale_inv, layer.block, layer.bias)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)

    odd = FP8Linear(K, N, (16, 24))  # b1 = 24: the kernel refuses it
    odd.weight.data, odd.weight_scale_inv.data = fp8_weight(N, K, (16, 24))
    calls.clear()
    assert not odd.uses_kernel(x)
    assert torch.equal(odd(x), F.linear(x, odd.dequantized(torch.float32)))
    assert calls == []

    warmed: list[tuple] = []
    monkeypatch.setattr(kfl, "warm_up", lambda w, s, block, dtype, rows, bias=None: warmed.append((w.shape, rows)))
    model = torch.nn.Sequential(
        layer, _linear((128, 128), bias=True, seed=1), odd, _linear((16, 16)), _linear((32, 32))
    )
    # two layers of one shape and block warmed once; the (16, 24) and (16, 16) blocks skipped; (32, 32) its own
    assert fp8.warm_up_fp8_linears(model, torch.float32, 512) == 2
    assert warmed == [((N, K), 512)] * 2


@cpu_only
def test_fp8_mlp_runs_its_projections_in_the_kernel(monkeypatch):
    """A tiny FP8 model's dense MLP (`quantization="fp8"`) with the kernel switched on: gate and up stacked into one
    kernel call (their weights and scales now views of the stack, the state dict's values unchanged), then down; the
    layer equals the same layer through the kernel's reference within 1e-5."""
    from afd.model.weights import load_ffn_model

    ffn = load_ffn_model("tiny", quantization="fp8", gate_on_attention=False)
    dense = next(i for i in range(ffn.config.num_hidden_layers) if not ffn.config.is_moe_layer(i))
    x = torch.randn(5, ffn.config.hidden_size, generator=torch.Generator().manual_seed(0))
    mlp = ffn.layers[str(dense)].mlp
    before = {k: v.clone() for k, v in mlp.state_dict().items()}
    monkeypatch.setattr(fp8, "_fp8_linear_enabled", lambda device, dtype: True)
    monkeypatch.setattr(kfl, "fp8_linear", fp8_linear_reference)
    ref = ffn(dense, x, None)
    calls: list[tuple[int, ...]] = []
    real = fp8_linear

    def recording(x, weight, *args, **kw):
        calls.append(tuple(weight.shape))
        return real(x, weight, *args, **kw)

    monkeypatch.setattr(kfl, "fp8_linear", recording)
    got = ffn(dense, x, None)
    inter, hidden = mlp.gate_proj.out_features, mlp.gate_proj.in_features
    assert calls == [(2 * inter, hidden), (hidden, inter)]
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    stack = mlp._fp8_gate_up.get()
    assert mlp.up_proj.weight.data_ptr() == stack.weight[inter:].data_ptr()
    assert mlp.up_proj.weight_scale_inv.data_ptr() == stack.weight_scale_inv[-1:].data_ptr()
    after = mlp.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())


@cpu_only
def test_stacked_fp8_linears_compute_each_parts_output_in_one_call(monkeypatch):
    """`StackedFP8` of two FP8Linears reading one input (a first part of whole scale blocks, a ragged last one): one
    kernel call over the stacked weight gives each part's own output (kernel reference, within 1e-6), the parts'
    tensors become views of the stack and are rebuilt into a new one if a loader replaces a part's weight; parts
    that cannot stack (a first part ending inside a scale block, a bias) run one by one; off the kernel, part by
    part."""
    block = (32, 32)
    first, last = FP8Linear(K, 64, block), FP8Linear(K, 40, block)
    for i, part in enumerate((first, last)):
        part.weight.data, part.weight_scale_inv.data = fp8_weight(part.out_features, K, block, seed=10 + i)
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(3))
    wanted = [fp8_linear_reference(x, p.weight, p.weight_scale_inv, block) for p in (first, last)]
    stacked = fp8.StackedFP8([first, last])
    assert [o.shape for o in stacked(x)] == [(3, 64), (3, 40)]  # CPU: part by part
    assert stacked._stack is None
    monkeypatch.setattr(fp8, "_fp8_linear_enabled", lambda device, dtype: True)
    calls: list[tuple[int, ...]] = []
    monkeypatch.setattr(
        kfl, "fp8_linear", lambda x, w, *a, **kw: calls.append(tuple(w.shape)) or fp8_linear_reference(x, w, *a, **kw)
    )
    got = stacked(x)
    assert calls == [(104, K)]
    for g, w in zip(got, wanted, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
    stack = stacked.get()
    assert last.weight.data_ptr() == stack.weight[64:].data_ptr()
    assert last.weight_scale_inv.data_ptr() == stack.weight_scale_inv[2:].data_ptr()
    last.weight.data = last.weight.data.clone()  # a loader's new tensor: the stack is built again around it
    assert stacked.get() is not stack and last.weight.data_ptr() == stacked.get().weight[64:].data_ptr()
    stack = stacked.get()
    first.weight_scale_inv.data = first.weight_scale_inv.data.clone()  # new scales alone: built again too
    assert stacked.get() is not stack and first.weight_scale_inv.data_ptr() == stacked.get().weight_scale_inv.data_ptr()
    ragged_first = fp8.StackedFP8([last, first])  # 40 rows end inside a 32-row scale block
    biased = FP8Linear(K, 64, block, bias=True)
    assert ragged_first.get() is None and fp8.StackedFP8([biased, last]).get() is None
    calls.clear()
    assert [o.shape for o in ragged_first(x)] == [(3, 40), (3, 64)] and len(calls) == 2
