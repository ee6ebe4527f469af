"""What goes into an engine and what comes out: a request, its output, the tokens of one step, the load.

Plain data, shared by the engine, the runtimes that drive it and the serving front end.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from afd.engine.sampling import SamplingParams


@dataclass
class Request:
    """A prompt to continue for `max_new_tokens` tokens; greedy unless `sampling` says otherwise
    (`afd.engine.sampling`: temperature, top-p, top-k, seed). A sampled token in `stop_token_ids` (EOS, for a
    server) ends the request after it is emitted; nothing stops it otherwise."""

    prompt_ids: list[int]
    max_new_tokens: int
    prompt_logprobs: bool = False
    sampling: SamplingParams | None = None
    stop_token_ids: Sequence[int] = ()


@dataclass
class Output:
    """`logprobs[j] = log p(token_ids[j] | prompt + token_ids[:j])` under the model's own distribution
    (untempered and unfiltered, also when the token was sampled, as vLLM reports); `prompt_logprobs` is
    `[None, log p(prompt[1] | prompt[:1]), ...]` or None when not requested."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    prompt_logprobs: list[float | None] | None
    request_id: int = -1
    finish_reason: str = "length"  # "length" (max_new_tokens), "stop" (a stop token) or "abort"

    def to_json(self) -> dict:
        """The four public fields (the `afd generate --json` object), without the request id."""
        return {
            "prompt_ids": self.prompt_ids,
            "token_ids": self.token_ids,
            "logprobs": self.logprobs,
            "prompt_logprobs": self.prompt_logprobs,
        }


@dataclass(frozen=True, slots=True)
class StepToken:
    """One token a step appended to a request (what a server streams)."""

    request_id: int
    token_id: int
    logprob: float


@dataclass(frozen=True)
class EngineLoad:
    """What a router weighs: sequences running and waiting, and the share of KV-cache blocks in use (0..1)."""

    running: int
    waiting: int
    cache_usage: float
    graphs_captured: int = 0  # decode CUDA graphs captured while serving (`Engine.graphs_captured_while_serving`)
    # the device time of the steps run so far and their count (`StepClock`); not a change of load by themselves
    step_device_s: float = field(default=0.0, compare=False)
    steps: int = field(default=0, compare=False)
    step_idle_s: float = field(default=0.0, compare=False)  # the device idle between steps (`StepClock`)
    # the part of `step_device_s` and `steps` that held a prompt token (prefill or mixed steps)
    prompt_step_device_s: float = field(default=0.0, compare=False)
    prompt_steps: int = field(default=0, compare=False)
