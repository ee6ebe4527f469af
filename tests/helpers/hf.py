"""Shared by the tests that build tiny random `transformers` DeepSeek checkpoints."""

from __future__ import annotations

import torch


def spread_weights(model: torch.nn.Module) -> None:
    """Weights larger than the default init, so that routing and rope matter (seed the caller)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
            else:
                p.normal_(0, 0.15)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
