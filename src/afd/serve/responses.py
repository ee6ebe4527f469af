"""The bodies of /v1/completions and /v1/chat/completions (`protocol`'s models), whole or as server-sent events.

A `Call` is one HTTP request's prompts, checked and ready to run; `pieces` merges the pieces of all its
prompts (one choice each). Streams send one chunk per token (`data: {json}`), then `data: [DONE]`; an
error after the stream began is an error event followed by `[DONE]`. Whatever ends a stream early (the
client leaving or not reading, an error), every prompt still running is aborted on its replica
(`streaming.EventStream` calls `Call.abort`).
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pydantic_core

from afd.serve.output import Piece, Prepared, Run, prepare, run_request
from afd.serve.protocol import (
    DONE,
    AfdTiming,
    APIError,
    AssistantMessage,
    ChatChoice,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatLogProbs,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogProbs,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamResponse,
    DeltaMessage,
    GenerationParams,
    UsageInfo,
    sse,
)

if TYPE_CHECKING:
    from afd.serve.state import ServerState


_ID_PREFIX = secrets.token_hex(8)  # this process's; the ids of one server never repeat, nor across its restarts
_ID_COUNTER = itertools.count()


def next_id() -> str:
    """A response id: a counter after a random prefix (`uuid4` reads the kernel's random source every time)."""
    return f"{_ID_PREFIX}{next(_ID_COUNTER):08x}"


@dataclass
class Call:
    state: ServerState
    id: str
    prepared: list[Prepared]
    params: GenerationParams
    originals: list[str | list[int]] | None  # the prompts as sent (echo returns a string prompt as it came)
    created: int = 0  # unix seconds of the request, as the API reports it
    http_stamps: dict[str, float] | None = None  # its moments in the HTTP layer (`Submitted.stamps`)
    runs: list[Run] | None = None  # each prompt's run on its replica, once submitted (`start`)

    @classmethod
    def build(
        cls,
        state,
        prefix: str,
        prompts: list[list[int]],
        params: GenerationParams,
        originals=None,
        http_stamps: dict[str, float] | None = None,
    ) -> Call:
        prepared = [prepare(state.pool, state.tokenizer, ids, params) for ids in prompts]
        return cls(state, f"{prefix}-{next_id()}", prepared, params, originals, int(time.time()), http_stamps)

    @property
    def model(self) -> str:
        return self.state.options.model_name

    def token_str(self, token_id: int) -> str:
        if self.params.return_tokens_as_token_ids:
            return f"token_id:{token_id}"
        return self.state.tokenizer.token_text(token_id)

    def usage(self, completion_tokens: int) -> UsageInfo:
        return UsageInfo.of(sum(len(p.prompt_ids) for p in self.prepared), completion_tokens)

    def rid(self, i: int) -> str:
        return f"{self.id}-{i}"

    def start(self) -> None:
        """Submit every prompt (at most once); all or none: a prompt that cannot be submitted aborts the others."""
        if self.runs is not None:
            return
        runs: list[Run] = []
        try:
            for i, p in enumerate(self.prepared):
                pool, tokenizer = self.state.pool, self.state.tokenizer
                runs.append(run_request(pool, tokenizer, self.rid(i), p, self.params, self.http_stamps))
        except BaseException:
            self.abort(len(runs))
            raise
        self.runs = runs

    def abort(self, count: int | None = None) -> None:
        """Abort the first `count` prompts (default all) on their replicas: no-ops for those already ended."""
        for i in range(len(self.prepared) if count is None else count):
            self.state.pool.abort(self.rid(i))

    async def pieces(self) -> AsyncIterator[tuple[int, Piece]]:
        """(choice index, piece) of every prompt as they come (submitting them first, unless `start` did);
        raises the first APIError of any prompt."""
        self.start()
        runs, n = self.runs, len(self.prepared)
        assert runs is not None
        if n == 1:
            async with aclosing(runs[0].pieces()) as run:
                async for piece in run:
                    yield 0, piece
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                async with aclosing(runs[i].pieces()) as run:
                    async for piece in run:
                        queue.put_nowait((i, piece))
            except APIError as err:
                queue.put_nowait((i, err))
            queue.put_nowait((i, None))

        tasks = [asyncio.create_task(pump(i)) for i in range(n)]
        try:
            while n:
                i, item = await queue.get()
                if isinstance(item, APIError):
                    raise item
                if item is None:
                    n -= 1
                else:
                    yield i, item
        finally:
            for task in tasks:
                task.cancel()


@dataclass
class Choice:
    """One prompt's output, gathered."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None
    finish_reason: str | None = None

    def add(self, piece: Piece) -> None:
        if piece.prompt_logprobs is not None:
            self.prompt_logprobs = piece.prompt_logprobs
        if piece.token_id is not None:
            self.token_ids.append(piece.token_id)
            self.logprobs.append(piece.logprob)
            self.offsets.append(len(self.text))
        self.text += piece.text
        self.finish_reason = piece.finish_reason or self.finish_reason


async def _gather(call: Call) -> list[Choice]:
    choices = [Choice() for _ in call.prepared]
    async with aclosing(call.pieces()) as pieces:
        async for i, piece in pieces:
            choices[i].add(piece)
    return choices


def _echo(call: Call, i: int) -> tuple[str, list[int]]:
    """The prompt text a completion echoes, and each prompt token's offset in it."""
    ids = call.prepared[i].prompt_ids
    decoder, text, offsets = call.state.tokenizer.decoder(), "", []
    for t in ids:
        offsets.append(len(text))
        text += decoder.push(t)
    text += decoder.flush()
    original = call.originals[i] if call.originals else None
    return (original if isinstance(original, str) else text), offsets


def _completion_choice(call: Call, i: int, c: Choice, *, with_prompt: bool) -> CompletionChoice:
    text, tokens, lps, offsets = c.text, [call.token_str(t) for t in c.token_ids], list(c.logprobs), list(c.offsets)
    if with_prompt:
        prompt_text, prompt_offsets = _echo(call, i)
        text = prompt_text + text
        ids = call.prepared[i].prompt_ids
        prompt_lps = c.prompt_logprobs or [None] * len(ids)
        tokens = [call.token_str(t) for t in ids] + tokens
        lps = list(prompt_lps) + lps
        offsets = prompt_offsets + [o + len(prompt_text) for o in offsets]
    logprobs = None
    if call.params.logprobs is not None:
        logprobs = CompletionLogProbs.of(tokens, lps, offsets, top=call.params.logprobs > 0)
    return CompletionChoice(index=i, text=text, logprobs=logprobs, finish_reason=c.finish_reason)


async def completion_response(call: Call) -> CompletionResponse:
    choices = await _gather(call)
    return CompletionResponse(
        id=call.id,
        created=call.created,
        model=call.model,
        choices=[_completion_choice(call, i, c, with_prompt=call.params.echo) for i, c in enumerate(choices)],
        usage=call.usage(sum(len(c.token_ids) for c in choices)),
    )


async def chat_response(call: Call) -> ChatCompletionResponse:
    (c,) = await _gather(call)
    logprobs = None
    if call.params.logprobs is not None:
        tokens = [call.token_str(t) for t in c.token_ids]
        logprobs = ChatLogProbs.of(tokens, c.logprobs, top=call.params.logprobs > 0)
    choice = ChatChoice(
        index=0, message=AssistantMessage(content=c.text), logprobs=logprobs, finish_reason=c.finish_reason
    )
    return ChatCompletionResponse(
        id=call.id, created=call.created, model=call.model, choices=[choice], usage=call.usage(len(c.token_ids))
    )


# ---------------------------------------------------------------- streams
Chunk = CompletionStreamResponse | ChatCompletionStreamResponse
TEXT_MARK = "\x00afd-text\x00"  # the text's stand-in; nothing else in a chunk (ids, model names) holds it


class TextTemplate:
    """A server-sent event serialized once with `TEXT_MARK` as its text: `fill(text)` gives the event with `text`
    instead, byte for byte what serializing it anew gives (the text's JSON comes from pydantic's own encoder)."""

    def __init__(self, event: bytes) -> None:
        self.prefix, mark, self.suffix = event.partition(pydantic_core.to_json(TEXT_MARK))
        if not mark:
            raise ValueError("the event does not hold the text marker")

    def fill(self, text: str) -> bytes:
        return self.prefix + pydantic_core.to_json(text) + self.suffix


async def _events(
    call: Call, envelope: Callable[..., Chunk], chunk_of: Callable, first: list, plain: bool
) -> AsyncIterator[bytes]:
    """`first`'s chunks, then `chunk_of(i, piece)` for every piece (one per token, its text possibly held back, and
    the last with `finish_reason`), then usage when asked, then [DONE]; the pieces of one event in one write. With
    `afd_timing` asked for, each choice's closing chunk also says how long its replica took to the first token, and
    the moments on the way there (`Submitted.stamps`). `plain` (no logprobs asked for): a token's chunk differs from
    the next only by its text, so it is the choice's chunk serialized once around a marker, the text's JSON put in
    its place (`TextTemplate`): the same bytes, at a fraction of a model's cost per token and stream."""
    generated = 0
    templates: dict[int, TextTemplate] = {}

    def event_of(i: int, piece: Piece) -> bytes:
        nonlocal generated
        generated += piece.token_id is not None
        if plain and piece.token_id is not None and piece.finish_reason is None:
            template = templates.get(i)
            if template is None:  # chunk_of's own count of a choice's text matters only with logprobs
                template = templates[i] = TextTemplate(sse(envelope(choices=[chunk_of(i, Piece(TEXT_MARK, 0))])))
            event = template.fill(piece.text)
        else:
            chunk = envelope(choices=[chunk_of(i, piece)])
            if call.params.afd_timing and piece.finish_reason is not None:
                chunk.afd_timing = AfdTiming(index=i, engine_ttft_s=piece.engine_ttft_s, stamps=piece.stamps)
            event = sse(chunk)
        if piece.stamps is not None and piece.token_id is not None and "written" not in piece.stamps:
            piece.stamps["written"] = time.perf_counter()  # before the write: the client may read it first
        return event

    try:
        if first:
            yield b"".join(sse(envelope(choices=[choice])) for choice in first)
        if call.runs is not None and len(call.runs) == 1:
            async with aclosing(call.runs[0].batches()) as batches:
                async for batch in batches:
                    if batch:
                        yield b"".join(event_of(0, piece) for piece in batch)
        else:
            async with aclosing(call.pieces()) as pieces:
                async for i, piece in pieces:
                    yield event_of(i, piece)
        if call.params.include_usage:
            yield sse(envelope(choices=[], usage=call.usage(generated)))
    except APIError as err:
        yield sse(err.body())
    yield DONE


def stream_completion(call: Call) -> AsyncIterator[bytes]:
    """The events of a streamed completion (the prompts submitted already: `Call.start`)."""
    want_logprobs = call.params.logprobs is not None
    top = want_logprobs and call.params.logprobs > 0
    offsets = [0] * len(call.prepared)  # where the next piece starts in each choice's text
    first = []
    if call.params.echo:  # the prompt goes first; its logprobs are not known yet in a stream (null)
        for i in range(len(call.prepared)):
            echo = _completion_choice(call, i, Choice(), with_prompt=True)
            offsets[i] = len(echo.text)
            first.append(CompletionStreamChoice(index=i, text=echo.text, logprobs=echo.logprobs))

    def chunk_of(i: int, piece: Piece) -> CompletionStreamChoice:
        logprobs = None
        if want_logprobs and piece.token_id is not None:
            logprobs = CompletionLogProbs.of([call.token_str(piece.token_id)], [piece.logprob], [offsets[i]], top)
        offsets[i] += len(piece.text)
        return CompletionStreamChoice(index=i, text=piece.text, logprobs=logprobs, finish_reason=piece.finish_reason)

    def envelope(**fields) -> CompletionStreamResponse:
        return CompletionStreamResponse(id=call.id, created=call.created, model=call.model, **fields)

    return _events(call, envelope, chunk_of, first, plain=not want_logprobs)


def stream_chat(call: Call) -> AsyncIterator[bytes]:
    """The events of a streamed chat completion (the prompt submitted already: `Call.start`)."""
    want_logprobs = call.params.logprobs is not None
    first = [ChatStreamChoice(index=0, delta=DeltaMessage(role="assistant", content=""))]

    def chunk_of(i: int, piece: Piece) -> ChatStreamChoice:
        logprobs = None
        if want_logprobs and piece.token_id is not None:
            tokens = [call.token_str(piece.token_id)]
            logprobs = ChatLogProbs.of(tokens, [piece.logprob], top=call.params.logprobs > 0)
        delta = DeltaMessage(content=piece.text) if piece.text or piece.token_id is not None else DeltaMessage()
        return ChatStreamChoice(index=i, delta=delta, logprobs=logprobs, finish_reason=piece.finish_reason)

    def envelope(**fields) -> ChatCompletionStreamResponse:
        return ChatCompletionStreamResponse(id=call.id, created=call.created, model=call.model, **fields)

    return _events(call, envelope, chunk_of, first, plain=not want_logprobs)
