"""One request's output as the client sees it: tokens in, text pieces out, cut at the first stop string.

`OutputText` detokenizes incrementally and releases text only when it is final: a character whose bytes
are not all there yet is held back (the tokenizer's decoder does that), and so is a tail that could be
the beginning of a stop string. When a stop string appears, the text ends just before it and the request
is finished with `finish_reason: "stop"` (the front end then aborts it on its replica).

`run_request` submits one prompt and returns its `Run`, whose events `PieceMaker` turns into `Piece`s; the
streaming and the non-streaming handlers both read them from it, so both give the same text.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from afd.serve.frontend import Event, ReplicaPool, Submitted
from afd.serve.protocol import APIError, GenerationParams
from afd.serve.streaming import Stall
from afd.serve.tokenizer import Tokenizer

# The longest a request waits for its next event (tokens or its end), queueing included: generous, but bounded.
REQUEST_STALL_S = 600.0
STALLED = Event("stalled")  # what a request's `Stall` puts in its queue when that wait is over


class OutputText:
    def __init__(self, tokenizer: Tokenizer, stop: list[str]) -> None:
        self._decoder = tokenizer.decoder()
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1  # longest partial match worth holding back
        self.text = ""  # everything decoded so far (the output, once cut at a stop string)
        self.sent = 0  # characters of `text` released
        self.stopped = False

    def add(self, token_id: int) -> str:
        """The text this token releases ('' while held back); nothing after a stop string."""
        if self.stopped:
            return ""
        return self._release(self._decoder.push(token_id), final=False)

    def finish(self) -> str:
        """The rest of the text, at the end of the request."""
        if self.stopped:
            return ""
        return self._release(self._decoder.flush(), final=True)

    def _release(self, piece: str, final: bool) -> str:
        start = max(0, len(self.text) - self._hold)  # a stop string may begin in the held-back tail
        self.text += piece
        cut = min((i for s in self._stop if (i := self.text.find(s, start)) >= 0), default=-1)
        if cut >= 0:
            self.stopped, self.text = True, self.text[:cut]
            end = cut
        elif final:
            end = len(self.text)
        else:
            end = len(self.text) - self._partial_stop()
        released, self.sent = self.text[self.sent : end], max(self.sent, end)
        return released

    def _partial_stop(self) -> int:
        """Length of the longest tail of the text that is the beginning of a stop string."""
        for k in range(min(self._hold, len(self.text)), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self._stop):
                return k
        return 0


@dataclass
class Piece:
    """What one token (or the end) adds: its text, id and logprob; the last piece has `finish_reason`."""

    text: str
    token_id: int | None = None
    logprob: float | None = None
    finish_reason: str | None = None
    prompt_logprobs: list[float | None] | None = None  # on the last piece, when the replica scored the prompt
    engine_ttft_s: float | None = None  # on the last piece: the replica's own time to the first token
    stamps: dict[str, float] | None = None  # the request's moments to its first token (`Submitted.stamps`), shared


@dataclass
class Prepared:
    """A prompt checked and ready: its ids, the tokens it may generate, and what ends it."""

    prompt_ids: list[int]
    max_tokens: int
    stop_token_ids: list[int] = field(default_factory=list)


def prepare(pool: ReplicaPool, tokenizer: Tokenizer, prompt_ids: list[int], params: GenerationParams) -> Prepared:
    """Check a prompt against the served model (vocabulary, length, cache) and fix its `max_tokens`."""
    if not prompt_ids:
        raise APIError(400, "the prompt is empty; it needs at least one token", param="prompt")
    vocab = pool.vocab_size
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
        bad_id = next(t for t in prompt_ids if not 0 <= t < vocab)
        raise APIError(400, f"token id {bad_id} is outside the vocabulary [0, {vocab})", param="prompt")
    limit = pool.max_model_len
    room = limit - len(prompt_ids)
    if room < 1:
        raise APIError(
            400,
            f"the prompt has {len(prompt_ids)} tokens, which leaves no room in this model's "
            f"maximum context length of {limit} tokens; shorten it",
            param="prompt",
        )
    # no max_tokens (chat): what the context and a replica's cache leave
    max_tokens = params.max_tokens
    if max_tokens is None:
        max_tokens = max(1, min(room, pool.max_request_tokens - len(prompt_ids) + 1))
    if len(prompt_ids) + max_tokens > limit:
        raise APIError(
            400,
            f"this model's maximum context length is {limit} tokens, but the request asks for "
            f"{len(prompt_ids) + max_tokens} ({len(prompt_ids)} in the prompt, {max_tokens} to generate); "
            "shorten the prompt or lower max_tokens",
            param="max_tokens",
        )
    need = len(prompt_ids) + max_tokens - 1
    if need > pool.max_request_tokens:
        raise APIError(
            400,
            f"the request needs {need} KV-cache rows but a replica's whole cache holds "
            f"{pool.max_request_tokens}; shorten the prompt or lower max_tokens",
            param="max_tokens",
        )
    stops = list(params.stop_token_ids) + ([] if params.ignore_eos else list(tokenizer.stop_token_ids))
    return Prepared(list(prompt_ids), max_tokens, sorted(set(stops)))


class PieceMaker:
    """One prompt's events turned into pieces: the text through its stop strings, stop tokens hidden, the end with
    its reason."""

    def __init__(self, tokenizer: Tokenizer, prepared: Prepared, params: GenerationParams, sub: Submitted) -> None:
        self.text = OutputText(tokenizer, params.stop)
        self.stop_ids = set(prepared.stop_token_ids)
        self.sub = sub
        self.done = False  # the last piece was made
        self.stopped = False  # a stop string ended it here, not its replica: the replica must be told

    def take(self, event: Event) -> list[Piece]:
        """The pieces of one event; APIError when the event is the request's failure."""
        sub, text = self.sub, self.text
        if event.kind == "tokens":
            pieces = []
            for token_id, logprob in event.items:
                shown = token_id not in self.stop_ids  # a stop token ends the request and is not text
                pieces.append(Piece(text.add(token_id) if shown else "", token_id, logprob, stamps=sub.stamps))
                if text.stopped:
                    self.done = self.stopped = True
                    pieces.append(
                        Piece(text.finish(), finish_reason="stop", engine_ttft_s=sub.engine_ttft_s, stamps=sub.stamps)
                    )
                    break
            return pieces
        self.done = True
        if event.reason == "error":
            raise APIError(event.status or 500, event.message or "the request failed on its replica")
        return [
            Piece(
                text.finish(),
                finish_reason="stop" if text.stopped else event.reason,
                prompt_logprobs=event.prompt_logprobs,
                engine_ttft_s=sub.engine_ttft_s,
                stamps=sub.stamps,
            )
        ]


