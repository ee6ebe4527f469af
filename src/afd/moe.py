"""Routing and grouped expert compute: the pieces of a MoE layer that a connector moves around.

The router is a pure function of the gate logits, so the attention side (gate on attention) and the
FFN side (gate on FFN) select the same experts. Expert compute takes rows already grouped by local
expert (the async form) and `group_by_expert` turns (rows, topk ids) (the p2p form) into that.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

SCORING_FUNCS = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclass
class Routing:
    """Experts chosen for each token: `topk_ids [T, K] int64`, `topk_weights [T, K] float32`.

    The weights include `routed_scaling_factor` except in float16 (see docs/architecture.md).
    """

    topk_ids: torch.Tensor
    topk_weights: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.topk_ids.shape[0]


def select_experts(
    router_logits: torch.Tensor,
    *,
    top_k: int,
    scoring_func: str = "softmax",
    topk_method: str = "greedy",
    n_group: int = 1,
    topk_group: int = 1,
    norm_topk_prob: bool = False,
    routed_scaling_factor: float = 1.0,
    e_score_correction_bias: torch.Tensor | None = None,
) -> Routing:
    """Pick `top_k` experts per token from `router_logits [T, E] float32`.

    greedy: top-k of the scores. group_limited_greedy (DeepSeek-V2): keep the `topk_group` groups with
    the highest max score, zero the rest. noaux_tc (DeepSeek-V3): choose on `score + bias`, groups ranked
    by the sum of their top-2 choice scores; the weights are the unbiased scores of the chosen experts.
    """
    if scoring_func not in SCORING_FUNCS:
        raise ValueError(f"unknown scoring_func {scoring_func!r}; expected one of {SCORING_FUNCS}")
    if topk_method not in TOPK_METHODS:
        raise ValueError(f"unknown topk_method {topk_method!r}; expected one of {TOPK_METHODS}")
    logits = router_logits.float()  # [T, E]
    num_tokens, num_experts = logits.shape
    scores = logits.softmax(dim=-1) if scoring_func == "softmax" else logits.sigmoid()  # [T, E]

    if topk_method == "greedy":
        topk_weights, topk_ids = torch.topk(scores, k=top_k, dim=-1)  # [T, K]
    else:
        choice = scores
        if topk_method == "noaux_tc" and e_score_correction_bias is not None:
            choice = scores + e_score_correction_bias.float()  # [T, E]
        grouped = choice.view(num_tokens, n_group, num_experts // n_group)  # [T, G, E/G]
        if topk_method == "noaux_tc":
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)  # [T, G]
        else:
            group_scores = grouped.max(dim=-1).values  # [T, G]
        group_ids = torch.topk(group_scores, k=topk_group, dim=-1).indices  # [T, topk_group]
        is_kept_group = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_ids, True)
        is_kept = is_kept_group.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)  # [T, E]
        fill = float("-inf") if topk_method == "noaux_tc" else 0.0
        choice = choice.masked_fill(~is_kept, fill)
        topk_ids = torch.topk(choice, k=top_k, dim=-1).indices  # [T, K]
        topk_weights = scores.gather(1, topk_ids)  # [T, K]

    if norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    topk_weights = topk_weights * routed_scaling_factor
    return Routing(topk_ids=topk_ids.long(), topk_weights=topk_weights.float())


@dataclass
class ExpertGroups:
    """(token, k) pairs owned by a range of experts, sorted by local expert.

    `pair_idx [N]` indexes the flattened `[T*K]` routing; `token_idx [N]` is the row of x for each;
    `group_sizes[i]` pairs belong to local expert i.
    """

    pair_idx: torch.Tensor
    token_idx: torch.Tensor
    group_sizes: list[int]


def group_by_expert(topk_ids: torch.Tensor, expert_start: int, expert_stop: int) -> ExpertGroups:
    """Sort the (token, k) pairs whose expert lies in `[expert_start, expert_stop)` by local expert.

    One stable argsort, one bincount, one device->host copy (the group sizes).
    """
    top_k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)  # [T*K]
    is_local = (flat >= expert_start) & (flat < expert_stop)  # [T*K]
    pair_idx = is_local.nonzero().squeeze(1)  # [N]
    local_ids = flat[pair_idx] - expert_start  # [N]
    order = torch.argsort(local_ids, stable=True)  # [N]
    pair_idx = pair_idx[order]
    counts = torch.bincount(local_ids, minlength=expert_stop - expert_start)  # [E_local]
    return ExpertGroups(pair_idx=pair_idx, token_idx=pair_idx // top_k, group_sizes=counts.tolist())


@cache
def _grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """`torch._grouped_mm` needs CUDA sm90+ and bf16; everything else takes the loop."""
    if device.type != "cuda" or dtype != torch.bfloat16 or not hasattr(torch, "_grouped_mm"):
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def grouped_expert_mlp(
    x: torch.Tensor,
    group_sizes: list[int],
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    use_grouped_mm: bool | None = None,
) -> torch.Tensor:
    """SwiGLU experts over rows grouped by expert, unweighted.

    x: [N, H] rows, `group_sizes[i]` consecutive rows for expert i (sum == N);
    w13: [E, 2I, H] (gate rows then up rows); w2: [E, H, I]. Returns [N, H] in x.dtype.
    """
    if len(group_sizes) != w13.shape[0]:
        raise ValueError(f"{len(group_sizes)} group sizes for {w13.shape[0]} experts")
    if sum(group_sizes) != x.shape[0]:
        raise ValueError(f"group sizes sum to {sum(group_sizes)} but there are {x.shape[0]} rows")
    if use_grouped_mm is None:
        use_grouped_mm = _grouped_mm_supported(x.device, x.dtype)
    if use_grouped_mm and x.shape[0] > 0:
        offs = torch.tensor(group_sizes, device=x.device, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        gate_up = torch._grouped_mm(x, w13.transpose(1, 2), offs=offs)  # [N, 2I]
        gate, up = gate_up.chunk(2, dim=-1)
        return torch._grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs=offs)  # [N, H]
    out = x.new_empty(x.shape)  # [N, H]
    start = 0
    for e, n in enumerate(group_sizes):
        if n == 0:
            continue
        rows = x[start : start + n]  # [n, H]
        gate, up = F.linear(rows, w13[e]).chunk(2, dim=-1)  # [n, I] each
        out[start : start + n] = F.linear(F.silu(gate) * up, w2[e])
        start += n
    return out
