"""The GPU half of tests/kernels/test_kernel_fp8_linear.py: the block-scaled FP8 linear kernel with bf16 rows at
DeepSeek-V2-Lite and V3 linear shapes against the fp32 reference, FP8Linear's dispatch, CUDA-graph replay and host
syncs. Skipped without CUDA (the interpreter cannot check bf16: see the unit test's docstring)."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402
from helpers.kernels_fp8_linear import fp8_weight  # noqa: E402

from afd.kernels import eager_ops  # noqa: E402
from afd.kernels.fp8_linear import (  # noqa: E402
    LinearConfig,
    dequantize_weight,
    fp8_linear,
    fp8_linear_reference,
    split_counters,
    takes_kernel,
)
from afd.model.fp8 import FP8Linear, dequantize  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_fp8 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs sm89+ (fp8 in Triton)"
)
# (N, K) of the linears FP8Linear runs: V2-Lite q_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj, dense gate/up and
# down, shared experts' gate/up and down; V3 q_a_proj, q_b_proj, kv_a_proj_with_mqa, o_proj
SHAPES = [
    (3072, 2048),
    (576, 2048),
    (4096, 512),
    (2048, 2048),
    (10944, 2048),
    (2048, 10944),
    (2816, 2048),
    (2048, 2816),
    (1536, 7168),
    (24576, 1536),
    (576, 7168),
    (7168, 16384),
]
ROWS = (1, 7, 64, 100, 200, 256, 300, 2048)  # 100, 200: partial row tiles of the 128 and 256 buckets
# the kernel quantizes its rows to e4m3 per 128 columns (3 mantissa bits): its output moves by ~2-3% of its norm
# from the same weights on 16-bit rows
ROWS_QUANTIZED = 5e-2


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _layer(n: int, k: int, block: tuple[int, int], bias: bool = False) -> FP8Linear:
    layer = FP8Linear(k, n, block, bias=bias).cuda()
    layer.weight.data, layer.weight_scale_inv.data = fp8_weight(n, k, block, device="cuda")
    if bias:
        layer.bias.data = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    return layer


@pytest.mark.gpu
@needs_cuda
@needs_fp8
@pytest.mark.timeout(600)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_gpu_fp8_linear_bf16_against_the_fp32_reference(shape):
    """bf16 rows, 128 x 128 blocks, the kernel's sizes and the dense path's (`takes_kernel`): the kernel within 5e-3
    of the fp32 reference (rows quantized per 128 columns) and within `ROWS_QUANTIZED` of F.linear on bf16 rows and
    the weight dequantized to bf16; the dense path is that F.linear, bit for bit; two runs give the same bits (K
    splits are summed in a fixed order); FP8Linear dispatches to it. The dense path's one-launch dequantization
    equals the model's PyTorch expansion, bit for bit."""
    n, k = shape
    layer = _layer(n, k, (128, 128))
    w, s = layer.weight, layer.weight_scale_inv
    dense = dequantize(w, s, (128, 128), torch.bfloat16)  # PyTorch ops, not the Triton pass
    assert torch.equal(dequantize_weight(w, s, (128, 128), torch.bfloat16), dense)
    for rows in ROWS:
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        got = fp8_linear(x, w, s, (128, 128))
        assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
        assert torch.equal(got, fp8_linear(x, w, s, (128, 128))), f"M={rows}: runs differ"
        if takes_kernel(rows, n):
            err = _rel(got, fp8_linear_reference(x.float(), w, s, (128, 128)))
            assert err <= 5e-3, f"M={rows} (kernel): vs fp32 reference {err:.2e}"
            assert _rel(got, F.linear(x, dense)) <= ROWS_QUANTIZED, f"M={rows}: vs bf16 rows"
        else:
            assert torch.equal(got, F.linear(x, dense)), f"M={rows}: the dense path is not F.linear on the rows"
        assert torch.equal(layer(x), got), f"M={rows}: FP8Linear did not take the kernel"


