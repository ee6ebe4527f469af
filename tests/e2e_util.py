"""Shared helpers of the end-to-end tests: a ragged prompt set and the reference comparison."""

from __future__ import annotations

import functools

from afd.engine import Output, generate

MODEL = "tiny"
# Ragged on purpose: long and short prompts, and (with 5 attention replicas) replicas that get nothing.
PROMPTS = [[5, 17, 33, 2, 9, 41, 7, 3, 19, 23, 11], [4, 8], [100, 3, 77, 12, 9, 250], [1]]
MAX_NEW_TOKENS = 5
TOLERANCE = 1e-4


@functools.lru_cache(maxsize=4)
def reference(gate_on_attention: bool = True) -> tuple[Output, ...]:
    return tuple(
        generate(
            MODEL, PROMPTS, max_new_tokens=MAX_NEW_TOKENS, prompt_logprobs=True, gate_on_attention=gate_on_attention
        )
    )


def assert_matches_reference(outputs: list[Output], ref: tuple[Output, ...] | list[Output]) -> None:
    assert len(outputs) == len(ref)
    for got, want in zip(outputs, ref, strict=True):
        assert got.prompt_ids == want.prompt_ids
        assert got.token_ids == want.token_ids, "greedy tokens differ from the reference engine"
        for a, b in zip(got.logprobs, want.logprobs, strict=True):
            assert abs(a - b) <= TOLERANCE
        assert got.prompt_logprobs[0] is None
        for a, b in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:], strict=True):
            assert abs(a - b) <= TOLERANCE
