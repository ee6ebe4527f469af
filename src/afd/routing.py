"""The result of a MoE router: which experts each token goes to, with what weight. The one value that the
router kernel, the model and both connectors pass between them; and its (token, k) pairs sorted by expert, the
order the grouped expert GEMMs read."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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


@dataclass
class SortedPairs:
    """All T*K (token, k) pairs of a routing sorted by local expert: fixed shape `[T*K]`, all on the device.

    Pairs whose expert lies outside the range sort last and belong to no group. `pair_idx` indexes the
    flattened `[T*K]` routing, `token_idx` is the row of x of each pair, `offs [E_local] int32` holds the
    cumulative group ends, so `offs[-1]` is the number of local pairs.
    """

    pair_idx: torch.Tensor
    token_idx: torch.Tensor
    offs: torch.Tensor


def sort_pairs_by_expert(topk_ids: torch.Tensor, expert_start: int, expert_stop: int) -> SortedPairs:
    """Sort every (token, k) pair by local expert, non-local pairs last, without reading anything back.

    One stable argsort over keys where a non-local expert gets the sentinel `expert_stop - expert_start`;
    counts by `scatter_add_` (CUDA `bincount` reads the maximum back to the host) and `cumsum`, both on the
    device. Ties keep pair order, so the local pairs come out exactly as `group_by_expert` orders them.
    """
    top_k, num_local = topk_ids.shape[1], expert_stop - expert_start
    local = topk_ids.reshape(-1) - expert_start  # [T*K]
    key = torch.where((local >= 0) & (local < num_local), local, num_local)  # [T*K], sentinel num_local
    pair_idx = torch.argsort(key, stable=True)  # [T*K]
    ones = torch.ones_like(key, dtype=torch.int32)
    counts = torch.zeros(num_local + 1, dtype=torch.int32, device=key.device).scatter_add_(0, key, ones)
    offs = counts[:num_local].cumsum(0, dtype=torch.int32)  # [E_local]
    return SortedPairs(pair_idx=pair_idx, token_idx=pair_idx // top_k, offs=offs)
