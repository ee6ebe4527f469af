"""Fused RMSNorm / RoPE / SwiGLU Triton kernels against the eager PyTorch code they replace (afd.model.attention_side).

Small tests: fp32, tiny shapes (edge cases: no rows, one row, rows and widths not multiple of a block, strided views,
in-place into q, a whole two-layer forward) in Triton's interpreter on CPU, compiled where there is a GPU.
GPU tests (`-m gpu`, tests/e2e/test_kernel_fused_gpu.py): bf16 at DeepSeek-V2-Lite shapes, T in {1, 8, 256, 8192}, and
under CUDA-graph capture.
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402
from helpers.kernels_fused import HAS_CUDA, _cos_sin, _eager, _eager_rope, _norm

import afd.model.layers  # noqa: E402
from afd.kernels.norm import rms_norm  # noqa: E402
from afd.kernels.rope import rope  # noqa: E402
from afd.kernels.swiglu import silu_mul  # noqa: E402
from afd.model.attention_side import MLP, apply_rope  # noqa: E402

# The small fp32 tests: Triton's interpreter on CPU; compiled kernels where there is a GPU.
DEV = torch.device("cuda" if HAS_CUDA else "cpu")


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
