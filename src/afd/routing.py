"""The result of a MoE router: which experts each token goes to, with what weight. The one value that the
router kernel, the model and both connectors pass between them."""

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
