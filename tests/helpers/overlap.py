"""Driving the engine with and without a step in flight, and comparing what each streamed."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from afd.engine.engine import Engine, LocalExchange, Output, Request


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 256) for _ in range(n)]  # the tiny preset's vocabulary


class Recorder(LocalExchange):
    """The local exchange (so CUDA captures whole steps), recording the token count of every step launched."""

    def __init__(self, ffn) -> None:
        super().__init__(ffn)
        self.steps: list[int] = []

    def begin_step(self, num_tokens: int) -> None:
        if num_tokens:
            self.steps.append(num_tokens)


@dataclass
class Run:
    outputs: list[Output]  # by request index
    streamed: list[list[int]]  # by request index: the tokens `last_step_tokens` showed, in order
    steps: list[int]  # tokens of every step launched
    engine: Engine
    in_flight_events: int = 0  # adds and aborts made while a step was in flight
    aborted: dict[int, Output] = field(default_factory=dict)


def drive(
    models,
    overlap: bool,
    requests: list[Request],
    arrive_after: list[int] | None = None,
    abort: tuple[int, int] | None = None,
    budget: int = 64,
) -> Run:
    """Step an engine to the end as a server does: request i enters once `arrive_after[i]` steps were launched
    (or at once when the engine has nothing to do); `abort=(i, j)` aborts request i once j of its tokens were
    streamed. Arrivals keyed on steps launched, not on calls, give both engines the same schedule."""
    attn, ffn = models
    rec = Recorder(ffn)
    engine = Engine(attn, rec, budget, overlap_steps=overlap)
    arrive_after = arrive_after or [0] * len(requests)
    order = sorted(range(len(requests)), key=arrive_after.__getitem__)
    ids: dict[int, int] = {}  # engine id -> request index
    run = Run([None] * len(requests), [[] for _ in requests], rec.steps, engine)
    added = 0
    while added < len(order) or engine.has_work():
        while added < len(order) and (arrive_after[order[added]] <= len(rec.steps) or not engine.has_work()):
            run.in_flight_events += engine.step_in_flight
            ids[engine.add(requests[order[added]])] = order[added]
            added += 1
        for out in engine.step():
            run.outputs[ids[out.request_id]] = out
        for t in engine.last_step_tokens:
            run.streamed[ids[t.request_id]].append(t.token_id)
        if abort is not None and abort[0] not in run.aborted and len(run.streamed[abort[0]]) == abort[1]:
            run.in_flight_events += engine.step_in_flight
            engine_id = next(k for k, i in ids.items() if i == abort[0])
            run.outputs[abort[0]] = run.aborted[abort[0]] = engine.abort(engine_id)
    assert not engine.has_work() and not engine.step_in_flight
    assert engine.kv_cache.pool.num_free == engine.kv_cache.num_blocks and engine.cache_tokens_used == 0
    return run


def assert_same(got: list[Output], want: list[Output], tol: float = 0.0) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert (g.prompt_ids, g.token_ids, g.finish_reason) == (w.prompt_ids, w.token_ids, w.finish_reason)
        if tol == 0:
            assert g.logprobs == w.logprobs and g.prompt_logprobs == w.prompt_logprobs
        else:
            assert g.logprobs == pytest.approx(w.logprobs, abs=tol)


def assert_streamed(run: Run) -> None:
    """What `last_step_tokens` showed is every token of every output, once, in order."""
    assert run.streamed == [o.token_ids for o in run.outputs]
