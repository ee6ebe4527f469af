"""The fused MoE router (afd.kernels.router) against `select_experts` over `F.linear(x.float(), W.float())`.

CPU: fp32, tiny shapes in Triton's interpreter (compiled where there is a GPU): exact ids where no two selection
scores are within 1e-5, a tie-tolerant check on plain random inputs, the tie rule (lower expert / group id first)
on exact ties, every supported method, H split over programs, the dispatch in `Gate.forward` and its fallback.
GPU (`-m gpu`): DeepSeek-V2-Lite / V3 / V2 shapes, bf16 rows, bf16 and fp32 (as loaded) gate weights, T in
{1, 8, 64, 256, 4096}, and CUDA-graph capture and replay.
`python tests/test_kernel_router.py bench` on the GPU prints one JSON line per (model, weight dtype, T).
"""

from __future__ import annotations

import dataclasses
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
from afd.kernels import router  # noqa: E402
from afd.kernels.router import fused_router, supports  # noqa: E402
from afd.model.config import ModelConfig  # noqa: E402
from afd.model.layers import Gate  # noqa: E402
from afd.model.moe import select_experts  # noqa: E402
from afd.model.weights import PRESETS  # noqa: E402
from afd.routing import Routing

HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
DEV = torch.device("cuda" if HAS_CUDA else "cpu")
TOL = 1e-5

TINY = ModelConfig.from_hf(PRESETS["tiny"])


def _config(E: int, K: int, method: str = "greedy", scoring: str = "softmax", G: int = 1, TG: int = 1, **kw):
    return dataclasses.replace(
        TINY,
        n_routed_experts=E,
        num_experts_per_tok=K,
        topk_method=method,
        scoring_func=scoring,
        n_group=G,
        topk_group=TG,
        **{"norm_topk_prob": False, "routed_scaling_factor": 1.0, **kw},
    )


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


def _eager(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, c: ModelConfig) -> Routing:
    """The oracle: what `Gate.forward` computes without the kernel."""
    return select_experts(
        F.linear(x.float(), weight.float()),
        top_k=c.num_experts_per_tok,
        scoring_func=c.scoring_func,
        topk_method=c.topk_method,
        n_group=c.n_group,
        topk_group=c.topk_group,
        norm_topk_prob=c.norm_topk_prob,
        routed_scaling_factor=c.routed_scaling_factor,
        e_score_correction_bias=bias,
    )


def _kernel(x, weight, bias, c: ModelConfig, **kw) -> Routing:
    return fused_router(x, weight, bias, c, c.routed_scaling_factor, **kw)


@dataclasses.dataclass
class _Scores:
    """select_experts' intermediate values, from fp32 logits: what "the selection score" means per method."""

    scores: torch.Tensor  # [T, E] softmax / sigmoid
    choice: torch.Tensor  # [T, E] what the top-k ranks (scores + bias for noaux_tc)
    group_scores: torch.Tensor | None  # [T, G]


def _scores(logits: torch.Tensor, c: ModelConfig, bias: torch.Tensor | None) -> _Scores:
    scores = logits.softmax(-1) if c.scoring_func == "softmax" else logits.sigmoid()
    choice = scores + bias.float() if c.topk_method == "noaux_tc" and bias is not None else scores
    if c.topk_method == "greedy":
        return _Scores(scores, choice, None)
    grouped = choice.view(logits.shape[0], c.n_group, -1)  # [T, G, E/G]
    if c.topk_method == "noaux_tc":
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
    else:
        group_scores = grouped.max(-1).values
    return _Scores(scores, choice, group_scores)


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


