"""Routed experts (afd.model.moe): the fixed-shape, host-sync-free path against the exact loop.

On CPU the fixed-shape path runs through `torch._grouped_mm`'s CPU fallback (fp32) and, to prove it never
reads device data on the host nor makes a shape depend on the routing, on the `meta` device (bf16, the dtype
of the CUDA path): any `nonzero`, `bincount`, `.item()` or `.tolist()` there raises. The `gpu` tests check
the same on the GPU with `torch.cuda.set_sync_debug_mode` (also `scripts/gpu_moe_check.py`).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.moe_fakes import _experts, _routing
from hypothesis import given
from hypothesis import strategies as st

import afd.model.moe as moe
from afd.model.ffn_side import FFNModel
from afd.model.moe import group_by_expert, routed_experts
from afd.model.weights import load_ffn_model, load_model_config
from afd.routing import sort_pairs_by_expert


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
