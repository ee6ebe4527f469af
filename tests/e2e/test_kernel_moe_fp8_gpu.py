"""The GPU half of tests/unit/test_kernel_moe_fp8.py: block-scaled FP8 experts with bf16 activations at V2-Lite
shapes, the FFN layer with FP8 experts against the same layer on the dequantized bf16 weights, CUDA graphs, host
syncs. Skipped without CUDA (the interpreter cannot check bf16: see the unit test's docstring)."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("triton")

from helpers.kernels_moe import _routing  # noqa: E402
from helpers.kernels_moe_fp8 import fp8_experts  # noqa: E402

import afd.kernels.fused_moe as kmoe  # noqa: E402
import afd.model.moe as moe  # noqa: E402
from afd.kernels import eager_ops  # noqa: E402
from afd.model.fp8 import FP8Experts  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
V2_LITE = {"E": 64, "H": 2048, "I": 1408, "K": 6}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _scales(q: FP8Experts) -> kmoe.ExpertScales:
    return kmoe.ExpertScales(q.w13_scale_inv, q.w2_scale_inv, q.block)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(300)
@pytest.mark.parametrize("block", [(128, 128), (16, 16)], ids=["128x128", "16x16"])
def test_gpu_fp8_routed_experts_bf16_v2_lite(block):
    """V2-Lite shapes, bf16 rows, FP8 experts: relative error to the fp32 loop on the dequantized weights <= 5e-3
    (the kernel's products are exact e4m3 x bf16; it rounds only act to bf16), within 1e-2 of the bf16 kernel on
    the weights dequantized to bf16; two runs give the same bits; `fp8_routed_experts` dispatches to it."""
    c = V2_LITE
    q = fp8_experts(c["E"], c["H"], c["I"], block, device="cuda")
    for T in (1, 8, 64, 256):
        x = torch.randn(T, c["H"], device="cuda", dtype=torch.bfloat16)
        r = _routing(T, c["E"], c["K"], device="cuda", seed=T)
        for start, stop in ((0, c["E"]), (16, 48)):
            s = q.shard(start, stop)
            args = (x, r.topk_ids, r.topk_weights, s.w13, s.w2, start)
            got = kmoe.fused_routed_experts(*args, scales=_scales(s))
            assert torch.equal(got, kmoe.fused_routed_experts(*args, scales=_scales(s))), f"T={T}: runs differ"
            w13, w2 = s.dequantized(torch.float32)
            oracle = moe.routed_experts(x.float(), r.topk_ids, r.topk_weights, w13, w2, start, fixed_shape=False)
            assert _rel(got, oracle) <= 5e-3, f"T={T} [{start}, {stop}): vs fp32 {_rel(got, oracle):.2e}"
            b13, b2 = s.dequantized(torch.bfloat16)
            bf16 = kmoe.fused_routed_experts(x, r.topk_ids, r.topk_weights, b13, b2, start)
            assert _rel(got, bf16) <= 1e-2, f"T={T} [{start}, {stop}): vs bf16 kernel {_rel(got, bf16):.2e}"
            dispatched = moe.fp8_routed_experts(x, r.topk_ids, r.topk_weights, s, start, fixed_shape=True)
            assert torch.equal(dispatched, got), "fp8_routed_experts did not take the kernel"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(300)
def test_gpu_fp8_rows_v2_lite_stay_close_to_bf16_rows_and_capture():
    """`fp8_rows` at V2-Lite shapes (128 x 128 blocks, bf16 rows quantized in groups of 128): within 5e-2 of the
    fp32 loop on the dequantized weights and bf16 rows (the activations' own quantization), two runs the same bits,
    and a CUDA graph replay the same bits as eager."""
    c = V2_LITE
    q = fp8_experts(c["E"], c["H"], c["I"], (128, 128), device="cuda")
    w13, w2 = q.dequantized(torch.float32)
    for T in (1, 8, 64, 256):
        x = torch.randn(T, c["H"], device="cuda", dtype=torch.bfloat16)
        r = _routing(T, c["E"], c["K"], device="cuda", seed=T)

        def run(x=x, r=r):
            return kmoe.fused_routed_experts(x, r.topk_ids, r.topk_weights, q.w13, q.w2, 0, scales=_scales(q),
                                             fp8_rows=True)  # fmt: skip

        got = run()
        assert torch.equal(got, run()), f"T={T}: runs differ"
        oracle = moe.routed_experts(x.float(), r.topk_ids, r.topk_weights, w13, w2, 0, fixed_shape=False)
        assert _rel(got, oracle) <= 5e-2, f"T={T}: vs fp32 {_rel(got, oracle):.2e}"
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = run()
        graph.replay()
        assert torch.equal(static_out, got), f"T={T}: the replay differs"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(300)
def test_gpu_fp8_grouped_expert_mlp_bf16_v2_lite():
    """The async form: 32 local FP8 experts, uneven groups incl. an empty one, padding rows; within 1e-2 of the
    fp32 loop on the dequantized weights; `fp8_grouped_expert_mlp_offsets` dispatches to it."""
    c = V2_LITE
    q = fp8_experts(32, c["H"], c["I"], (128, 128), device="cuda")
    w13, w2 = q.dequantized(torch.float32)
    g = torch.Generator().manual_seed(0)
    for total in (6, 48, 384):
        sizes = torch.multinomial(torch.ones(32), total, replacement=True, generator=g).bincount(minlength=32)
        sizes[3] = 0
        n = int(sizes.sum())
        x = torch.randn(n + 5, c["H"], device="cuda", dtype=torch.bfloat16)
        offs = sizes.cumsum(0).to(torch.int32).cuda()
        got = kmoe.fused_grouped_expert_mlp(x, offs, q.w13, q.w2, scales=_scales(q))
        ref = moe.grouped_expert_mlp(x[:n].float(), sizes.tolist(), w13, w2, use_grouped_mm=False)
        assert _rel(got[:n], ref) <= 1e-2, f"{n} rows: relative error {_rel(got[:n], ref):.2e}"
        assert torch.equal(moe.fp8_grouped_expert_mlp_offsets(x, offs, q)[:n], got[:n])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(300)
def test_gpu_fp8_moe_replays_from_a_cuda_graph_and_never_syncs():
    """Captured per T, replayed with new rows and routing copied in: the same bits as eager; an eager call makes
    no host synchronisation."""
    c = V2_LITE
    q = fp8_experts(c["E"], c["H"], c["I"], (128, 128), device="cuda").shard(8, 56)
    for T in (1, 8, 64, 256):
        x = torch.randn(T, c["H"], device="cuda", dtype=torch.bfloat16)
        r = _routing(T, c["E"], c["K"], device="cuda", seed=1)
        ids, weights = r.topk_ids.clone(), r.topk_weights.clone()

        def run(x=x, ids=ids, weights=weights):
            return moe.fp8_routed_experts(x, ids, weights, q, 8, fixed_shape=True)

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # compiles off the capture
            run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = run()
        for seed in (2, 3):
            r = _routing(T, c["E"], c["K"], device="cuda", seed=seed)
            x.copy_(torch.randn(T, c["H"], device="cuda", dtype=torch.bfloat16))
            ids.copy_(r.topk_ids)
            weights.copy_(r.topk_weights)
            graph.replay()
            assert torch.equal(static_out, run()), f"T={T} seed={seed}"
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                run()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        syncs = [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]
        assert not syncs, f"T={T}: host syncs at {syncs}"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(600)
def test_gpu_fp8_ffn_layer_matches_the_dequantized_bf16_layer():
    """DeepSeek-V2-Lite with `quantization="fp8"` in bf16: one MoE layer's FFN output (routed experts in the FP8
    kernels, shared experts dequantized per call) against the same layer with every FP8 weight dequantized to bf16
    first (`eager_ops`: the dequantize + `torch._grouped_mm` path), relative error <= 1e-2 for decode sizes; the
    grouped (async) form too."""
    from afd.model.weights import load_ffn_model

    ffn = load_ffn_model("deepseek-v2-lite", dtype="bfloat16", device="cuda", quantization="fp8")
    config = ffn.config
    layer = next(i for i in range(config.num_hidden_layers) if config.is_moe_layer(i))
    assert ffn._layer(layer).experts.fp8() is not None
    for T in (1, 8, 64, 256):
        x = torch.randn(T, config.hidden_size, device="cuda", dtype=torch.bfloat16) * 0.5
        r = _routing(T, config.n_routed_experts, config.num_experts_per_tok, device="cuda", seed=T)
        got = ffn(layer, x, r)
        with eager_ops():
            ref = ffn(layer, x, r)
        assert _rel(got, ref) <= 1e-2, f"T={T}: fp8 layer vs dequantized bf16 layer {_rel(got, ref):.2e}"
        sizes = [T] + [0] * (ffn.num_local_experts - 1)
        grouped = ffn.experts(layer, x, sizes)
        with eager_ops():
            grouped_ref = ffn.experts(layer, x, sizes)
        assert _rel(grouped, grouped_ref) <= 1e-2, f"T={T}: grouped form {_rel(grouped, grouped_ref):.2e}"
