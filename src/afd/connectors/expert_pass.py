"""One expert pass over the work items of one layer that wait together at an FFN rank.

Why: with several attention replicas on one FFN rank, their requests for the same layer often sit in
the window at the same time. Computing them in one pass reads each touched expert's weights once
instead of once per replica — the reason to give several replicas one FFN rank. Answers still go
back per item.

Every row's answer is a function of that row alone (its hidden state, its top-k): the routed sum
runs over its own (row, k) pairs in a fixed order (`afd.model.moe.routed_experts`: by local expert on the
exact path, over k on the fixed-shape one), and the shared experts are a row-wise MLP. So batching
changes which rows share a matmul, never what is summed or in which order; a GEMM may still pick
another tiling for another row count, which moves a row's result by float rounding at most.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from afd.routing import Routing


class FFNModelLike(Protocol):
    """The part of `afd.model.ffn_side.FFNModel` an async FFN rank uses."""

    has_shared_experts: bool  # False: the attention ranks run them (`shared` is never needed)

    def experts_topk(self, layer_idx: int, x: torch.Tensor, routing: Routing) -> torch.Tensor: ...

    def shared(self, layer_idx: int, x: torch.Tensor) -> torch.Tensor: ...


@dataclass
class WorkRows:
    """The rows of one work item (one request message)."""

    x: torch.Tensor  # [R, H] model dtype
    topk_ids: torch.Tensor  # [R, K] int32 or int64: global expert ids (the FFN model keeps its own)
    topk_weights: torch.Tensor  # [R, K] fp32
    shared_rows: int  # the leading rows whose shared experts run here


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class GraphedPass(Protocol):
    """A replayed expert pass (`afd.engine.graphs.ffn.ExpertPassGraphs`): None where it has no graph for the rows."""

    def run(
        self,
        layer_idx: int,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        shared: Sequence[tuple[int, int]],
    ) -> torch.Tensor | None: ...


def expert_pass(
    ffn_model: FFNModelLike, layer_idx: int, items: Sequence[WorkRows], graphs: GraphedPass | None = None
) -> list[torch.Tensor]:
    """Items of one layer → per item `[R_i, H]` fp32: its rows' weighted sum over their local experts,
    plus the shared experts on its leading `shared_rows` rows. One routed pass and one shared pass for
    all items together; with `graphs`, one replay where a graph holds the rows (the results are then views
    of the graph's output: write them out before the next pass)."""
    if not items:
        return []
    sizes = [it.x.shape[0] for it in items]
    shared = [it.shared_rows for it in items]
    x = _cat([it.x for it in items])  # [N, H]
    if graphs is not None and x.shape[0]:
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        ids, weights = _cat([it.topk_ids for it in items]), _cat([it.topk_weights for it in items])
        out = graphs.run(layer_idx, x, ids, weights, list(zip(starts, shared, strict=True)))
        if out is not None:
            return list(out.split(sizes))
    routing = Routing(_cat([it.topk_ids for it in items]).long(), _cat([it.topk_weights for it in items]).float())
    if x.shape[0]:
        out = ffn_model.experts_topk(layer_idx, x, routing).float()  # [N, H] fp32
    else:
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    outs = list(out.split(sizes))  # views of `out`
    if sum(shared):
        shared_out = ffn_model.shared(layer_idx, _cat([it.x[:s] for it, s in zip(items, shared, strict=True)]))
        for o, part, s in zip(outs, shared_out.split(shared), shared, strict=True):
            o[:s] += part.float()
    return outs
