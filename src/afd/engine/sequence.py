"""What the engine keeps per request and per step: a sequence's progress, a scheduled piece of a step, and a
step launched on the device whose tokens the host has not read yet (overlapped steps, `afd.engine.engine`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from afd.engine.request import Request


@dataclass
class SequenceState:
    request_id: int
    request: Request
    slot: int = -1
    num_cached: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None
    stop_ids: frozenset[int] = frozenset()

    @property
    def capacity(self) -> int:
        """Cache rows the sequence ever needs: the last sampled token is never fed back."""
        return len(self.request.prompt_ids) + max(self.request.max_new_tokens - 1, 0)

    @property
    def prefilling(self) -> bool:
        """Whether part of the prompt is not cached yet (derived from `num_cached`, the one progress counter)."""
        return self.num_cached < len(self.request.prompt_ids)


# The input id of a decode launched ahead (`Scheduler.schedule_ahead`): the token the step in flight sampled, read
# on the device; the host never sees it in `input_ids`.
ON_DEVICE = -1


@dataclass
class Scheduled:
    seq: SequenceState
    input_ids: list[int]  # [ON_DEVICE] for a decode launched ahead
    start: int  # first position (== tokens already cached)

    @property
    def is_decode(self) -> bool:
        """One generated token fed back (not a piece of the prompt)."""
        return self.start >= len(self.seq.request.prompt_ids)

    @property
    def samples(self) -> bool:
        """Whether this step samples the sequence's next token: a decode, or the chunk that ends its prompt."""
        return self.start + len(self.input_ids) >= len(self.seq.request.prompt_ids)


@dataclass
class LaunchedStep:
    """A step whose forward and sampling are queued on the device; its tokens reach the host in
    `ModelRunner.read_tokens`."""

    scheduled: list[Scheduled]
    sampled: list[Scheduled]  # the sequences whose rows were sampled, in row order
    tokens: torch.Tensor | None  # [B] int64 on the device: the sampled tokens (a follow-up step's input ids)
    host: torch.Tensor | None  # [2, B] float64 (pinned on CUDA): tokens and their logprobs, copy under way
    ready: torch.cuda.Event | None  # recorded after that copy (CUDA); None: the copy is already done
