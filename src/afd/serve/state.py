"""What the HTTP handlers share: the options, the replica pool, the tokenizer and whether the server can serve."""

from __future__ import annotations

import time
from dataclasses import dataclass

from afd.serve import MAX_PROMPTS_PER_REQUEST
from afd.serve.frontend import ReplicaPool
from afd.serve.healing import Healer
from afd.serve.protocol import APIError
from afd.serve.tokenizer import Tokenizer, TokenizerError


@dataclass
class ServeOptions:
    model_name: str  # what /v1/models lists and requests must name
    api_key: str | None = None
    max_waiting: int = 1024  # prompts allowed to wait for a replica; a request that would pass it gets 429
    max_prompts_per_request: int = MAX_PROMPTS_PER_REQUEST  # more in one request is a 400
    busy_poll: bool = False  # the front end's event loop never sleeps (a core)


class ServerState:
    """What the handlers share: the replicas, the tokenizer, the options, and whether the server can serve.
    `healer`: the one that restarts dead ranks (None: replicas the server did not start, as in tests)."""

    def __init__(
        self, pool: ReplicaPool, tokenizer: Tokenizer, options: ServeOptions, healer: Healer | None = None
    ) -> None:
        self.pool, self.tokenizer, self.options, self.healer = pool, tokenizer, options, healer
        self.draining = False
        self.failed_before_stop = False  # a replica was not whole when the stop came (the exit status says so)
        self.created = int(time.time())

    def status(self) -> str:
        """ok: every replica serves; degraded: some do; down: none does (or the server is stopping)."""
        serving = self.pool.serving()
        if self.draining or not any(serving):
            return "down"
        return "ok" if all(serving) else "degraded"

    def health(self) -> dict:
        """`GET /health`'s body: the status and each replica's link and restarts."""
        restarts = self.healer.restarts if self.healer is not None else [0] * self.pool.num_replicas
        replicas = [{"index": r, "alive": alive, "restarts": restarts[r]} for r, alive in enumerate(self.pool.alive)]
        return {"status": self.status(), "replicas": replicas}

    def problem(self) -> str | None:
        """Why the server cannot take a request now, or None while some replica serves."""
        if self.draining:
            return "the server is shutting down"
        if any(self.pool.serving()):
            return None
        why = self.healer.down_because() if self.healer is not None else None
        return why or "no replica serves now; the server cannot generate"

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
            raise APIError(503, problem, headers={} if self.draining else {"Retry-After": "1"})
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


# ---------------------------------------------------------------- responses
