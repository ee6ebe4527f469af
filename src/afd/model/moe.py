"""Routing and grouped expert compute: the pieces of a MoE layer that a connector moves around.

The router is a pure function of the gate logits, so the attention side (gate on attention) and the
FFN side (gate on FFN) select the same experts. Expert compute takes rows already grouped by local
expert (the async form) and `group_by_expert` turns (rows, topk ids) (the p2p form) into that.

Two ways to compute routed experts from (rows, routing), same result:
- fixed shape (`routed_experts(..., fixed_shape=True)`, the default where `torch._grouped_mm` runs
  natively: CUDA sm90+, bf16): every one of the T*K (token, k) pairs goes through the grouped GEMM, sorted by
  local expert with the non-local ones last; counts and offsets stay on the device; the weighted combine sums
  over k in fp32 in a fixed order. No host sync, every shape depends only on T (a CUDA graph can capture it),
  and the same bits on every run.
- exact loop (everywhere else, e.g. the CPU fp32 path the oracle tests check): only the local pairs, one
  `F.linear` per expert, group sizes read back to the host.
The router itself (`select_experts`) never reads device data on the host.

Decode-shaped batches on CUDA (at most `FUSED_MOE_MAX_PAIRS` (token, k) pairs, or that many grouped rows, counted
by `afd.buckets.path_rows`) take afd's Triton kernels (`afd.kernels.fused_moe`) in the fixed-shape path and in
`grouped_expert_mlp_offsets`, when `afd.kernels.enabled` allows them: a counting sort, gate/up + SwiGLU, down +
weighting straight into (t, k) order, and a sum over k — four launches, no host sync, no atomics, each touched
expert's weights read once.
Larger batches of 16/32-bit experts keep `torch._grouped_mm`, the better GEMM once every expert has many rows.

FP8 experts (`afd.model.fp8.FP8Experts`, DeepSeek-V3's block-scaled format) go through the `fp8_*` twins of the three
entry points: on CUDA with the kernels enabled, at every size, Triton kernels with the rows quantized to fp8 per
1 x b1 group (fp8 x fp8 MMAs, both scales in registers: half the weight bytes streamed, nothing dequantized in
memory, capturable the same way): the decode kernels above, and tiles of rows past `afd.kernels.fused_moe`'s
`PREFILL_ROWS_PER_EXPERT`. Elsewhere (CPU, `eager_ops`, a block width b1 not a multiple of 32, the exact loop), the
weights are dequantized to the compute dtype (one Triton pass each on CUDA) and the 16/32-bit path runs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F

from afd import kernels
from afd.buckets import path_rows
from afd.model.fp8 import FP8Experts, block_in_kernels
from afd.routing import Routing, sort_pairs_by_expert

logger = logging.getLogger(__name__)

# The most (token, k) pairs (fixed-shape path) or grouped rows (`grouped_expert_mlp_offsets`) that take the Triton
# kernels rather than `torch._grouped_mm`, rows counted by `path_rows` (a power of two, so that padding to a graph
# bucket never changes the path): up to 512 tokens at top-6 (DeepSeek-V2) or at top-8 (V3), where streaming the
# weights is most of the cost. H200, V2-Lite's experts, bf16, ms per layer, kernels / grouped GEMM
# (`scripts/gpu_moe_fp8.py`, rows bf16 / bf16-engine): 342 tokens 0.316 / 0.462, 512 0.334 / 0.464, 640 0.445 /
# 0.470, 768 0.596 / 0.498: they cross between 640 and 768 tokens, so 513-682 tokens pay up to ~5% for it.
FUSED_MOE_MAX_PAIRS = 4096

SCORING_FUNCS = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


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
        return grouped_expert_mlp_offsets(x, _offsets_on(group_sizes, x.device), w13, w2)
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


def _moe_kernels_run(x: torch.Tensor) -> bool:
    """Whether afd's Triton MoE kernels can take rows `x`: CUDA, a dtype they support, `afd.kernels.enabled`."""
    return (
        x.device.type == "cuda"
        and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and kernels.enabled(x.device)
    )


