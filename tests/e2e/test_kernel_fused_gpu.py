"""The GPU half of tests/unit/test_kernel_fused.py: bf16 and real model shapes on CUDA, graphs and host syncs."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402
from helpers.kernels_fused import HAS_CUDA, _cos_sin, _eager_rope, _norm

from afd.kernels import eager_ops  # noqa: E402
from afd.kernels.norm import rms_norm  # noqa: E402
from afd.kernels.rope import rope  # noqa: E402
from afd.kernels.swiglu import silu_mul  # noqa: E402
from afd.model.attention_side import MLP, apply_rope  # noqa: E402

gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


# --- GPU: bf16, DeepSeek-V2-Lite shapes ----------------------------------------------------------------------------

LITE = dict(hidden=2048, heads=16, kv_lora=512, rope=64, nope=128, shared_inter=2816, dense_inter=10944)
TOKENS = [1, 8, 256, 8192]
BF16_ULP = 2.0**-7  # spacing of bf16 just above 1, relative: an ulp is at most this of |value|


def _assert_bitwise(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bitwise equality; a failure says how far off it is (fraction equal, max |Δ| relative to |want|)."""
    if torch.equal(got, want):
        return
    diff = (got.float() - want.float()).abs()
    rel = float((diff / want.float().abs().clamp_min(1e-30)).max())
    equal = float((got == want).float().mean())
    raise AssertionError(
        f"{what}: not bitwise; {equal:.6f} of elements equal, max |Δ| {float(diff.max()):.3g}, "
        f"max |Δ|/|want| {rel:.3g} (a bf16 ulp is at most {BF16_ULP:.3g} of |want|)"
    )


def _ulp_bounded(got: torch.Tensor, want: torch.Tensor, ulps: int) -> tuple[bool, float]:
    """Whether every element is within `ulps` bf16 ulps of `want`, and the fraction that is bitwise equal."""
    diff = (got.float() - want.float()).abs()
    bound = ulps * BF16_ULP * want.float().abs() + 1e-30
    return bool((diff <= bound).all()), float((got == want).float().mean())


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("T", TOKENS)
def test_gpu_rms_norm_bf16(T):
    torch.manual_seed(10)
    dev = torch.device("cuda")
    for dim, strided in [(LITE["hidden"], False), (LITE["kv_lora"], True)]:
        norm = _norm(dim, torch.bfloat16, dev)
        full = torch.randn(T, dim + (LITE["rope"] if strided else 0), device=dev, dtype=torch.bfloat16)
        x = full[:, :dim]  # the kv_c half of kv_a_proj's output when strided
        got = rms_norm(x, norm.weight, norm.eps)
        with eager_ops():
            want = norm(x)
        # Only the order of the fp32 sum of squares differs: the normalizer may round the other way (1 ulp),
        # and the product by the weight once more.
        ok, equal = _ulp_bounded(got, want, 2)
        assert ok, f"dim {dim}: more than 2 bf16 ulps from eager"
        assert equal > 0.99, f"dim {dim}: only {equal:.4f} bitwise equal"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("T", TOKENS)
def test_gpu_rope_bf16_bitwise(T, interleave):
    torch.manual_seed(11)
    dev = torch.device("cuda")
    nh, Dn, R, C = LITE["heads"], LITE["nope"], LITE["rope"], LITE["kv_lora"]
    q = torch.randn(T, nh, Dn + R, device=dev, dtype=torch.bfloat16)
    kv = torch.randn(T, C + R, device=dev, dtype=torch.bfloat16)
    cos, sin = _cos_sin(T, R // 2, dev)
    for what, x in (("q_pe", q[..., Dn:]), ("k_pe", kv[:, C:])):
        _assert_bitwise(rope(x, cos, sin, interleave), _eager_rope(x, cos, sin, interleave), what)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("T", TOKENS)
def test_gpu_silu_mul_bf16_bitwise(T):
    torch.manual_seed(12)
    for inter in (LITE["shared_inter"], LITE["dense_inter"]):
        gate_up = 3 * torch.randn(T, 2 * inter, device="cuda", dtype=torch.bfloat16)
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
        _assert_bitwise(silu_mul(gate, up), F.silu(gate) * up, f"silu_mul I={inter}")


def _mlp(inter: int) -> MLP:
    mlp = MLP(LITE["hidden"], inter)
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0, 0.02)
    return mlp.to(device="cuda", dtype=torch.bfloat16)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("T", TOKENS)
