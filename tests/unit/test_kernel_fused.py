"""Fused RMSNorm / RoPE / SwiGLU Triton kernels against the eager PyTorch code they replace (afd.model.attention_side).

Small tests: fp32, tiny shapes (edge cases: no rows, one row, rows and widths not multiple of a block, strided views,
in-place into q, a whole two-layer forward) in Triton's interpreter on CPU, compiled where there is a GPU.
GPU tests (`-m gpu`): bf16 at DeepSeek-V2-Lite shapes, T in {1, 8, 256, 8192}, and under CUDA-graph capture.
`python tests/test_kernel_fused.py` on the GPU prints one JSON line per op and T: eager vs kernel time.
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest
import torch
from helpers.gpu_timing import graph_ms

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402

import afd.model.layers  # noqa: E402
from afd.kernels.norm import rms_norm  # noqa: E402
from afd.kernels.rope import rope  # noqa: E402
from afd.kernels.swiglu import silu_mul  # noqa: E402
from afd.model.attention_side import MLP, RMSNorm, apply_rope  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
# The small fp32 tests: Triton's interpreter on CPU; compiled kernels where there is a GPU.
DEV = torch.device("cuda" if HAS_CUDA else "cpu")


def _eager(fn, *args, **kwargs):
    """`fn` (afd.model.attention_side code) on the eager path whatever the device: the oracle."""
    old = os.environ.get("AFD_DISABLE_TRITON")
    os.environ["AFD_DISABLE_TRITON"] = "1"
    try:
        return fn(*args, **kwargs)
    finally:
        if old is None:
            del os.environ["AFD_DISABLE_TRITON"]
        else:
            os.environ["AFD_DISABLE_TRITON"] = old


def _eager_rope(x, cos, sin, interleave):
    return _eager(apply_rope, x, cos, sin, interleave)


MINE = {"RMSNorm.forward", "apply_rope", "MLP.forward"}  # the call sites of the kernels tested here


def _kernels_on(monkeypatch: pytest.MonkeyPatch, on: bool = True, calls: list | None = None) -> None:
    """Make afd.model.layers' RMSNorm / apply_rope / MLP take (or skip) the kernels on any device, counting the calls.

    Other kernels dispatched through the same `kernels.enabled` (attention) stay eager: they have their own tests.
    """

    def enabled(device: torch.device) -> bool:
        if sys._getframe(1).f_code.co_qualname not in MINE:
            return False
        if calls is not None:
            calls.append(device)
        return on

    monkeypatch.setattr(afd.model.layers, "kernels", SimpleNamespace(enabled=enabled))


def _norm(dim: int, dtype: torch.dtype, device: torch.device) -> RMSNorm:
    norm = RMSNorm(dim, 1e-6).to(device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(dim))
    return norm


def _cos_sin(T: int, half: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = torch.arange(T, dtype=torch.float32)[:, None] * (10000.0 ** (-torch.arange(half) / half))[None, :]
    return freqs.cos().to(device) * 1.1, freqs.sin().to(device) * 1.1  # [T, R/2], a YaRN-like factor


# --- fp32, tiny shapes: the interpreter on CPU (compiled on a GPU) --------------------------------------------


@pytest.mark.parametrize("rows, dim", [(0, 64), (1, 64), (7, 37), (5, 512)])
def test_rms_norm_matches_eager(rows, dim):
    torch.manual_seed(0)
    norm = _norm(dim, torch.float32, DEV)
    x = 3 * torch.randn(rows, dim, device=DEV)
    torch.testing.assert_close(rms_norm(x, norm.weight, norm.eps), _eager(norm, x), atol=1e-6, rtol=1e-6)


def test_rms_norm_strided_rows_and_3d():
    torch.manual_seed(1)
    norm = _norm(16, torch.float32, DEV)
    kv = torch.randn(5, 16 + 8, device=DEV)
    kv_c = kv[:, :16]  # [T, C] of a split: rows strided by C + R
    torch.testing.assert_close(rms_norm(kv_c, norm.weight, norm.eps), _eager(norm, kv_c), atol=1e-6, rtol=1e-6)
    x = torch.randn(2, 3, 16, device=DEV)
    torch.testing.assert_close(rms_norm(x, norm.weight, norm.eps), _eager(norm, x), atol=1e-6, rtol=1e-6)


def test_rms_norm_fp16_rounds_before_the_weight():
    """The contract `weight * x̂.to(x.dtype)`: fp16 in, fp16 weight, one rounding before and one after."""
    torch.manual_seed(2)
    norm = _norm(40, torch.float16, DEV)
    x = torch.randn(6, 40, device=DEV).half()
    got, want = rms_norm(x, norm.weight, norm.eps), _eager(norm, x)
    assert got.dtype == want.dtype == torch.float16
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)  # an fp16 ulp where the fp32 sum order shows


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("T", [0, 1, 5])
@pytest.mark.parametrize("R", [8, 12])
def test_rope_q_view_and_k_row_bitwise(interleave, T, R):
    torch.manual_seed(3)
    nh, Dn, C = 3, 8, 16
    q = torch.randn(T, nh, Dn + R, device=DEV)
    q_pe = q[..., Dn:]  # [T, nh, R], a non-contiguous view of q as MLAttention has it
    kv = torch.randn(T, C + R, device=DEV)
    k_pe = kv[:, C:]  # [T, R] of the latent row
    cos, sin = _cos_sin(T, R // 2, DEV)
    assert torch.equal(rope(q_pe, cos, sin, interleave), _eager_rope(q_pe, cos, sin, interleave))
    assert torch.equal(rope(k_pe, cos, sin, interleave), _eager_rope(k_pe, cos, sin, interleave))


@pytest.mark.parametrize("on", [True, False])
@pytest.mark.parametrize("interleave", [True, False])
def test_rope_in_place_into_q(interleave, on, monkeypatch):
    """`apply_rope(q_pe, ..., out=q_pe)` writes the rotated part into q itself, kernel or eager."""
    torch.manual_seed(4)
    q = torch.randn(4, 5, 8 + 8, device=DEV)
    q_nope = q[..., :8].clone()
    want = _eager_rope(q[..., 8:], *_cos_sin(4, 4, DEV), interleave)
    _kernels_on(monkeypatch, on)
    got = apply_rope(q[..., 8:], *_cos_sin(4, 4, DEV), interleave, out=q[..., 8:])
    assert got.data_ptr() == q[..., 8:].data_ptr()
    assert torch.equal(q[..., 8:], want)
    assert torch.equal(q[..., :8], q_nope)


@pytest.mark.parametrize("T", [0, 1, 7])
@pytest.mark.parametrize("inter", [1, 50, 1100])
def test_silu_mul_matches_eager(T, inter):
    torch.manual_seed(5)
    gate_up = 4 * torch.randn(T, 2 * inter, device=DEV)  # one GEMM's output: gate columns, then up columns
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    torch.testing.assert_close(silu_mul(gate, up), F.silu(gate) * up, atol=1e-6, rtol=1e-6)


def test_mlp_fuses_gate_up_into_views_of_one_weight(monkeypatch):
    torch.manual_seed(6)
    mlp = MLP(24, 40).to(DEV)
    x = torch.randn(5, 24, device=DEV)
    _kernels_on(monkeypatch, False)
    want = mlp(x)
    state = {k: v.clone() for k, v in mlp.state_dict().items()}
    _kernels_on(monkeypatch)
    torch.testing.assert_close(mlp(x), want, atol=1e-6, rtol=1e-6)
    fused = mlp._gate_up
    assert fused is not None and fused.shape == (80, 24)
    assert mlp.gate_proj.weight.data_ptr() == fused.data_ptr()  # views, not a second copy of the weights
    assert mlp.up_proj.weight.data_ptr() == fused[40:].data_ptr()
    assert list(mlp.state_dict()) == list(state)
    assert all(torch.equal(mlp.state_dict()[k], v) for k, v in state.items())
    mlp(x)
    assert mlp._gate_up is fused  # built once
    assert mlp(x[:0]).shape == (0, 24)

    # A loader that replaces a parameter (afd.model.weights._assign) makes the next call rebuild from the new values.
    mlp.up_proj.weight = torch.nn.Parameter(torch.randn(40, 24, device=DEV), requires_grad=False)
    _kernels_on(monkeypatch, False)
    want = mlp(x)
    _kernels_on(monkeypatch)
    torch.testing.assert_close(mlp(x), want, atol=1e-6, rtol=1e-6)
    assert mlp._gate_up is not fused


def test_tiny_model_with_kernels_matches_eager(monkeypatch):
    """The wiring: every RMSNorm, rope and MLP of a whole forward (two layers of the tiny preset: one dense, one MoE
    with shared experts) through the kernels."""
    from afd.engine.engine import LocalExchange
    from afd.model.attention_side import AttentionModel, ModelConfig
    from afd.model.batch import Batch
    from afd.model.ffn_side import FFNModel
    from afd.model.weights import PRESETS

    torch.manual_seed(7)
    config = ModelConfig.from_hf({**PRESETS["tiny"], "num_hidden_layers": 2})
    attn, ffn = AttentionModel(config), FFNModel(config)
    with torch.no_grad():
        for name, p in [*attn.named_parameters(), *ffn.named_parameters()]:
            p.copy_(1 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else 0.2 * torch.randn_like(p))
    attn, ffn = attn.to(DEV), ffn.to(DEV)
    ids, positions = torch.tensor([5, 17, 3, 11, 2], device=DEV), torch.tensor([0, 1, 2, 0, 1], device=DEV)
    batch = Batch(slots=[0, 1], query_lens=[3, 2], context_lens=[0, 0])
    with torch.no_grad():
        _kernels_on(monkeypatch, False)
        want = attn(ids, positions, batch, None, LocalExchange(ffn))
        calls: list[torch.device] = []
        _kernels_on(monkeypatch, calls=calls)
        got = attn(ids, positions, batch, None, LocalExchange(ffn))
    # per layer: 2 norms + q_a_layernorm + kv_a_layernorm + 2 ropes + an MLP (dense or shared); the final norm
    assert len(calls) == 2 * 7 + 1
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


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
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("AFD_DISABLE_TRITON", "1")
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
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("AFD_DISABLE_TRITON", "1")
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
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AFD_DISABLE_TRITON", "1")
        assert torch.equal(static_out[0], apply_rope(q[..., Dn:], cos, sin, True))
        ok, _ = _ulp_bounded(norm(x), rms_norm(x, norm.weight, norm.eps), 2)
        assert ok


# --- timing (GPU): `python tests/test_kernel_fused.py` -------------------------------------------------------------


def _graph_ms(fn, reps: int = 50, rounds: int = 5) -> float:
    return graph_ms(fn, reps, rounds)


def _bench_ops(T: int) -> dict:
    """name -> (call, eager call or None for "the same call under AFD_DISABLE_TRITON=1", bytes the kernel moves)."""
    dev, bf = torch.device("cuda"), torch.bfloat16
    H, nh, Dn, R, C = LITE["hidden"], LITE["heads"], LITE["nope"], LITE["rope"], LITE["kv_lora"]
    I_s, I_d = LITE["shared_inter"], LITE["dense_inter"]
    norm_h, norm_c = _norm(H, bf, dev), _norm(C, bf, dev)
    x = torch.randn(T, H, device=dev, dtype=bf)
    kv = torch.randn(T, C + R, device=dev, dtype=bf)
    q = torch.randn(T, nh, Dn + R, device=dev, dtype=bf)
    cos, sin = _cos_sin(T, R // 2, dev)
    shared, dense = _mlp(I_s), _mlp(I_d)
    gu = torch.randn(T, 2 * I_s, device=dev, dtype=bf)
    return {
        "rms_norm_hidden": (lambda: norm_h(x), None, 2 * (2 * T * H + H)),
        "rms_norm_kv_c": (lambda: norm_c(kv[:, :C]), None, 2 * (2 * T * C + C)),
        "rope_q_pe": (lambda: apply_rope(q[..., Dn:], cos, sin, True), None, 2 * 2 * T * nh * R + 4 * T * R),
        "rope_k_pe": (lambda: apply_rope(kv[:, C:], cos, sin, True), None, 2 * 2 * T * R + 4 * T * R),
        "silu_mul_shared": (
            lambda: silu_mul(gu[:, :I_s], gu[:, I_s:]),
            lambda: F.silu(gu[:, :I_s]) * gu[:, I_s:],
            2 * 3 * T * I_s,
        ),
        "mlp_shared": (lambda: shared(x), None, 2 * (3 * I_s * H + 2 * T * H + 3 * T * I_s)),
        "mlp_dense": (lambda: dense(x), None, 2 * (3 * I_d * H + 2 * T * H + 3 * T * I_d)),
    }


def bench() -> None:
    """One JSON line per op and T: eager vs kernel ms per call (both inside a CUDA graph), the kernel's GB/s, and how
    its output compares with eager's (fraction of bitwise-equal elements, max |Δ|)."""
    import json

    torch.manual_seed(0)
    for T in TOKENS:
        for name, (fn, eager_fn, nbytes) in _bench_ops(T).items():
            os.environ["AFD_DISABLE_TRITON"] = "1"
            eager_out = (eager_fn or fn)()
            eager_ms = _graph_ms(eager_fn or fn)
            del os.environ["AFD_DISABLE_TRITON"]
            kernel_out = fn()
            kernel_ms = _graph_ms(fn)
            line = dict(op=name, T=T, eager_ms=round(eager_ms, 5), kernel_ms=round(kernel_ms, 5))
            line.update(speedup=round(eager_ms / kernel_ms, 2), kernel_GBps=round(nbytes / kernel_ms / 1e6, 1))
            line.update(
                bitwise_equal=round(float((kernel_out == eager_out).float().mean()), 6),
                max_abs_diff=float((kernel_out.float() - eager_out.float()).abs().max()),
            )
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    if not HAS_CUDA:
        raise SystemExit("the timing needs CUDA")
    bench()