def _fused_moe_enabled(x: torch.Tensor, top_k: int = 1) -> bool:
    """Whether 16-bit experts take the Triton decode kernels for rows `x` (tokens of `top_k` pairs each, or grouped
    rows): where they run (`_moe_kernels_run`) and a decode-sized batch, at most `FUSED_MOE_MAX_PAIRS` pairs or rows
    counted by `path_rows` (so padding to a graph bucket never changes the path; above it `torch._grouped_mm`)."""
    return path_rows(x.shape[0]) * top_k <= FUSED_MOE_MAX_PAIRS and _moe_kernels_run(x)


def _offsets_on(group_sizes: list[int], device: torch.device) -> torch.Tensor:
    """Cumulative group ends `[E] int32` on `device` from host sizes.

    On CUDA the sizes go through pinned memory with a non-blocking copy: a pageable
    `torch.tensor(list, device=cuda)` blocks the host until the copy is done.
    """
    sizes = torch.tensor(group_sizes, dtype=torch.int32, pin_memory=device.type == "cuda")
    return sizes.to(device, non_blocking=True).cumsum(0, dtype=torch.int32)


def grouped_expert_mlp_offsets(
    x: torch.Tensor, offs: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """SwiGLU experts by `torch._grouped_mm` over rows grouped by device offsets, unweighted; no host sync.

    x: [N, H]; offs: [E] int32 cumulative group ends on x's device (rows `[offs[i-1], offs[i])` go to expert
    i); w13: [E, 2I, H]; w2: [E, H, I]. Returns [N, H] in x.dtype. Rows at and past `offs[-1]` belong to no
    group and their outputs are undefined (the kernel does not write them): callers must not read them.
    At most `FUSED_MOE_MAX_PAIRS` rows on CUDA run afd's Triton kernels instead (same contract).
    """
    if _fused_moe_enabled(x):
        from afd.kernels.fused_moe import fused_grouped_expert_mlp

        return fused_grouped_expert_mlp(x, offs, w13, w2)
    gate_up = torch._grouped_mm(x, w13.transpose(1, 2), offs=offs)  # [N, 2I]
    gate, up = gate_up.chunk(2, dim=-1)  # [N, I] each
    if kernels.enabled(x.device):  # one pass instead of silu, then multiply
        from afd.kernels.swiglu import silu_mul

        act = silu_mul(gate, up)  # [N, I]
    else:
        act = F.silu(gate) * up
    return torch._grouped_mm(act, w2.transpose(1, 2), offs=offs)  # [N, H]


def routed_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    expert_start: int = 0,
    *,
    fixed_shape: bool | None = None,
) -> torch.Tensor:
    """x [T, H] -> fp32 [T, H]: sum over the (t, k) pairs whose expert is one of the stacked local experts
    `[expert_start, expert_start + E_local)` of `topk_weights[t, k] * expert(x[t])`; other pairs add nothing.

    `fixed_shape=None` picks the fixed-shape path where `torch._grouped_mm` runs natively (CUDA sm90+, bf16)
    and the exact loop elsewhere; see the module docstring. On CUDA the fixed-shape path of a decode-sized
    batch (T*K <= `FUSED_MOE_MAX_PAIRS`) runs afd's Triton kernels (`afd.kernels.fused_moe.fused_routed_experts`).
    """
    num_local = w13.shape[0]
    if fixed_shape is None:
        fixed_shape = _grouped_mm_supported(x.device, x.dtype)
    if not fixed_shape:
        groups = group_by_expert(topk_ids, expert_start, expert_start + num_local)
        y = grouped_expert_mlp(x[groups.token_idx], groups.group_sizes, w13, w2)  # [N, H]
        w = topk_weights.reshape(-1)[groups.pair_idx]  # [N]
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, H]
        return out.index_add_(0, groups.token_idx, y.float() * w[:, None])
    if x.shape[0] == 0 or num_local == 0:
        return torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    if _fused_moe_enabled(x, topk_ids.shape[1]):
        from afd.kernels.fused_moe import fused_routed_experts

        return fused_routed_experts(x, topk_ids, topk_weights, w13, w2, expert_start)
    pairs = sort_pairs_by_expert(topk_ids, expert_start, expert_start + num_local)
    y = grouped_expert_mlp_offsets(x[pairs.token_idx], pairs.offs, w13, w2)  # [T*K, H]
    if kernels.enabled(x.device):  # prefill sizes: one pass from the sorted outputs to the fp32 sum
        from afd.kernels.moe_combine import combine_sorted_pairs

        return combine_sorted_pairs(y, pairs.pair_idx, topk_weights, pairs.offs)
    w = topk_weights.reshape(-1)[pairs.pair_idx].float()  # [T*K]
    # Rows past the last group were never written (possibly NaN): select zeros there rather than weigh them.
    in_group = torch.arange(y.shape[0], device=y.device) < pairs.offs[-1]  # [T*K]
    contrib = torch.where(in_group[:, None], y * w[:, None], 0.0)  # [T*K, H] fp32, sorted by expert
    # Back to (t, k) order, then a sum over k: unlike an atomic index_add_, the same bits every run, eager or
    # replayed from a CUDA graph.
    by_pair = torch.empty_like(contrib).index_copy_(0, pairs.pair_idx, contrib)  # [T*K, H]
    return by_pair.view(x.shape[0], topk_ids.shape[1], -1).sum(dim=1)  # [T, H]


