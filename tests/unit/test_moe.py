"""Routed experts (afd.model.moe): the fixed-shape, host-sync-free path against the exact loop.

On CPU the fixed-shape path runs through `torch._grouped_mm`'s CPU fallback (fp32) and, to prove it never
reads device data on the host nor makes a shape depend on the routing, on the `meta` device (bf16, the dtype
of the CUDA path): any `nonzero`, `bincount`, `.item()` or `.tolist()` there raises. The `gpu` tests check
the same on the GPU with `torch.cuda.set_sync_debug_mode` (also `scripts/gpu_moe_check.py`).
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import afd.model.moe as moe
from afd.model.ffn_side import FFNModel
from afd.model.moe import group_by_expert, grouped_expert_mlp, routed_experts, select_experts, sort_pairs_by_expert
from afd.model.weights import load_ffn_model, load_model_config


def _experts(E: int, H: int, inter: int, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    w13 = torch.randn(E, 2 * inter, H, generator=g, device=device) * H**-0.5
    w2 = torch.randn(E, H, inter, generator=g, device=device) * inter**-0.5
    return w13.to(dtype), w2.to(dtype)


def _routing(T: int, E: int, K: int, device: str = "cpu", seed: int = 0) -> moe.Routing:
    g = torch.Generator(device=device).manual_seed(seed)
    return select_experts(torch.randn(T, E, generator=g, device=device), top_k=K, norm_topk_prob=True)


def _naive(x, ids, weights, w13, w2, start):
    """One (token, k) pair at a time, fp32: the definition of the MoE output."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k]) - start
            if 0 <= e < w13.shape[0]:
                gate, up = (w13[e].float() @ x[t].float()).chunk(2)
                out[t] += weights[t, k] * (w2[e].float() @ (torch.nn.functional.silu(gate) * up))
    return out


@given(
    T=st.integers(0, 12),
    K=st.integers(1, 4),
    bounds=st.tuples(st.integers(0, 8), st.integers(0, 8)).map(sorted),
    seed=st.integers(0, 2**16),
)
def test_sort_pairs_by_expert_orders_local_pairs_as_group_by_expert(T, K, bounds, seed):
    """Fixed shape [T*K]: the local pairs first, in group_by_expert's order, offsets = its cumulative sizes."""
    E, (start, stop) = 8, bounds
    ids = torch.rand(T, E, generator=torch.Generator().manual_seed(seed)).argsort(dim=1)[:, :K]  # distinct per row
    pairs = sort_pairs_by_expert(ids, start, stop)
    groups = group_by_expert(ids, start, stop)
    n_local = len(groups.pair_idx)
    assert pairs.pair_idx.shape == (T * K,) and pairs.offs.dtype == torch.int32
    assert pairs.pair_idx[:n_local].tolist() == groups.pair_idx.tolist()
    assert pairs.token_idx.tolist() == (pairs.pair_idx // K).tolist()
    assert sorted(pairs.pair_idx.tolist()) == list(range(T * K))  # a permutation: every pair exactly once
    assert pairs.offs.tolist() == torch.tensor(groups.group_sizes, dtype=torch.int64).cumsum(0).tolist()
    rest = ids.reshape(-1)[pairs.pair_idx[n_local:]]
    assert ((rest < start) | (rest >= stop)).all()


@pytest.mark.parametrize("T", [0, 1, 5, 33])
@pytest.mark.parametrize("expert_range", [(0, 10), (3, 7), (9, 10)])
def test_fixed_shape_equals_exact_loop_fp32(T, expert_range, monkeypatch):
    """Same result as the loop within 1e-6 in fp32, for every shard of the experts, even when the rows past
    the last group come out of the grouped GEMM as NaN (they are selected away, never weighed)."""
    E, H, inter, K = 10, 64, 32, 3
    w13, w2 = _experts(E, H, inter)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(T))
    r = _routing(T, E, K, seed=T)
    start, stop = expert_range
    args = (x, r.topk_ids, r.topk_weights, w13[start:stop], w2[start:stop], start)
    loop = routed_experts(*args, fixed_shape=False)

    real = moe.grouped_expert_mlp_offsets

    def poisoned(x, offs, w13, w2):
        y = real(x, offs, w13, w2)
        y[int(offs[-1]) :] = float("nan")  # what an unwritten row may hold
        return y

    monkeypatch.setattr(moe, "grouped_expert_mlp_offsets", poisoned)
    fixed = routed_experts(*args, fixed_shape=True)
    assert fixed.dtype == torch.float32 and fixed.shape == (T, H)
    assert torch.isfinite(fixed).all()
    torch.testing.assert_close(fixed, loop, rtol=0, atol=1e-6)
    torch.testing.assert_close(loop, _naive(*args), rtol=0, atol=1e-5)


def _meta_ffn(topk_method: str, expert_range: tuple[int, int] | None) -> FFNModel:
    base = load_model_config("tiny")  # noaux_tc, sigmoid, 2 groups
    scoring = "softmax" if topk_method != "noaux_tc" else "sigmoid"
    config = dataclasses.replace(base, topk_method=topk_method, scoring_func=scoring)
    with torch.device("meta"):
        model = FFNModel(config, expert_range=expert_range, gate_on_attention=False, dtype=torch.bfloat16)
    return model.to(torch.bfloat16)


@pytest.mark.parametrize("topk_method", ["greedy", "group_limited_greedy", "noaux_tc"])
@pytest.mark.parametrize("expert_range", [None, (3, 7)])
def test_fixed_shape_layer_never_reads_device_data_on_the_host(topk_method, expert_range):
    """A whole MoE layer (router, routed experts, shared experts) runs on the `meta` device, where any read of
    data on the host (`nonzero`, `bincount`, `.item()`, `.tolist()`) raises: so on CUDA it has no host sync,
    and every shape depends only on the number of tokens (what a CUDA graph needs). The old path called
    `nonzero`, `bincount` and `.tolist()` per layer."""
    model = _meta_ffn(topk_method, expert_range)
    model.fixed_shape_moe = True
    layer = model.config.moe_layers[0]
    for T in (0, 1, 9):
        x = torch.empty(T, model.config.hidden_size, dtype=torch.bfloat16, device="meta")
        out = model(layer, x, None)  # gate on FFN: the router runs too
        assert out.shape == (T, model.config.hidden_size) and out.dtype == torch.bfloat16


def test_exact_loop_stays_the_cpu_default():
    """CPU (and anything without a native `torch._grouped_mm`) keeps the exact loop: the meta device, which
    fails on it, fails by default."""
    model = _meta_ffn("greedy", None)
    x = torch.empty(3, model.config.hidden_size, dtype=torch.bfloat16, device="meta")
    with pytest.raises(NotImplementedError):
        model(model.config.moe_layers[0], x, None)
    assert not moe._grouped_mm_supported(torch.device("cpu"), torch.bfloat16)


def test_experts_by_device_offsets_equal_experts_by_host_sizes():
    """The async form given device offsets equals the list form on every row inside a group."""
    ffn = load_ffn_model("tiny", expert_range=(2, 8))
    layer = ffn.config.moe_layers[0]
    sizes = [3, 0, 5, 1, 0, 2]
    x = torch.randn(sum(sizes) + 4, ffn.config.hidden_size, generator=torch.Generator().manual_seed(1))
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    by_list = ffn.experts(layer, x[: sum(sizes)], sizes)
    by_offs = ffn.experts_offsets(layer, x, offs)  # 4 trailing rows belong to no group
    torch.testing.assert_close(by_offs[: sum(sizes)], by_list, rtol=0, atol=1e-6)


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
