"""The one interface between an attention model and the FFN side: `Exchange`.

A boundary layer calls `exchange(layer_idx, x, routing)` and adds the answer to its residual. Everything else an
engine, the CUDA-graph runners or a warm-up may ask of an exchange is a method or attribute here with a default
that fits an exchange which has nothing to say about it, so callers never probe for a capability:

| capability | default | who overrides it |
|---|---|---|
| `begin_step(T, ubatch_tokens)` | no-op | p2p: the control plane announces each step's rows |
| `num_ubatches` | 1 | async / p2p micro-batching: the engine splits a step into that many |
| `send` / `recv` | raise | exchanges with `num_ubatches > 1`: one boundary's two halves |
| `capturable` | False | async 1A1F on CUDA: a decode graph captures the exchange as device work |
| `captured_sends` | 0 | the same: exchanges captured so far |
| `warm_up_graph_kernels()` | no-op | the same: compile its kernels before a capture |
| `before_replay()` / `after_replay(n)` | no-ops | the same: the host keeps the device's seq counter |
| `timeline` | None | connectors that record `AFD_TIMELINE` phases |
| `close()` | no-op | connectors that hold windows or groups |
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from afd.profiling.timeline import Timeline
from afd.routing import Routing


class Exchange(ABC):
    """Hands a boundary layer's rows to the FFN side and returns its MoE output."""

    # Micro-batches the engine splits a step into; above 1 the exchange must implement `send` / `recv`.
    num_ubatches: int = 1
    # Exchanges captured inside CUDA graphs so far (`capturable` exchanges count them; the decode runner
    # takes the difference over one capture as the sends of one replay).
    captured_sends: int = 0
    # Where the step's phases are marked (`AFD_TIMELINE`), or None.
    timeline: Timeline | None = None

    @abstractmethod
    def __call__(self, layer_idx: int, x: torch.Tensor, routing: Routing | None) -> torch.Tensor:
        """x: [T, H] model dtype (post-attention-normed); routing: top-k ids [T, K] int64 and weights [T, K] fp32
        when the gate runs on attention, else None -> the layer's MoE output [T, H] model dtype."""

    def begin_step(self, num_tokens: int, ubatch_tokens: Sequence[int] | None = None) -> None:
        """A step of `num_tokens` rows starts (`ubatch_tokens`: its micro-batches' rows, in order, when split).
        Called once per engine step, also with 0 for a step that has nothing to run."""
        return None

    def send(self, layer_idx: int, x: torch.Tensor, routing: Routing | None) -> object:
        """Post one boundary of a micro-batch (x: [n, H], routing as in `__call__`) and return at once."""
        raise NotImplementedError(f"{type(self).__name__} does not split steps into micro-batches")

    def recv(self) -> torch.Tensor:
        """The answer [n, H] model dtype of the oldest `send` not yet received (FIFO)."""
        raise NotImplementedError(f"{type(self).__name__} does not split steps into micro-batches")

    @property
    def capturable(self) -> bool:
        """Whether a decode CUDA graph may capture this exchange's calls as device work, across processes; the
        host then brackets each replay with `before_replay` / `after_replay`."""
        return False

    def warm_up_graph_kernels(self) -> None:
        """Compile what a captured call launches (a compile must not happen during a capture)."""
        return None

    def before_replay(self) -> None:
        """Before a graph holding captured calls is replayed."""
        return None

    def after_replay(self, sends: int) -> None:
        """After a graph holding `sends` captured calls was replayed."""
        return None

    def close(self) -> None:
        """Release what the exchange holds (windows, groups); the FFN side learns the attention side is done."""
        return None


class ZeroExchange(Exchange):
    """Never crosses to the FFN side (graph capture, warm-up): answers zeros [T, H] like x."""

    def __call__(self, layer_idx: int, x: torch.Tensor, routing: Routing | None) -> torch.Tensor:
        return torch.zeros_like(x)