def _fp8_kernels_take(x: torch.Tensor, experts: FP8Experts) -> bool:
    """Whether FP8 experts run in afd's fused Triton kernels for rows `x`: where the kernels run, for a block size
    they take with fp8 rows (b1 a multiple of 32)."""
    return _moe_kernels_run(x) and block_in_kernels(experts.block)


def _scales(experts: FP8Experts):  # -> afd.kernels.fused_moe.ExpertScales (imports triton: only once enabled)
    from afd.kernels.fused_moe import ExpertScales

    return ExpertScales(experts.w13_scale_inv, experts.w2_scale_inv, experts.block)


def fp8_routed_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    experts: FP8Experts,
    expert_start: int = 0,
    *,
    fixed_shape: bool | None = None,
) -> torch.Tensor:
    """`routed_experts` with FP8 experts: on the fixed-shape path the fused kernels on the FP8 weights with fp8 rows
    where they run (`_fp8_kernels_take`), same contract (no host sync, shapes from T only); else
    `routed_experts` on the dequantized weights (one pass each on CUDA, then the 16-bit grouped GEMM)."""
    if fixed_shape is None:
        fixed_shape = _grouped_mm_supported(x.device, x.dtype)
    num_local = experts.w13.shape[0]
    if fixed_shape and x.shape[0] > 0 and num_local > 0 and _fp8_kernels_take(x, experts):
        from afd.kernels.fused_moe import fused_routed_experts

        w13, w2 = experts.w13, experts.w2
        return fused_routed_experts(x, topk_ids, topk_weights, w13, w2, expert_start, scales=_scales(experts))
    w13, w2 = experts.dequantized(x.dtype)
    return routed_experts(x, topk_ids, topk_weights, w13, w2, expert_start, fixed_shape=fixed_shape)


def fp8_grouped_expert_mlp_offsets(x: torch.Tensor, offs: torch.Tensor, experts: FP8Experts) -> torch.Tensor:
    """`grouped_expert_mlp_offsets` with FP8 experts (same contract): the fused kernels on the FP8 weights with fp8
    rows where they run (`_fp8_kernels_take`), else the dequantized weights through `torch._grouped_mm`."""
    if _fp8_kernels_take(x, experts):
        from afd.kernels.fused_moe import fused_grouped_expert_mlp

        return fused_grouped_expert_mlp(x, offs, experts.w13, experts.w2, scales=_scales(experts))
    return grouped_expert_mlp_offsets(x, offs, *experts.dequantized(x.dtype))


def fp8_grouped_expert_mlp(
    x: torch.Tensor, group_sizes: list[int], experts: FP8Experts, *, use_grouped_mm: bool | None = None
) -> torch.Tensor:
    """`grouped_expert_mlp` with FP8 experts: where it would take the device-offsets path and the fused kernels
    apply, those on the FP8 weights; else `grouped_expert_mlp` on the dequantized weights."""
    if use_grouped_mm is None:
        use_grouped_mm = _grouped_mm_supported(x.device, x.dtype)
    fits = len(group_sizes) == experts.w13.shape[0] and sum(group_sizes) == x.shape[0]
    if fits and use_grouped_mm and x.shape[0] > 0 and _fp8_kernels_take(x, experts):
        return fp8_grouped_expert_mlp_offsets(x, _offsets_on(group_sizes, x.device), experts)
    return grouped_expert_mlp(x, group_sizes, *experts.dequantized(x.dtype), use_grouped_mm=use_grouped_mm)
