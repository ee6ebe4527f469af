"""Scores, configs and the eager reference of the router kernel, shared by its CPU and GPU tests."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F  # noqa: E402

from afd.kernels.router import fused_router  # noqa: E402
from afd.model.config import ModelConfig  # noqa: E402
from afd.model.moe import select_experts  # noqa: E402
from afd.model.weights import PRESETS  # noqa: E402
from afd.routing import Routing

HAS_CUDA = torch.cuda.is_available()
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
