"""The GPU half of tests/unit/test_kernel_moe.py: bf16 and real model shapes on CUDA, graphs and host syncs."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import warnings  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("triton")

from helpers.kernels_moe import _experts, _routing

import afd.model.moe as moe  # noqa: E402
from afd.kernels import eager_ops  # noqa: E402
from afd.kernels import fused_moe as kmoe  # noqa: E402
from afd.model.moe import grouped_expert_mlp, routed_experts  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# ----------------------------------------------------------------------------------------------- GPU

V2_LITE = {"E": 64, "H": 2048, "I": 1408, "K": 6}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _oracle_fp32(x, ids, weights, w13, w2, start) -> torch.Tensor:
    """The definition in fp32 (bf16 inputs upcast, fp32 SwiGLU): the exact loop with fp32 weights."""
    return routed_experts(x.float(), ids, weights, w13.float(), w2.float(), start, fixed_shape=False)


def _kernels_off():
    """The eager-ops path (`torch._grouped_mm`) of the same functions."""
    return eager_ops()


def _grouped_mm_ok() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(300)
def test_gpu_fused_routed_experts_bf16_v2_lite():
    """V2-Lite shapes, bf16, T in {1, 8, 64, 256}, all experts and a shard [16, 48): relative (Frobenius) error to
    the fp32 oracle <= 5e-3 (the kernel rounds only act to bf16; the grouped_mm path also rounds gate/up and y,
    so it is held to 1e-2 of the kernel); two runs give the same bits; `routed_experts` dispatches to it."""
    c = V2_LITE
    w13, w2 = _experts(c["E"], c["H"], c["I"], torch.bfloat16, "cuda")
    for T in (1, 8, 64, 256):
        x = torch.randn(T, c["H"], device="cuda", dtype=torch.bfloat16)
        r = _routing(T, c["E"], c["K"], device="cuda", seed=T)
        for start, stop in ((0, c["E"]), (16, 48)):
            args = (x, r.topk_ids, r.topk_weights, w13[start:stop], w2[start:stop], start)
            got = kmoe.fused_routed_experts(*args)
            again = kmoe.fused_routed_experts(*args)
            oracle = _oracle_fp32(*args)
            assert torch.equal(got, again), f"T={T} [{start}, {stop}): two runs differ"
            rel = _rel(got, oracle)
            assert rel <= 5e-3, f"T={T} [{start}, {stop}): relative error to the fp32 oracle {rel:.2e}"
            assert torch.equal(routed_experts(*args, fixed_shape=True), got), "routed_experts did not dispatch"
            if _grouped_mm_ok():
                with _kernels_off():
                    eager = routed_experts(*args, fixed_shape=True)
                assert _rel(got, eager) <= 1e-2, f"T={T}: kernel vs grouped_mm {_rel(got, eager):.2e}"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(300)
def test_gpu_prefill_sized_routed_experts_take_the_one_pass_combine():
    """Above the decode kernels' size (T*K > FUSED_MOE_MAX_PAIRS) the grouped GEMM stays, followed by `silu_mul`
    and `combine_sorted_pairs`: V2-Lite shapes, bf16, T = 1024 and 4096, all experts and a shard: within 1e-2 of
    the fp32 oracle and of the eager glue (which rounds the same bf16 products), same bits on two runs."""
    if not _grouped_mm_ok():
        pytest.skip("needs torch._grouped_mm (sm90+)")
    c = V2_LITE
    w13, w2 = _experts(c["E"], c["H"], c["I"], torch.bfloat16, "cuda")
    for T in (1024, 4096):
        assert T * c["K"] > moe.FUSED_MOE_MAX_PAIRS
        x = torch.randn(T, c["H"], device="cuda", dtype=torch.bfloat16)
        r = _routing(T, c["E"], c["K"], device="cuda", seed=T)
        for start, stop in ((0, c["E"]), (16, 48)):
            args = (x, r.topk_ids, r.topk_weights, w13[start:stop], w2[start:stop], start)
            got = routed_experts(*args, fixed_shape=True)
            assert torch.equal(got, routed_experts(*args, fixed_shape=True)), f"T={T}: two runs differ"
            assert _rel(got, _oracle_fp32(*args)) <= 1e-2, f"T={T} [{start}, {stop}): vs the fp32 oracle"
            with _kernels_off():
                eager = routed_experts(*args, fixed_shape=True)
            assert _rel(got, eager) <= 1e-3, f"T={T} [{start}, {stop}): vs the eager glue {_rel(got, eager):.2e}"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gpu_fused_routed_experts_fp16_fp32(dtype):
    """The other dtypes the kernels take, on V2-Lite shapes (T in {8, 64}, a shard): relative error to the fp32
    oracle <= 5e-3 in fp16 and <= 1e-5 in fp32 (fp32 products, not tf32); also the grouped (async) form."""
    c = V2_LITE
    w13, w2 = _experts(c["E"], c["H"], c["I"], dtype, "cuda")
    bound = 1e-5 if dtype == torch.float32 else 5e-3
    for T in (8, 64):
        x = torch.randn(T, c["H"], device="cuda", dtype=dtype)
        r = _routing(T, c["E"], c["K"], device="cuda", seed=T)
        args = (x, r.topk_ids, r.topk_weights, w13[16:48], w2[16:48], 16)
        rel = _rel(kmoe.fused_routed_experts(*args), _oracle_fp32(*args))
        assert rel <= bound, f"{dtype} T={T}: relative error {rel:.2e}"
        sizes = [T // 4, 0, T // 2, T - T // 4 - T // 2]
        offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32).cuda()
        got = kmoe.fused_grouped_expert_mlp(x, offs, w13[:4], w2[:4])
        ref = grouped_expert_mlp(x.float(), sizes, w13[:4].float(), w2[:4].float(), use_grouped_mm=False)
        assert _rel(got, ref) <= bound, f"{dtype} T={T} grouped: relative error {_rel(got, ref):.2e}"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(300)
def test_gpu_fused_grouped_expert_mlp_bf16_v2_lite():
    """The async form at V2-Lite shapes (32 local experts, uneven groups incl. empty ones, padding rows): every
    grouped row within 1e-2 relative error of the fp32 loop; `grouped_expert_mlp_offsets` dispatches to it."""
    c = V2_LITE
    w13, w2 = _experts(32, c["H"], c["I"], torch.bfloat16, "cuda")
    g = torch.Generator().manual_seed(0)
    for total in (6, 48, 384):
        sizes = torch.multinomial(torch.ones(32), total, replacement=True, generator=g).bincount(minlength=32)
        sizes[3] = 0
        n = int(sizes.sum())
        x = torch.randn(n + 5, c["H"], device="cuda", dtype=torch.bfloat16)
        offs = sizes.cumsum(0).to(torch.int32).cuda()
        got = kmoe.fused_grouped_expert_mlp(x, offs, w13, w2)
        ref = grouped_expert_mlp(x[:n].float(), sizes.tolist(), w13.float(), w2.float(), use_grouped_mm=False)
        assert _rel(got[:n], ref) <= 1e-2, f"{n} rows: relative error {_rel(got[:n], ref):.2e}"
        assert torch.equal(moe.grouped_expert_mlp_offsets(x, offs, w13, w2)[:n], got[:n])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(300)
def test_gpu_fused_moe_replays_from_a_cuda_graph_and_never_syncs():
    """Captured in a CUDA graph per T, replayed with new rows and routing copied into the captured inputs, the
    kernels give the same bits as eager; an eager call makes no host synchronisation."""
    c = V2_LITE
    w13, w2 = _experts(c["E"], c["H"], c["I"], torch.bfloat16, "cuda")
    for T in (1, 8, 64, 256):
        x = torch.randn(T, c["H"], device="cuda", dtype=torch.bfloat16)
        r = _routing(T, c["E"], c["K"], device="cuda", seed=1)
        ids, weights = r.topk_ids.clone(), r.topk_weights.clone()
        shard = (w13[8:56], w2[8:56], 8)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up (compiles) off the capture
            kmoe.fused_routed_experts(x, ids, weights, *shard)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = kmoe.fused_routed_experts(x, ids, weights, *shard)
        for seed in (2, 3):
            r = _routing(T, c["E"], c["K"], device="cuda", seed=seed)
            x.copy_(torch.randn(T, c["H"], device="cuda", dtype=torch.bfloat16))
            ids.copy_(r.topk_ids)
            weights.copy_(r.topk_weights)
            graph.replay()
            assert torch.equal(static_out, kmoe.fused_routed_experts(x, ids, weights, *shard)), f"T={T} seed={seed}"
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                kmoe.fused_routed_experts(x, ids, weights, *shard)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        syncs = [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]
        assert not syncs, f"T={T}: host syncs at {syncs}"
