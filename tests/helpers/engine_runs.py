"""Single-process engine runs on the tiny preset shared by the unit and e2e tests: random prompts, the models, an
engine, the reference outputs and how two runs' outputs are compared."""

from __future__ import annotations

import random

import pytest

from afd.engine.engine import Engine, LocalExchange, Output
from afd.engine.generate import generate
from afd.engine.sampling import SamplingParams
from helpers.e2e import MODEL

TOL = 1e-5


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 256) for _ in range(n)]  # the tiny preset's vocabulary


def engine_of(models, budget: int, **kwargs) -> Engine:
    attn, ffn = models
    return Engine(attn, LocalExchange(ffn), budget, **kwargs)


def assert_same(got: list[Output], want: list[Output], tol: float = TOL) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.prompt_ids == w.prompt_ids
        assert g.token_ids == w.token_ids
        assert g.logprobs == pytest.approx(w.logprobs, abs=tol)
        if w.prompt_logprobs is None:
            assert g.prompt_logprobs is None
        else:
            assert g.prompt_logprobs[0] is None and len(g.prompt_logprobs) == len(g.prompt_ids)
            assert g.prompt_logprobs[1:] == pytest.approx(w.prompt_logprobs[1:], abs=tol)


def whole(prompts: list[list[int]], max_new_tokens: int, sampling: SamplingParams | None = None) -> list[Output]:
    """The reference: every prompt prefilled in one step (the budget fits them all)."""
    return generate(MODEL, prompts, max_new_tokens=max_new_tokens, prompt_logprobs=True, sampling=sampling)
