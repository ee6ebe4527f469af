"""The GPU half of tests/kernels/test_kernel_router.py: bf16 and real model shapes on CUDA, graphs and host syncs."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")


from helpers.kernels_router import HAS_CUDA, _config, _kernel, check_routing

from afd.kernels import router  # noqa: E402
from afd.model.config import ModelConfig  # noqa: E402
from afd.model.layers import Gate  # noqa: E402
from afd.model.weights import PRESETS  # noqa: E402

gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


# --- GPU: bf16 rows, DeepSeek shapes ------------------------------------------------------------------------------

MODELS = {
    "v2-lite": ModelConfig.from_hf(PRESETS["deepseek-v2-lite"]),
    "v3": _config(
        256, 8, "noaux_tc", "sigmoid", G=8, TG=4, norm_topk_prob=True, routed_scaling_factor=2.5, hidden_size=7168
    ),
    "v2": _config(160, 6, "group_limited_greedy", G=8, TG=3, routed_scaling_factor=16.0, hidden_size=5120),
}
GPU_TOKENS = [1, 8, 64, 256, 4096]


def _gpu_inputs(c: ModelConfig, T: int, weight_dtype: torch.dtype, seed: int = 0):
    """bf16 rows of unit scale (RMSNorm outputs), a gate weight of std 0.02 (logits of std ~1-1.5) in
    `weight_dtype` (the loader keeps gates fp32; a bf16 gate is the other case), an fp32 bias."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    E, H = c.n_routed_experts, c.hidden_size
    x = torch.randn(T, H, device="cuda", generator=gen).bfloat16()
    weight = (0.02 * torch.randn(E, H, device="cuda", generator=gen)).to(weight_dtype)
    bias = 0.01 * torch.randn(E, device="cuda", generator=gen) if c.topk_method == "noaux_tc" else None
    return x, weight, bias


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("T", GPU_TOKENS)
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32], ids=["bf16_w", "fp32_w"])
@pytest.mark.parametrize("model", list(MODELS))
def test_gpu_matches_eager(model, weight_dtype, T):
    c = MODELS[model]
    x, weight, bias = _gpu_inputs(c, T, weight_dtype)
    got = _kernel(x, weight, bias, c)
    check_routing(got, x, weight, bias, c, max_diff_rows=1 + T // 100)
    again = _kernel(x, weight, bias, c)
    assert torch.equal(got.topk_ids, again.topk_ids) and torch.equal(got.topk_weights, again.topk_weights)
    assert int(router._counters[x.device].abs().sum()) == 0


def _gpu_gate(c: ModelConfig, weight: torch.Tensor, bias: torch.Tensor | None) -> Gate:
    gate = Gate(c, c.routed_scaling_factor).to(device="cuda", dtype=weight.dtype)
    with torch.no_grad():
        gate.weight.copy_(weight)
        if bias is not None:
            gate.e_score_correction_bias.data = bias.clone()
    return gate


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fresh_counters", [False, True], ids=["cached_counters", "counters_in_graph"])
@pytest.mark.parametrize("T", [1, 8, 64])
@pytest.mark.parametrize("model", ["v2-lite", "v3"])
def test_gpu_cuda_graph_replay_equals_eager(model, T, fresh_counters):
    """Gate.forward captured in a CUDA graph: each replay on new rows gives the same bits as the kernel launched
    eagerly and a correct routing against the eager path; with no counter buffer cached before the capture (the
    graph zeroes its own), eager launches afterwards still work."""
    c = MODELS[model]
    # V3's 256 experts take the eager path with an fp32 gate (`router.pays`): its bf16 gate is the kernel's case
    x, weight, bias = _gpu_inputs(c, T, torch.float32 if model == "v2-lite" else torch.bfloat16, seed=1)
    assert router.pays(weight, T)
    gate = _gpu_gate(c, weight, bias)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile before the capture
        gate(x)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    if fresh_counters:
        router._retired.extend(router._counters.values())
        router._counters.clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = gate(x)
    for seed in (2, 3, 4):
        x.copy_(_gpu_inputs(c, T, torch.float32, seed=seed)[0])
        graph.replay()
        eager_kernel = gate(x)
        assert torch.equal(static.topk_ids, eager_kernel.topk_ids)
        assert torch.equal(static.topk_weights, eager_kernel.topk_weights)
        check_routing(static, x, weight, bias, c, max_diff_rows=1)
    assert int(router._counters[x.device].abs().sum()) == 0
