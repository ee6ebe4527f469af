"""Launched async runs over uneven replicas and their single-process reference, shared by the async e2e tests."""

from __future__ import annotations

import random
from pathlib import Path

from afd.engine.generate import generate
from helpers.e2e import (
    MAX_NEW_TOKENS,
    MODEL,
    launch_checked,
)

# ---------------------------------------------------------------- helpers
VOCAB = 256  # the tiny preset


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, VOCAB) for _ in range(n)]


def uneven_prompts(num_attn: int) -> list[list[int]]:
    """Prompt i goes to replica i % A: replica 0 gets long prompts, replica 1 short ones, and (A >= 3)
    the last replica gets none."""
    if num_attn == 1:
        return [tokens(100, 1), [7, 3], tokens(60, 2), [11]]
    if num_attn == 2:
        return [tokens(120, 1), [3], tokens(60, 2), [5, 9], tokens(90, 3), [200, 1, 42]]
    # one prompt each for replicas 0..A-2 (long, short, then medium); replica A-1 gets nothing
    return [tokens(120, 1), [3, 8]] + [tokens(7, 10 + a) for a in range(2, num_attn - 1)]


def run_async(
    num_attn: int,
    num_ffn: int,
    prompts: list[list[int]],
    *,
    max_new_tokens: int = MAX_NEW_TOKENS,
    max_num_batched_tokens: int = 2048,
    run_dir: Path | None = None,
):
    return launch_checked(
        "async",
        num_attn,
        num_ffn,
        prompts,
        max_new_tokens=max_new_tokens,
        max_num_batched_tokens=max_num_batched_tokens,
        run_dir=run_dir,
        recv_poll_timeout_ms=100,
    )


def reference(prompts: list[list[int]], max_new_tokens: int = MAX_NEW_TOKENS):
    return generate(MODEL, prompts, max_new_tokens=max_new_tokens, prompt_logprobs=True)