def check_routing(got: Routing, x, weight, bias, c: ModelConfig, *, tol: float = TOL, max_diff_rows: int = 0):
    """`got` is a correct routing of `x` up to selection scores within `tol` of each other:

    ids distinct and in range; every chosen group (grouped methods) scores within `tol` of the kept ones; every
    chosen expert's selection score >= every unchosen candidate's minus `tol`; descending order within `tol`; the
    weights are the eager formula at the chosen ids within `tol` (before the scaling factor); and at most
    `max_diff_rows` rows differ at all from `select_experts`.
    """
    want = _eager(x, weight, bias, c)
    T, K, E = x.shape[0], c.num_experts_per_tok, c.n_routed_experts
    assert got.topk_ids.shape == (T, K) and got.topk_ids.dtype == torch.int64
    assert got.topk_weights.shape == (T, K) and got.topk_weights.dtype == torch.float32
    if T == 0:
        return
    ids = got.topk_ids.cpu()
    assert int(ids.min()) >= 0 and int(ids.max()) < E
    assert bool((ids.sort(-1).values.diff(dim=-1) > 0).all()), "an expert chosen twice"
    s = _scores(F.linear(x.float(), weight.float()).cpu(), c, None if bias is None else bias.cpu())
    candidate = torch.ones(T, E, dtype=torch.bool)  # experts whose group is surely kept
    if s.group_scores is not None:
        kth = s.group_scores.topk(c.topk_group, -1).values[:, -1:]  # [T, 1]
        gsize = E // c.n_group
        chosen_group_scores = s.group_scores.gather(1, ids // gsize)  # [T, K]
        assert bool((chosen_group_scores >= kth - tol).all()), "an expert of a group that is not among the best"
        candidate = (s.group_scores > kth + tol).repeat_interleave(gsize, dim=1)
    chosen = s.choice.gather(1, ids)  # [T, K]
    is_chosen = torch.zeros(T, E, dtype=torch.bool).scatter_(1, ids, True)
    best_unchosen = s.choice.masked_fill(is_chosen | ~candidate, float("-inf")).max(-1).values  # [T]
    assert bool((chosen.min(-1).values >= best_unchosen - tol).all()), "an unchosen expert scores higher"
    assert bool((chosen[:, :-1] >= chosen[:, 1:] - tol).all()), "not in descending order"
    w = s.scores.gather(1, ids)
    if c.norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    rsf = c.routed_scaling_factor
    torch.testing.assert_close(got.topk_weights.cpu() / rsf, w, atol=tol, rtol=0)
    diff_rows = int((got.topk_ids != want.topk_ids).any(-1).sum())
    assert diff_rows <= max_diff_rows, f"{diff_rows} of {T} rows choose other experts than select_experts"


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
    x, weight, bias = _gpu_inputs(c, T, torch.float32, seed=1)
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


# --- timing (GPU): `python tests/test_kernel_router.py bench` ------------------------------------------------------


def _graph_us(fn, reps: int = 50, rounds: int = 7) -> float:
    """us per call of `fn` inside a CUDA graph (`gpu_timing.graph_ms`)."""
    return graph_ms(fn, reps, rounds) * 1e3


def _stream_us(fn, reps: int = 200) -> float:
    """us per call of `fn` launched eagerly `reps` times between one pair of CUDA events (includes the host's
    launch cost wherever the host is slower than the GPU)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def bench() -> None:
    """One JSON line per (model, gate weight dtype, T): `Gate.forward` eager (AFD_DISABLE_TRITON=1) vs the kernel,
    us per call inside a CUDA graph and launched eagerly, and how many rows choose other experts."""
    import json

    for model in ("v2-lite", "v3"):
        c = MODELS[model]
        for weight_dtype in (torch.float32, torch.bfloat16):
            for T in GPU_TOKENS:
                x, weight, bias = _gpu_inputs(c, T, weight_dtype)
                gate = _gpu_gate(c, weight, bias)
                os.environ["AFD_DISABLE_TRITON"] = "1"
                want = gate(x)
                eager_graph, eager_stream = _graph_us(lambda: gate(x)), _stream_us(lambda: gate(x))  # noqa: B023
                del os.environ["AFD_DISABLE_TRITON"]
                got = gate(x)
                kernel_graph, kernel_stream = _graph_us(lambda: gate(x)), _stream_us(lambda: gate(x))  # noqa: B023
                line = dict(model=model, weight=str(weight_dtype).removeprefix("torch."), T=T)
                line.update(eager_graph_us=round(eager_graph, 2), kernel_graph_us=round(kernel_graph, 2))
                line.update(eager_stream_us=round(eager_stream, 2), kernel_stream_us=round(kernel_stream, 2))
                line.update(speedup_graph=round(eager_graph / kernel_graph, 2))
                line.update(rows_differing=int((got.topk_ids != want.topk_ids).any(-1).sum()))
                line.update(max_weight_diff=float((got.topk_weights - want.topk_weights).abs().max()))
                print(json.dumps(line), flush=True)


if __name__ == "__main__":
    if not HAS_CUDA:
        raise SystemExit("the timing needs CUDA")
    if sys.argv[1:] != ["bench"]:
        raise SystemExit("usage: python tests/test_kernel_router.py bench")
    bench()


def test_pays_keeps_fp32_gates_on_cublas_where_it_was_faster() -> None:
    assert router.pays(torch.zeros(64, 16), 256) and router.pays(torch.zeros(64, 16, dtype=torch.bfloat16), 8)
    assert not router.pays(torch.zeros(256, 16), 1)  # V3's fp32 gate: cuBLAS won at every T
    assert not router.pays(torch.zeros(64, 16), 4096)  # prefill-sized: cuBLAS won
    assert router.pays(torch.zeros(256, 16, dtype=torch.bfloat16), 4096)
    assert not router.pays(torch.zeros(64, 16, dtype=torch.float64), 1)