def test_gpu_mlp_bf16(T):
    """One GEMM over [2I, H] instead of two: cuBLAS may pick another kernel (another summation order) for the wider
    output, so the bound is against the fp32 reference: the kernel path is as close to it as eager is."""
    torch.manual_seed(13)
    for inter in (LITE["shared_inter"], LITE["dense_inter"]):
        mlp = _mlp(inter)
        x = torch.randn(T, LITE["hidden"], device="cuda", dtype=torch.bfloat16)
        with eager_ops():
            want = mlp(x)
        got = mlp(x)
        assert mlp._gate_up is not None
        wg, wu, wd = (m.weight.float() for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
        xf = x.float()
        ref = (F.silu(xf @ wg.T) * (xf @ wu.T)) @ wd.T  # [T, H] fp32 all along
        err_eager = (want.float() - ref).norm() / ref.norm()
        err_kernel = (got.float() - ref).norm() / ref.norm()
        assert err_kernel <= 1.25 * err_eager + 1e-4, (float(err_kernel), float(err_eager))
        assert (got.float() - want.float()).norm() / want.float().norm() < 1e-2


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("T", [1, 8, 256])
def test_gpu_cuda_graph_replay_equals_eager_kernels(T):
    """norm -> rope -> MLP captured in one graph: replay on new inputs equals the same kernels run eagerly; an MLP
    first seen during capture keeps its two GEMMs (and never moves the weights the graph recorded)."""
    torch.manual_seed(14)
    dev = torch.device("cuda")
    nh, Dn, R = LITE["heads"], LITE["nope"], LITE["rope"]
    norm = _norm(LITE["hidden"], torch.bfloat16, dev)
    warm_mlp, cold_mlp = _mlp(LITE["shared_inter"]), _mlp(LITE["shared_inter"])
    x = torch.randn(T, LITE["hidden"], device=dev, dtype=torch.bfloat16)
    q = torch.randn(T, nh, Dn + R, device=dev, dtype=torch.bfloat16)
    cos, sin = _cos_sin(T, R // 2, dev)

    def step():
        h = norm(x)
        return rope(q[..., Dn:], cos, sin, True), warm_mlp(h), cold_mlp(h)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile every kernel and build warm_mlp's fused weight before capture
        norm(x)
        rope(q[..., Dn:], cos, sin, True)
        warm_mlp(x)
        silu_mul(*torch.randn(2, T, LITE["shared_inter"], device=dev, dtype=torch.bfloat16))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    assert warm_mlp._gate_up is not None and cold_mlp._gate_up is None
    cold_ptr = cold_mlp.gate_proj.weight.data_ptr()

    for _ in range(2):
        x.copy_(torch.randn_like(x))
        q.copy_(torch.randn_like(q))
        graph.replay()
        eager_out = step()  # the same kernels, launched eagerly
        assert cold_mlp.gate_proj.weight.data_ptr() == cold_ptr  # never fused after the capture
        for what, got, want in zip(("rope", "warm_mlp", "cold_mlp"), static_out, eager_out, strict=True):
            _assert_bitwise(got, want, f"graph replay vs eager, {what}")
    with eager_ops():
        assert torch.equal(static_out[0], apply_rope(q[..., Dn:], cos, sin, True))
        ok, _ = _ulp_bounded(norm(x), rms_norm(x, norm.weight, norm.eps), 2)
        assert ok
