"""The GPU half of tests/kernels/test_kernel_moe_fp8.py: block-scaled FP8 experts (fp8 rows, fp8 x fp8 MMAs) with bf16
activations at V2-Lite shapes, decode and prefill sizes, the FFN layer with FP8 experts against the same layer on the
dequantized bf16 weights, CUDA graphs, host syncs. Skipped without CUDA (the interpreter cannot check bf16: see the
unit test's docstring).

Tolerances (relative L2 norm; measured on an H200, 2026-12-02): the kernels against the eager loop over the same
quantized values (`helpers.kernels_moe_fp8.fp8_rows_routed_reference`) 1e-2 (measured 1.0-5.7e-3: fp32 summation
order and the odd activation that rounds to the neighbouring fp8 value); against unquantized bf16/fp32 rows 6e-2
(measured 3.8-4.4e-2 at these random weights, 1.8e-2 for a whole V2-Lite FFN layer with its shared experts): what
quantizing the activations to e4m3 in 1 x b1 groups costs."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("triton")

from helpers.kernels_moe import _routing  # noqa: E402
from helpers.kernels_moe_fp8 import fp8_experts, fp8_rows_grouped_reference, fp8_rows_routed_reference  # noqa: E402

import afd.kernels.fused_moe as kmoe  # noqa: E402
import afd.model.moe as moe  # noqa: E402
from afd.kernels import eager_ops  # noqa: E402
from afd.model.fp8 import FP8Experts  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
V2_LITE = {"E": 64, "H": 2048, "I": 1408, "K": 6}
SAME_VALUES, FP8_ROWS = 1e-2, 6e-2


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _scales(q: FP8Experts) -> kmoe.ExpertScales:
    return kmoe.ExpertScales(q.w13_scale_inv, q.w2_scale_inv, q.block)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(300)
@pytest.mark.parametrize("block", [(128, 128), (32, 32)], ids=["128x128", "32x32"])
def test_gpu_fp8_routed_experts_bf16_v2_lite(block):
    """V2-Lite shapes, bf16 rows, FP8 experts, decode and prefill sizes (T*K up to 24576 pairs, past
    `FUSED_MOE_MAX_PAIRS`, on the row tiles from 1,024 tokens): within `SAME_VALUES` of the loop over the quantized
    rows, within `FP8_ROWS` of the fp32 loop on unquantized rows and of the bf16 kernel on the weights dequantized to
    bf16; two runs give the same bits; `fp8_routed_experts` dispatches to it at every size."""
    c = V2_LITE
    q = fp8_experts(c["E"], c["H"], c["I"], block, device="cuda")
    for T in (1, 8, 64, 256, 1024, 4096):  # seeded rows: one token's error varies by draw, so the bound is per input
        x = torch.randn(T, c["H"], generator=torch.Generator().manual_seed(T)).to("cuda", torch.bfloat16)
        r = _routing(T, c["E"], c["K"], device="cuda", seed=T)
        for start, stop in ((0, c["E"]), (16, 48)):
            s = q.shard(start, stop)
            args = (x, r.topk_ids, r.topk_weights, s.w13, s.w2, start)
            got = kmoe.fused_routed_experts(*args, scales=_scales(s))
            assert torch.equal(got, kmoe.fused_routed_experts(*args, scales=_scales(s))), f"T={T}: runs differ"
            ref = fp8_rows_routed_reference(x, r.topk_ids, r.topk_weights, s, start)
            assert _rel(got, ref) <= SAME_VALUES, f"T={T} [{start}, {stop}): vs the loop {_rel(got, ref):.2e}"
            w13, w2 = s.dequantized(torch.float32)
            oracle = moe.routed_experts(x.float(), r.topk_ids, r.topk_weights, w13, w2, start, fixed_shape=False)
            assert _rel(got, oracle) <= FP8_ROWS, f"T={T} [{start}, {stop}): vs fp32 {_rel(got, oracle):.2e}"
            b13, b2 = s.dequantized(torch.bfloat16)
            bf16 = kmoe.fused_routed_experts(x, r.topk_ids, r.topk_weights, b13, b2, start)
            assert _rel(got, bf16) <= FP8_ROWS, f"T={T} [{start}, {stop}): vs bf16 kernel {_rel(got, bf16):.2e}"
            dispatched = moe.fp8_routed_experts(x, r.topk_ids, r.topk_weights, s, start, fixed_shape=True)
            assert torch.equal(dispatched, got), f"T={T}: fp8_routed_experts did not take the kernels"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(300)
def test_gpu_fp8_grouped_expert_mlp_bf16_v2_lite():
    """The async form: 32 local FP8 experts, uneven groups incl. an empty one, padding rows, up to past
    `FUSED_MOE_MAX_PAIRS` rows; within `SAME_VALUES` of the loop over the quantized rows and `FP8_ROWS` of the fp32
    loop on unquantized rows; `fp8_grouped_expert_mlp_offsets` dispatches to it."""
    c = V2_LITE
    q = fp8_experts(32, c["H"], c["I"], (128, 128), device="cuda")
    w13, w2 = q.dequantized(torch.float32)
    g = torch.Generator().manual_seed(0)
    for total in (6, 48, 384, 3000):
        sizes = torch.multinomial(torch.ones(32), total, replacement=True, generator=g).bincount(minlength=32)
        sizes[3] = 0
        n = int(sizes.sum())
        x = torch.randn(n + 5, c["H"], generator=torch.Generator().manual_seed(total)).to("cuda", torch.bfloat16)
        offs = sizes.cumsum(0).to(torch.int32).cuda()
        got = kmoe.fused_grouped_expert_mlp(x, offs, q.w13, q.w2, scales=_scales(q))
        ref = fp8_rows_grouped_reference(x, sizes.tolist(), q)
        assert _rel(got[:n], ref) <= SAME_VALUES, f"{n} rows: vs the loop {_rel(got[:n], ref):.2e}"
        oracle = moe.grouped_expert_mlp(x[:n].float(), sizes.tolist(), w13, w2, use_grouped_mm=False)
        assert _rel(got[:n], oracle) <= FP8_ROWS, f"{n} rows: vs fp32 {_rel(got[:n], oracle):.2e}"
        assert torch.equal(moe.fp8_grouped_expert_mlp_offsets(x, offs, q)[:n], got[:n])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(300)
def test_gpu_fp8_moe_replays_from_a_cuda_graph_and_never_syncs():
    """Captured per T (decode and prefill sizes), replayed with new rows and routing copied in, padding rows routed
    to no expert (id -1, as the expert-pass graphs pad): the same bits as eager; an eager call makes no host
    synchronisation."""
    c = V2_LITE
    q = fp8_experts(c["E"], c["H"], c["I"], (128, 128), device="cuda").shard(8, 56)
    for T in (1, 8, 64, 256, 1024, 4096):
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
            if seed == 3:  # the last quarter of the rows: padding (zeros, weight 0, expert -1)
                x[T - T // 4 :].zero_()
                ids[T - T // 4 :] = -1
                weights[T - T // 4 :] = 0.0
            graph.replay()
            assert torch.equal(static_out, run()), f"T={T} seed={seed}"
            if seed == 3 and T >= 4:
                assert torch.equal(static_out[T - T // 4 :], torch.zeros_like(static_out[T - T // 4 :]))
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
@pytest.mark.timeout(300)
def test_gpu_row_tiles_quantize_the_swiglu_output_as_quantize_rows_does():
    """`moe_prefill.gate_up_rows` with the down projection's quantization in its epilogue gives the bits of its bf16
    output quantized by `fp8_quant.quantize_rows` (V2-Lite shapes, gathered rows, uneven groups with an empty one);
    the whole prefill-sized MoE on the row tiles against the decode kernels on the same batch within `SAME_VALUES`,
    and the same bits on a second run."""
    from afd.kernels.fp8_quant import quantize_rows
    from afd.kernels.moe_prefill import gate_up_rows
    from afd.kernels.moe_sort import sort_pairs
    from afd.kernels.moe_tiles import TileConfig

    c = V2_LITE
    q = fp8_experts(c["E"], c["H"], c["I"], (128, 128), device="cuda")
    T = 2048
    x = torch.randn(T, c["H"], generator=torch.Generator().manual_seed(0)).to("cuda", torch.bfloat16)
    r = _routing(T, c["E"], c["K"], device="cuda", seed=0)
    r.topk_ids[r.topk_ids == 5] = 6  # expert 5 gets no rows
    _, token_idx, offs = sort_pairs(r.topk_ids, 0, c["E"])
    rows, x_scale = quantize_rows(x, 128)
    args = (rows, x_scale, offs, q.w13, q.w13_scale_inv, q.block)
    act, none = gate_up_rows(*args, token_idx=token_idx)
    fused, fused_scale = gate_up_rows(*args, token_idx=token_idx, quantize_group=128)
    want, want_scale = quantize_rows(act, 128)
    assert none is None and fused.dtype == torch.float8_e4m3fn
    assert torch.equal(fused.view(torch.uint8), want.view(torch.uint8)) and torch.equal(fused_scale, want_scale)
    assert kmoe.takes_row_tiles(T, c["K"], c["E"], _scales(q))
    got = kmoe.fused_routed_experts(x, r.topk_ids, r.topk_weights, q.w13, q.w2, scales=_scales(q))
    assert torch.equal(got, kmoe.fused_routed_experts(x, r.topk_ids, r.topk_weights, q.w13, q.w2, scales=_scales(q)))
    decode_tiles = (TileConfig(64, 64, 128), TileConfig(64, 128, 64))
    decode = kmoe.fused_routed_experts(
        x, r.topk_ids, r.topk_weights, q.w13, q.w2, scales=_scales(q), configs=decode_tiles
    )
    assert _rel(got, decode) <= SAME_VALUES, f"row tiles vs decode kernels {_rel(got, decode):.2e}"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(600)
def test_gpu_fp8_ffn_layer_matches_the_dequantized_bf16_layer():
    """DeepSeek-V2-Lite with `quantization="fp8"` in bf16: one MoE layer's FFN output (routed experts in the FP8
    kernels with fp8 rows, shared experts in the FP8 linear kernel) against the same layer with every FP8 weight
    dequantized to bf16 first (`eager_ops`: the dequantize + `torch._grouped_mm` path), relative error <=
    `FP8_ROWS` for decode and prefill sizes; the grouped (async) form too."""
    from afd.model.weights import load_ffn_model

    ffn = load_ffn_model("deepseek-v2-lite", dtype="bfloat16", device="cuda", quantization="fp8")
    config = ffn.config
    layer = next(i for i in range(config.num_hidden_layers) if config.is_moe_layer(i))
    assert ffn._layer(layer).experts.fp8() is not None
    for T in (1, 8, 64, 256, 1024, 4096):
        x = torch.randn(T, config.hidden_size, device="cuda", dtype=torch.bfloat16) * 0.5
        r = _routing(T, config.n_routed_experts, config.num_experts_per_tok, device="cuda", seed=T)
        got = ffn(layer, x, r)
        with eager_ops():
            ref = ffn(layer, x, r)
        assert _rel(got, ref) <= FP8_ROWS, f"T={T}: fp8 layer vs dequantized bf16 layer {_rel(got, ref):.2e}"
        sizes = [T] + [0] * (ffn.num_local_experts - 1)
        grouped = ffn.experts(layer, x, sizes)
        with eager_ops():
            grouped_ref = ffn.experts(layer, x, sizes)
        assert _rel(grouped, grouped_ref) <= FP8_ROWS, f"T={T}: grouped form {_rel(grouped, grouped_ref):.2e}"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gpu_row_group_quantization_is_the_reference_bit_for_bit(dtype):
    """The one-launch quantization of the FP8 MoE's rows (`afd.kernels.fp8_quant`) gives the PyTorch reference's
    bits: V2-Lite's widths (2,048 and 1,408 in groups of 128), a ragged width (160 in 128 and 32), rows of very
    different magnitudes, an all-zero group (scale 1), a run of evenly spaced values; a strided view; and the
    same bits replayed from a CUDA graph."""
    from afd.kernels.fp8_quant import quantize_row_groups
    from afd.kernels.moe_tiles import quantize_row_groups as reference

    torch.manual_seed(0)
    for rows, width, group in ((1, 2048, 128), (37, 1408, 128), (300, 160, 128), (5, 160, 32)):
        x = (torch.randn(rows, width, device="cuda") * torch.logspace(-3, 3, rows, device="cuda")[:, None]).to(dtype)
        x[0, :group] = 0
        x[-1, : min(width, 64)] = torch.arange(min(width, 64), device="cuda", dtype=torch.float32).to(dtype) + 0.5
        q, s = quantize_row_groups(x, group)
        q_ref, s_ref = reference(x, group)
        assert torch.equal(s, s_ref), (rows, width, group)
        assert torch.equal(q.view(torch.uint8), q_ref.contiguous().view(torch.uint8)), (rows, width, group)
    wide = torch.randn(16, 4096, device="cuda", dtype=dtype)
    view = wide[:, :2048]  # rows 4,096 apart
    q, s = quantize_row_groups(view, 128)
    q_ref, s_ref = reference(view, 128)
    assert torch.equal(q.view(torch.uint8), q_ref.contiguous().view(torch.uint8)) and torch.equal(s, s_ref)
    graph = torch.cuda.CUDAGraph()
    static = torch.randn(8, 2048, device="cuda", dtype=dtype)
    quantize_row_groups(static, 128)  # compiled before the capture
    with torch.cuda.graph(graph):
        q_graph, s_graph = quantize_row_groups(static, 128)
    static.copy_(torch.randn(8, 2048, device="cuda", dtype=dtype))
    graph.replay()
    q_ref, s_ref = reference(static, 128)
    assert torch.equal(q_graph.view(torch.uint8), q_ref.contiguous().view(torch.uint8)) and torch.equal(s_graph, s_ref)
