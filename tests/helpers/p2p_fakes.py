"""Fakes of the p2p connector's neighbours: a stand-in FFN model with deterministic per-expert math (any expert
range), and a process group that records sends and answers recvs from a script, in one process."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

import afd.connectors.p2p.attention as p2p
import afd.connectors.p2p.ffn as p2p_ffn
from afd.connectors.p2p.attention import P2pGroups

H, E, K = 16, 7, 3  # hidden, routed experts (not divisible by 2, 3 or 4), top-k
LAYERS = [0, 1, 2]
DENSE = {0}  # a dense first layer: crosses the boundary only when the gate is on FFN


@dataclass
class StandInRouting:
    topk_ids: torch.Tensor  # [T, K] int64
    topk_weights: torch.Tensor  # [T, K] fp32


_WEIGHTS: dict[int, torch.Tensor] = {}


def _weight(seed: int, cols: int, device: torch.device | None = None) -> torch.Tensor:
    if seed not in _WEIGHTS:
        _WEIGHTS[seed] = torch.randn(H, cols, generator=torch.Generator().manual_seed(seed)) / H**0.5
    return _WEIGHTS[seed].to(device) if device is not None else _WEIGHTS[seed]


class P2pStandInFFN:
    """FFNModel's p2p-facing surface; expert e of layer l: tanh(x @ W[l, e]) * (e + 1)."""

    def __init__(self, expert_range: range = range(E)) -> None:
        self.expert_range = expert_range

    def route(self, layer: int, x: torch.Tensor) -> StandInRouting:
        weights, ids = (x @ _weight(100 + layer, E, x.device)).softmax(-1).topk(K, dim=-1)
        return StandInRouting(ids, weights)

    def dense(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ _weight(200 + layer, H, x.device))

    def expert(self, layer: int, e: int, x: torch.Tensor) -> torch.Tensor:
        assert e in self.expert_range, f"expert {e} is not local to {self.expert_range}"
        return torch.tanh(x @ _weight(1000 * layer + e, H, x.device)) * (e + 1)

    def experts(self, layer: int, x_grouped: torch.Tensor, group_sizes: list[int]) -> torch.Tensor:
        assert len(group_sizes) == len(self.expert_range) and sum(group_sizes) == x_grouped.shape[0]
        chunks = x_grouped.split(group_sizes)
        return torch.cat([self.expert(layer, e, c) for e, c in zip(self.expert_range, chunks, strict=True)])

    def experts_topk(self, layer: int, x: torch.Tensor, routing) -> torch.Tensor:
        """Weighted sum over the (t, k) pairs whose expert is local, fp32 (the F = 1 path)."""
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for t in range(x.shape[0]):
            for k in range(K):
                e = int(routing.topk_ids[t, k])
                if e in self.expert_range:
                    out[t] += routing.topk_weights[t, k] * self.expert(layer, e, x[t : t + 1])[0]
        return out

    def shared(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x + 0.1 * (layer + 1)

    def reference(self, layer: int, x: torch.Tensor, gate_on_attention: bool) -> torch.Tensor:
        """The whole MLP of a layer, token by token, with every expert (single process)."""
        if not gate_on_attention and layer in DENSE:
            return self.dense(layer, x)
        routing = self.route(layer, x)
        out = self.shared(layer, x).clone()
        for t in range(x.shape[0]):
            for k in range(K):
                e = int(routing.topk_ids[t, k])
                out[t] += routing.topk_weights[t, k] * self.expert(layer, e, x[t : t + 1])[0]
        return out


class RecordingPG:
    """A process group that records sends and answers recvs from a script, synchronously."""

    def __init__(self, inbox: dict[tuple[int, int], list[torch.Tensor]] | None = None) -> None:
        self.sent: list[tuple[int, int, torch.Tensor]] = []
        self.recvd: list[tuple[int, int]] = []
        self.inbox = inbox or {}

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> None:
        self.sent.append((dst, tag, tensors[0].clone()))

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> None:
        self.recvd.append((src, tag))
        tensors[0].copy_(self.inbox[(src, tag)].pop(0))


def fake_world(monkeypatch: pytest.MonkeyPatch, role: str, role_rank: int, pg: RecordingPG) -> SimpleNamespace:
    group = SimpleNamespace(pg=pg, group_rank=lambda world_rank: world_rank)
    fake = lambda *a: P2pGroups(data=group, ctrl=group, ep=None, wave=None)  # noqa: E731
    monkeypatch.setattr(p2p, "build_p2p_groups", fake)
    monkeypatch.setattr(p2p_ffn, "build_p2p_groups", fake)
    me = SimpleNamespace(role=role, role_rank=role_rank, name=f"{role} {role_rank}")
    return SimpleNamespace(me=me, backend="gloo", wait_all=lambda works: None, wait=lambda work, what: None)
