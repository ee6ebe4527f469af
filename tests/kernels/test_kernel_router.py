"""The fused MoE router (afd.kernels.router) against `select_experts` over `F.linear(x.float(), W.float())`.

CPU: fp32, tiny shapes in Triton's interpreter (compiled where there is a GPU): exact ids where no two selection
scores are within 1e-5, a tie-tolerant check on plain random inputs, the tie rule (lower expert / group id first)
on exact ties, every supported method, H split over programs, the dispatch in `Gate.forward` and its fallback.
GPU (`-m gpu`): DeepSeek-V2-Lite / V3 / V2 shapes, bf16 rows, bf16 and fp32 (as loaded) gate weights, T in
{1, 8, 64, 256, 4096}, and CUDA-graph capture and replay (tests/e2e/test_kernel_router_gpu.py).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402
from helpers.kernels_router import HAS_CUDA, TINY, TOL, _config, _eager, _kernel, _scores, check_routing

import afd.model.layers  # noqa: E402
from afd.kernels import router  # noqa: E402
from afd.kernels.router import supports  # noqa: E402
from afd.model.config import ModelConfig  # noqa: E402
from afd.model.layers import Gate  # noqa: E402
from afd.model.weights import PRESETS  # noqa: E402

DEV = torch.device("cuda" if HAS_CUDA else "cpu")


# Small configs of each method (group sizes 5 and 8: not only powers of two), the scaling / normalization variants.
CONFIGS = {
    "greedy_softmax_e8": _config(8, 2),
    "greedy_softmax_e20": _config(20, 3, routed_scaling_factor=2.0),
    "greedy_softmax_e64": _config(64, 6),
    "greedy_sigmoid_norm": _config(20, 4, scoring="sigmoid", norm_topk_prob=True),
    "noaux_e20": _config(20, 3, "noaux_tc", "sigmoid", G=4, TG=2, norm_topk_prob=True, routed_scaling_factor=2.5),
    "noaux_e64": _config(64, 8, "noaux_tc", "sigmoid", G=8, TG=4, norm_topk_prob=True, routed_scaling_factor=2.5),
    "group_limited_e20": _config(20, 3, "group_limited_greedy", G=4, TG=2, routed_scaling_factor=3.0),
    "group_limited_e64": _config(64, 6, "group_limited_greedy", G=8, TG=3),
}


def _min_gap(logits: torch.Tensor, c: ModelConfig, bias: torch.Tensor | None) -> float:
    """The smallest gap between selection scores that decides anything: consecutive group scores down to the
    first group dropped, consecutive expert scores (in the kept groups) down to the first expert dropped."""
    s = _scores(logits, c, bias)
    K, gaps = c.num_experts_per_tok, []
    choice = s.choice
    if s.group_scores is not None:
        top = s.group_scores.sort(-1, descending=True).values[:, : c.topk_group + 1]
        if c.topk_group < c.n_group:
            gaps.append((top[:, :-1] - top[:, 1:]).min())
        kept = s.group_scores.topk(c.topk_group, -1).indices
        is_kept = torch.zeros_like(s.group_scores, dtype=torch.bool).scatter_(1, kept, True)
        is_kept = is_kept.repeat_interleave(logits.shape[1] // c.n_group, dim=1)
        choice = choice.masked_fill(~is_kept, float("-inf") if c.topk_method == "noaux_tc" else 0.0)
    top = choice.sort(-1, descending=True).values[:, : K + 1]
    if K < logits.shape[1]:
        d = top[:, :-1] - top[:, 1:]
        gaps.append(d[d == d].min())  # -inf - -inf is nan: never a decision
    return min((float(g) for g in gaps), default=float("inf"))


def _inputs(c: ModelConfig, T: int, H: int, *, seed: int, min_gap: float | None = 1e-4):
    """x [T, H], weight [E, H], bias [E] (noaux_tc) in fp32 on DEV; with `min_gap`, redrawn (from `seed` on)
    until no two deciding scores are closer than that, so any kernel/eager difference is a real one."""
    E = c.n_routed_experts
    for s in range(seed, seed + 200):
        gen = torch.Generator().manual_seed(s)
        x = torch.randn(T, H, generator=gen)
        weight = torch.randn(E, H, generator=gen) * (2.0 / H**0.5)  # logits of std ~2
        bias = 0.05 * torch.rand(E, generator=gen) if c.topk_method == "noaux_tc" else None
        if min_gap is None or T == 0 or _min_gap(F.linear(x, weight), c, bias) > min_gap:
            return x.to(DEV), weight.to(DEV), None if bias is None else bias.to(DEV)
    raise AssertionError("no input without near-ties in 200 draws")


# --- fp32, tiny shapes: the interpreter on CPU (compiled on a GPU) --------------------------------------------


@pytest.mark.parametrize("T", [0, 1, 5, 33])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_select_experts_where_no_near_tie(name, T):
    """Same ids in the same order, weights within 1e-5, for every method (H = 200: two K-chunks, one partial)."""
    c = CONFIGS[name]
    x, weight, bias = _inputs(c, T, 200, seed=T)
    got, want = _kernel(x, weight, bias, c), _eager(x, weight, bias, c)
    assert got.topk_ids.shape == want.topk_ids.shape == (T, c.num_experts_per_tok)
    assert torch.equal(got.topk_ids, want.topk_ids)
    torch.testing.assert_close(got.topk_weights, want.topk_weights, atol=TOL, rtol=0)
    check_routing(got, x, weight, bias, c)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_random_inputs_tie_tolerant(name):
    """Plain random inputs (near-ties allowed), several splits of H: a correct routing up to 1e-5."""
    c = CONFIGS[name]
    x, weight, bias = _inputs(c, 33, 400, seed=100, min_gap=None)
    for num_splits in (1, 2, 4):  # 4 chunks of H: one, two or four programs per T-block
        check_routing(_kernel(x, weight, bias, c, num_splits=num_splits), x, weight, bias, c, max_diff_rows=1)


@pytest.mark.parametrize("x_dtype, w_dtype", [(torch.float16, torch.float16), (torch.float16, torch.float32)])
def test_half_rows_and_weights(x_dtype, w_dtype):
    """fp16 rows with an fp16 weight (native tl.dot, fp32 accumulation) or an fp32 weight (widened, "ieee")."""
    c = CONFIGS["noaux_e64"]
    x, weight, bias = _inputs(c, 17, 200, seed=5)
    x, weight = x.to(x_dtype), weight.to(w_dtype)
    check_routing(_kernel(x, weight, bias, c), x, weight, bias, c, max_diff_rows=1)


def test_splits_are_deterministic_and_leave_counters_zero():
    """The last program of a T-block sums the partials in split order: the same bits on every launch; and it
    leaves its arrival counter at zero for the next launch."""
    c = CONFIGS["noaux_e64"]
    x, weight, bias = _inputs(c, 40, 400, seed=7, min_gap=None)
    first = _kernel(x, weight, bias, c, num_splits=4)
    again = _kernel(x, weight, bias, c, num_splits=4)
    assert torch.equal(first.topk_ids, again.topk_ids) and torch.equal(first.topk_weights, again.topk_weights)
    assert int(router._counters[x.device].abs().sum()) == 0


def _rule_oracle(logits: torch.Tensor, c: ModelConfig, bias: torch.Tensor | None) -> torch.Tensor:
    """The documented order with stable sorts: descending selection score, the lower group / expert id first."""
    s = _scores(logits, c, bias)
    choice = s.choice
    if s.group_scores is not None:
        kept = s.group_scores.sort(dim=-1, descending=True, stable=True).indices[:, : c.topk_group]
        is_kept = torch.zeros_like(s.group_scores, dtype=torch.bool).scatter_(1, kept, True)
        is_kept = is_kept.repeat_interleave(logits.shape[1] // c.n_group, dim=1)
        choice = choice.masked_fill(~is_kept, float("-inf") if c.topk_method == "noaux_tc" else 0.0)
    return choice.sort(dim=-1, descending=True, stable=True).indices[:, : c.num_experts_per_tok]


@pytest.mark.parametrize("name", ["greedy_softmax_e8", "greedy_sigmoid_norm", "noaux_e20", "group_limited_e20"])
def test_exact_ties_go_to_the_lower_id(name):
    """Small integers make every logit exact whatever the summation order; duplicated weight rows (and duplicated
    groups) make exact ties, some across the top-k boundary: the lower expert (group) id must win."""
    c = CONFIGS[name]
    E, H, T = c.n_routed_experts, 16, 24
    gen = torch.Generator().manual_seed(3)
    weight = torch.randint(-2, 3, (E, H), generator=gen).float()
    bias = (torch.arange(E) % 3 == 0).float() / 8 if c.topk_method == "noaux_tc" else None  # exact in fp32
    for dup, orig in ((E - 1, 0), (E - 3, 2), (E // 2, 1)):
        weight[dup] = weight[orig]
        if bias is not None:
            bias[dup] = bias[orig]
    if c.n_group > 1:  # groups 1 and 3 score alike
        gsize = E // c.n_group
        weight[gsize : 2 * gsize] = weight[3 * gsize : 4 * gsize]
        if bias is not None:
            bias[gsize : 2 * gsize] = bias[3 * gsize : 4 * gsize]
    x = torch.randint(-2, 3, (T, H), generator=gen).float()
    x[:4] = 0.0  # every logit equal: the first K ids (in the first kept groups)
    logits = F.linear(x, weight)
    got = _kernel(x.to(DEV), weight.to(DEV), None if bias is None else bias.to(DEV), c)
    assert torch.equal(got.topk_ids.cpu(), _rule_oracle(logits, c, bias))
    check_routing(got, x.to(DEV), weight.to(DEV), None if bias is None else bias.to(DEV), c, max_diff_rows=T)


def test_supports():
    lite = ModelConfig.from_hf(PRESETS["deepseek-v2-lite"])
    v3 = _config(256, 8, "noaux_tc", "sigmoid", G=8, TG=4, norm_topk_prob=True, routed_scaling_factor=2.5)
    v2 = _config(160, 6, "group_limited_greedy", G=8, TG=3, routed_scaling_factor=16.0)
    assert supports(lite) and supports(v3) and supports(v2) and supports(TINY)
    assert not supports(_config(40, 17))  # K > MAX_TOP_K
    assert not supports(_config(1024, 8))  # E > MAX_EXPERTS
    assert not supports(_config(20, 3, "noaux_tc", "sigmoid", G=3, TG=2))  # groups that do not divide E
    assert not supports(_config(20, 6, "noaux_tc", "sigmoid", G=4, TG=1))  # K more than the kept experts
    assert not supports(dataclasses.replace(lite, scoring_func="relu"))


def _kernels_on(monkeypatch: pytest.MonkeyPatch, calls: list) -> None:
    """`Gate.forward` takes the kernel path on any device (only there: other kernels stay eager), and every
    call that reaches `fused_router` is counted."""

    def enabled(device: torch.device) -> bool:
        return sys._getframe(1).f_code.co_qualname == "Gate.forward"

    monkeypatch.setattr(afd.model.layers, "kernels", SimpleNamespace(enabled=enabled))
    real = router.fused_router

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(router, "fused_router", counted)


@pytest.mark.parametrize("name, is_supported", [("noaux_e20", True), ("greedy_softmax_e20", True), ("k17", False)])
def test_gate_dispatch_and_fallback(name, is_supported, monkeypatch):
    """Gate.forward calls the kernel for a supported config (same routing as eager) and falls back to the eager
    path, unchanged, for one it does not support."""
    c = CONFIGS.get(name) or _config(40, 17, hidden_size=64)
    c = dataclasses.replace(c, hidden_size=64)
    gate = Gate(c, c.routed_scaling_factor).to(DEV)
    x, weight, bias = _inputs(c, 9, 64, seed=11, min_gap=1e-4 if is_supported else None)
    with torch.no_grad():
        gate.weight.copy_(weight)
        if gate.e_score_correction_bias is not None:
            gate.e_score_correction_bias.copy_(bias)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(afd.model.layers, "kernels", SimpleNamespace(enabled=lambda device: False))
        want = gate(x)
    calls: list = []
    _kernels_on(monkeypatch, calls)
    got = gate(x)
    assert len(calls) == (1 if is_supported else 0)
    assert torch.equal(got.topk_ids, want.topk_ids)
    torch.testing.assert_close(got.topk_weights, want.topk_weights, atol=TOL, rtol=0)
    if not is_supported:
        assert torch.equal(got.topk_weights, want.topk_weights)  # the very same eager code


def test_pays_keeps_fp32_gates_on_cublas_where_it_was_faster() -> None:
    assert router.pays(torch.zeros(64, 16), 256) and router.pays(torch.zeros(64, 16, dtype=torch.bfloat16), 8)
    assert not router.pays(torch.zeros(256, 16), 1)  # V3's fp32 gate: cuBLAS won at every T
    assert not router.pays(torch.zeros(64, 16), 4096)  # prefill-sized: cuBLAS won
    assert router.pays(torch.zeros(256, 16, dtype=torch.bfloat16), 4096)
    assert not router.pays(torch.zeros(64, 16, dtype=torch.float64), 1)
