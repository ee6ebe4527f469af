"""The GPU half of tests/unit/test_moe.py: bf16 and real model shapes on CUDA, graphs and host syncs."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from helpers.moe_fakes import _experts, _routing

from afd.model.ffn_side import FFNModel
from afd.model.moe import group_by_expert, grouped_expert_mlp, routed_experts
from afd.model.weights import load_model_config


def _sync_free_layer_check(model: FFNModel, T: int) -> list[str]:
    """Sync warnings raised by one MoE layer forward of `model` (gate on FFN) on `T` random tokens."""
    layer = model.config.moe_layers[0]
    x = torch.randn(T, model.config.hidden_size, device="cuda", dtype=model.dtype)
    model(layer, x, None)  # warm-up: allocator, cuBLAS handles, pinned pools
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model(layer, x, None)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]


def _cuda_ffn(topk_method: str, expert_range: tuple[int, int] | None) -> FFNModel:
    """A DeepSeek-V2-Lite-shaped FFN side (one dense + one MoE layer), random bf16 weights, gate on FFN."""
    base = load_model_config("deepseek-v2-lite")
    groups = {} if topk_method == "greedy" else {"n_group": 8, "topk_group": 3}
    scoring = "sigmoid" if topk_method == "noaux_tc" else "softmax"
    config = dataclasses.replace(base, num_hidden_layers=2, topk_method=topk_method, scoring_func=scoring, **groups)
    with torch.device("cuda"):
        model = FFNModel(config, expert_range=expert_range, gate_on_attention=False, dtype=torch.bfloat16)
    for p in model.parameters():
        p.data.normal_(0.0, p.shape[-1] ** -0.5)
    return model.to(torch.bfloat16)


needs_sm90 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="needs a CUDA sm90+ GPU"
)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.timeout(300)
def test_cuda_fixed_shape_equals_loop_in_bf16():
    """DeepSeek-V2-Lite shapes, bf16: the fixed-shape grouped path equals the F.linear loop within a relative
    (Frobenius) error of 1e-2, for the whole expert set and for a shard."""
    E, H, inter, K = 64, 2048, 1408, 6
    w13, w2 = _experts(E, H, inter, torch.bfloat16, "cuda")
    for T in (1, 8, 64, 256):
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        r = _routing(T, E, K, device="cuda", seed=T)
        for start, stop in ((0, E), (16, 48)):
            args = (x, r.topk_ids, r.topk_weights, w13[start:stop], w2[start:stop], start)
            fixed = routed_experts(*args, fixed_shape=True)
            groups = group_by_expert(r.topk_ids, start, stop)
            y = grouped_expert_mlp(x[groups.token_idx], groups.group_sizes, *args[3:5], use_grouped_mm=False)
            w = r.topk_weights.reshape(-1)[groups.pair_idx]
            loop = torch.zeros(T, H, device="cuda").index_add_(0, groups.token_idx, y.float() * w[:, None])
            rel = ((fixed - loop).norm() / loop.norm()).item()
            assert rel <= 1e-2, f"T={T} experts [{start}, {stop}): relative error {rel:.2e}"


@pytest.mark.gpu
@needs_sm90
@pytest.mark.timeout(300)
@pytest.mark.parametrize("topk_method", ["greedy", "group_limited_greedy", "noaux_tc"])
def test_cuda_moe_layer_never_syncs_the_host(topk_method):
    """One DeepSeek-V2-Lite-shaped MoE layer forward in bf16 (router, grouping, grouped GEMMs, combine, shared
    experts) makes no host synchronisation, for every router, on the whole expert set and on a shard."""
    for expert_range in (None, (16, 48)):
        model = _cuda_ffn(topk_method, expert_range)
        for T in (1, 64):
            syncs = _sync_free_layer_check(model, T)
            assert not syncs, f"{topk_method} experts {expert_range} T={T}: host syncs at {syncs}"
        del model


@pytest.mark.gpu
@needs_sm90
@pytest.mark.timeout(300)
def test_cuda_fixed_shape_moe_replays_from_a_cuda_graph_bit_for_bit():
    """Shapes depend only on T, so the routed experts capture into a CUDA graph; the replay (with new routing
    and rows copied into the captured inputs) equals eager bit for bit (the combine has no atomics)."""
    E, H, inter, K, T = 64, 2048, 1408, 6, 16
    w13, w2 = _experts(E, H, inter, torch.bfloat16, "cuda")
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    r = _routing(T, E, K, device="cuda", seed=1)
    ids, weights = r.topk_ids.clone(), r.topk_weights.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        routed_experts(x, ids, weights, w13, w2, fixed_shape=True)  # warm-up off the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = routed_experts(x, ids, weights, w13, w2, fixed_shape=True)
    for seed in (2, 3):
        r = _routing(T, E, K, device="cuda", seed=seed)
        x.copy_(torch.randn(T, H, device="cuda", dtype=torch.bfloat16))
        ids.copy_(r.topk_ids)
        weights.copy_(r.topk_weights)
        graph.replay()
        eager = routed_experts(x, ids, weights, w13, w2, fixed_shape=True)
        assert torch.equal(static_out, eager)
