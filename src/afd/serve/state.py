"""What the HTTP handlers share: the options, the replica pool, the tokenizer and whether the server can serve."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from afd.serve import MAX_PROMPTS_PER_REQUEST
from afd.serve.frontend import ReplicaPool
from afd.serve.protocol import APIError
from afd.serve.tokenizer import Tokenizer, TokenizerError


@dataclass
class ServeOptions:
    model_name: str  # what /v1/models lists and requests must name
    api_key: str | None = None
    max_waiting: int = 1024  # prompts allowed to wait for a replica; a request that would pass it gets 429
    max_prompts_per_request: int = MAX_PROMPTS_PER_REQUEST  # more in one request is a 400


class ServerState:
    """What the handlers share: the replicas, the tokenizer, the options, and whether the server is healthy."""

    def __init__(
        self,
        pool: ReplicaPool,
        tokenizer: Tokenizer,
        options: ServeOptions,
        dead_ranks: Callable[[], list[str]] = list,
    ) -> None:
        self.pool, self.tokenizer, self.options = pool, tokenizer, options
        self.dead_ranks = dead_ranks  # names of ranks that stopped (the rank supervisor's `.dead()`)
        pool.cause_of_loss = lambda: rank_failure(dead) if (dead := self.dead_ranks()) else None
        self.draining = False
        self.failed_before_stop = False  # a rank or replica was gone when the stop came (the exit status says so)
        self.created = int(time.time())

    def problem(self) -> str | None:
        """Why the server cannot serve now, or None when every rank and replica is up."""
        dead = self.dead_ranks()
        if dead:
            return rank_failure(dead)
        lost = [r for r, ok in enumerate(self.pool.alive) if not ok]
        if lost:
            return f"replica {lost[0]} stopped; the server cannot generate"
        if self.draining:
            return "the server is shutting down"
        return None

    def admit(self, model: str | None, prompts: int) -> None:
        """Refuse a request for another model (404), of more prompts than one request may carry (400), while
        unhealthy or stopping (503), or when its prompts would make more than --max-waiting wait (429)."""
        if model is not None and model != self.options.model_name:
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves {self.options.model_name!r}",
                param="model",
            )
        cap = self.options.max_prompts_per_request
        if prompts > cap:
            raise APIError(
                400,
                f"the request has {prompts} prompts, more than the {cap} one request may carry "
                "(--max-prompts-per-request); send them in several requests",
                param="prompt",
            )
        problem = self.problem()
        if problem:
            raise APIError(503, problem)
        would_wait = self.pool.waiting(prompts)
        if would_wait > self.options.max_waiting:
            raise APIError(
                429,
                f"{self.pool.waiting()} prompts already wait for a replica and this request's {prompts} would make "
                f"{would_wait}, beyond --max-waiting {self.options.max_waiting}; retry later",
                headers={"Retry-After": "1"},
            )

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        try:
            return self.tokenizer.encode(prompt)
        except TokenizerError as exc:
            raise APIError(400, str(exc), param="prompt") from None


def rank_failure(dead: list[str]) -> str:
    """One sentence for ranks that stopped (the supervisor's lines, e.g. 'ffn rank 0 ... exited with status -9')."""
    more = f" (and {len(dead) - 1} more)" if len(dead) > 1 else ""
    return f"{dead[0]}{more}; the server cannot generate until it is restarted"


# ---------------------------------------------------------------- responses