@pytest.mark.gpu
@needs_cuda
@needs_fp8
@pytest.mark.timeout(300)
@pytest.mark.parametrize("block", [(32, 32), (24, 32), (128, 128)], ids=lambda b: f"{b[0]}x{b[1]}")
def test_gpu_fp8_linear_blocks_tiles_and_bias(block):
    """Ragged shapes (N, K not multiples of the block or the tiles), a bias, the table's tiles and others with K
    splits, at and past the table's rows, bf16 and fp16 rows: the kernel within 5e-3 of the fp32 reference (rows
    quantized), the dense path past the table within 5e-3 of fp32 F.linear on the rows as they are."""
    n, k = 1000, 1120
    layer = _layer(n, k, block, bias=True)
    args = (layer.weight, layer.weight_scale_inv, block, layer.bias)
    configs = (None, LinearConfig(16, 32, 64, split_k=4), LinearConfig(64, 64, 128))
    for dtype in (torch.bfloat16, torch.float16):
        for rows in (1, 33, 64, 300):
            x = torch.randn(rows, k, device="cuda", dtype=dtype)
            quantized = fp8_linear_reference(x.float(), *args)
            as_is = F.linear(x.float(), layer.dequantized(torch.float32), layer.bias.float())
            for config in configs:
                got = fp8_linear(x, *args, config=config)
                ref = as_is if config is None and not takes_kernel(rows, n) else quantized
                assert _rel(got, ref) <= 5e-3, f"{dtype} M={rows} {config}: {_rel(got, ref):.2e}"


@pytest.mark.gpu
@needs_cuda
@needs_fp8
@pytest.mark.timeout(300)
def test_gpu_fp8_linear_k_splits_are_summed_by_each_tiles_last_program():
    """fp32 rows and outputs, with and without K splits (the table's and forced), a bias: within 5e-4 of the fp32
    reference (Hopper's fp8 MMAs keep fewer bits than fp32 in their sums: ~1e-4 seen); repeated calls give the same
    bits, and the split counters are left at zero for the next launch."""
    for n, k in ((576, 2048), (2048, 1408), (4096, 512)):
        layer = _layer(n, k, (128, 128), bias=True)
        w, s, b = layer.weight, layer.weight_scale_inv, layer.bias.float()
        for rows in (1, 16, 64, 256):
            x = torch.randn(rows, k, device="cuda") * torch.logspace(-2, 2, rows, device="cuda")[:, None]
            ref = fp8_linear_reference(x, w, s, (128, 128), b)
            for config in (None, LinearConfig(16, 32, 128, split_k=4), LinearConfig(64, 64, 128, split_k=2)):
                if config is None and not takes_kernel(rows, n):
                    continue
                got = fp8_linear(x, w, s, (128, 128), b, config=config)
                assert _rel(got, ref) <= 5e-4, f"{n}x{k} M={rows} {config}: {_rel(got, ref):.2e}"
                assert torch.equal(got, fp8_linear(x, w, s, (128, 128), b, config=config)), f"{n}x{k} M={rows}"
        assert not split_counters(x.device, 1).any()


@pytest.mark.gpu
@needs_cuda
@needs_fp8
@pytest.mark.timeout(300)
def test_gpu_fp8_linear_replays_from_a_cuda_graph_and_never_syncs():
    """FP8Linear captured per M (decode buckets, a K-split shape, prefill), replayed with new rows copied in: the same
    bits as eager; an eager call makes no host synchronisation; inside `eager_ops` it takes the dequantized path."""
    for n, k in ((576, 7168), (2048, 2048), (4096, 512)):  # the last wide: the kernel at 256 rows too
        layer = _layer(n, k, (128, 128), bias=True)
        for rows in (1, 64, 256, 1024):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # compiles off the capture
                layer(x)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = layer(x)
            for _ in range(2):
                x.copy_(torch.randn(rows, k, device="cuda", dtype=torch.bfloat16))
                graph.replay()
                assert torch.equal(static_out, layer(x)), f"{n}x{k} M={rows}: replay differs from eager"
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    layer(x)
            finally:
                torch.cuda.set_sync_debug_mode(0)
            syncs = [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]
            assert not syncs, f"{n}x{k} M={rows}: host syncs at {syncs}"
            with eager_ops():
                assert not layer.uses_kernel(x)
                eager = layer(x)
            assert _rel(layer(x), eager) <= ROWS_QUANTIZED  # eager: bf16 rows, the weight dequantized
