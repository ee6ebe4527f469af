"""The `async` connector's neighbours without a model: a stand-in FFN side whose experts are elementwise (expert e of
layer l: tanh(x) * (1 + 0.1 e) + 0.01 (e + l)), the direct computation it must equal, random routings and small
window dims."""

from __future__ import annotations

import glob
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import torch
import torch.distributed as dist

from afd.connectors.asynchronous.attention import AsyncAttentionExchange
from afd.connectors.asynchronous.ffn import AsyncFFNServer
from afd.topology import AsyncTopology
from afd.transport.shm import cleanup_segments

NUM_EXPERTS, TOPK, HIDDEN, NUM_LAYERS, MAX_TOKENS = 6, 2, 16, 2, 32


def dims(poll_ms: int = 50) -> dict:
    return dict(
        hidden_size=HIDDEN,
        topk=TOPK,
        num_layers=NUM_LAYERS,
        dtype=torch.float32,
        device="cpu",
        max_num_batched_tokens=MAX_TOKENS,
        extra_config={"recv_poll_timeout_ms": poll_ms},
        timeout_s=30.0,
    )


class AsyncStandInFFN:
    """Deterministic per-expert math: expert e(x) = tanh(x) * (1 + 0.1 e) + 0.01 (e + layer)."""

    def __init__(self, expert_range: range) -> None:
        self.start = expert_range.start
        self.num_local = len(expert_range)

    def experts_topk(self, layer_idx: int, x: torch.Tensor, routing) -> torch.Tensor:
        """fp32 sum over the (row, k) pairs whose expert is local; other pairs add nothing."""
        out = torch.zeros(x.shape, dtype=torch.float32)
        for k in range(routing.topk_ids.shape[1]):
            ids = routing.topk_ids[:, k]
            is_local = (ids >= self.start) & (ids < self.start + self.num_local)
            out += torch.where(is_local[:, None], routing.topk_weights[:, k : k + 1] * expert_fn(layer_idx, x, ids), 0)
        return out

    def shared(self, layer_idx: int, x: torch.Tensor) -> torch.Tensor:
        return x * 0.5 + 0.25 * layer_idx + 1.0


def expert_fn(layer_idx: int, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    ids = ids.to(torch.float32).unsqueeze(1)
    return torch.tanh(x) * (1 + 0.1 * ids) + 0.01 * (ids + layer_idx)


def reference(layer_idx: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """Direct computation: sum_k w[t, k] * expert_{ids[t, k]}(x[t]) + shared(x[t])."""
    out = AsyncStandInFFN(range(0)).shared(layer_idx, x)
    for k in range(topk_ids.shape[1]):
        out = out + topk_weights[:, k : k + 1] * expert_fn(layer_idx, x, topk_ids[:, k])
    return out


def routing(num_tokens: int, g: torch.Generator, experts: list[int] | None = None) -> SimpleNamespace:
    pool = experts if experts is not None else list(range(NUM_EXPERTS))
    rows = [torch.tensor(pool)[torch.randperm(len(pool), generator=g)[:TOPK]] for _ in range(num_tokens)]
    ids = torch.stack(rows) if rows else torch.zeros(0, TOPK, dtype=torch.int64)  # [T, K]
    return SimpleNamespace(topk_ids=ids, topk_weights=torch.rand(num_tokens, TOPK, generator=g))


def segments_of(token: str) -> list[str]:
    """The shared-memory segments of a run, by its token."""
    return sorted(glob.glob(f"/dev/shm/afd_{token}_*"))


@contextmanager
def endpoints(num_ffn: int, **extra: object) -> Iterator[tuple[AsyncAttentionExchange, list[AsyncFFNServer]]]:
    """1 attention rank and `num_ffn` FFN ranks in this process over real shared memory."""
    store = dist.HashStore()
    topo = AsyncTopology(1, num_ffn, NUM_EXPERTS)
    args = dims()
    args["extra_config"] = {**args["extra_config"], **extra}
    servers: dict[int, AsyncFFNServer] = {}
    threads = [
        threading.Thread(target=lambda f=f: servers.setdefault(f, AsyncFFNServer(store, topo, f, **args)))
        for f in range(num_ffn)
    ]
    for t in threads:
        t.start()
    ex = AsyncAttentionExchange(store, topo, 0, **args)
    for t in threads:
        t.join(30)
    try:
        yield ex, [servers[f] for f in range(num_ffn)]
    finally:
        ex.close()
        for s in servers.values():
            s.close()
        cleanup_segments(ex.window.heap.run_token)


def models(num_ffn: int) -> list[AsyncStandInFFN]:
    return [AsyncStandInFFN(r) for r in AsyncTopology(1, num_ffn, NUM_EXPERTS).expert_ranges]
