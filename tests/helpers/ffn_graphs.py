"""Work items of an expert pass, for the FFN graph tests."""

from __future__ import annotations

import torch

from afd.connectors.expert_pass import WorkRows


def _items(config, sizes_shared, *, expert_range, device="cpu", dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    items = []
    for rows, shared in sizes_shared:
        x = torch.randn(rows, config.hidden_size, generator=gen).to(device, dtype)
        ids = (
            torch.stack(
                [
                    torch.randperm(config.n_routed_experts, generator=gen)[: config.num_experts_per_tok]
                    for _ in range(rows)
                ]
            )
            if rows
            else torch.zeros(0, config.num_experts_per_tok, dtype=torch.long)
        )
        weights = torch.rand(rows, config.num_experts_per_tok, generator=gen)
        items.append(WorkRows(x, ids.to(device, torch.int32), weights.to(device), shared))
    return items