class Run:
    """One prompt submitted to a replica, until it ends: its pieces as they come (`pieces`, or `batches`: those of
    one event together). However it ends — a stop string, the client gone, an error — a request that is still
    running on its replica is aborted there, which frees its cache (`abort`, a no-op once it ended)."""

    def __init__(self, pool: ReplicaPool, rid: str, sub: Submitted, maker: PieceMaker) -> None:
        self.pool, self.rid, self.sub, self.maker = pool, rid, sub, maker
        self.last_event_at = time.monotonic()

    def _take(self, event: Event) -> list[Piece]:
        self.last_event_at = time.monotonic()
        try:
            return self.maker.take(event)
        finally:
            if self.maker.stopped:
                self.pool.abort(self.rid, "stop")

    async def batches(self) -> AsyncIterator[list[Piece]]:
        """The pieces of the events waiting, together, as they arrive (one event may carry several tokens); aborts
        however it ends. Why together: a front end behind its replicas (a thousand streams at a step each) finds
        several steps' events queued per stream, and one write for them all costs it what one event's does."""
        queue, held = self.sub.queue, None
        # bounded: a replica alive but answering nothing (frozen) must not hold the client forever
        stall = Stall(REQUEST_STALL_S, lambda: queue.put_nowait(STALLED))
        try:
            while not self.maker.done:
                if held is not None:  # a failure comes after the pieces before it
                    event, held = held, None
                elif not queue.empty():
                    event = queue.get_nowait()
                else:
                    stall.begin()
                    event = await queue.get()
                    stall.end()
                if event is STALLED:
                    raise self.stalled()
                pieces = self._take(event)
                while not self.maker.done and not queue.empty():
                    event = queue.get_nowait()
                    if event is STALLED or (event.kind != "tokens" and event.reason == "error"):
                        held = event
                        break
                    pieces += self._take(event)
                yield pieces
        finally:
            stall.close()
            self.abort()

    async def pieces(self) -> AsyncIterator[Piece]:
        async with aclosing(self.batches()) as batches:
            async for batch in batches:
                for piece in batch:
                    yield piece

    def stalled(self) -> APIError:
        return APIError(
            504, f"replica {self.sub.replica} sent nothing for this request in {REQUEST_STALL_S:g} s; it was aborted"
        )

    def abort(self) -> None:
        self.pool.abort(self.rid)


def run_request(
    pool: ReplicaPool,
    tokenizer: Tokenizer,
    rid: str,
    prepared: Prepared,
    params: GenerationParams,
    http_stamps: dict[str, float] | None = None,
) -> Run:
    """Submit one prompt now (APIError 503 when no replica is alive); submitted at the call, not at the first
    piece: a stream prepares its response while the replica already works."""
    try:
        sub = pool.submit(
            rid,
            prepared.prompt_ids,
            prepared.max_tokens,
            params.sampling,
            prepared.stop_token_ids,
            prompt_logprobs=params.echo and params.logprobs is not None,
            http_stamps=http_stamps,
        )
    except LookupError as exc:
        raise APIError(503, f"the server cannot take requests: {exc}", headers={"Retry-After": "1"}) from None
    return Run(pool, rid, sub, PieceMaker(tokenizer, prepared, params, sub))
