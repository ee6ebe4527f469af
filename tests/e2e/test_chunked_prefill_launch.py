"""Chunked prefill across launched ranks: a 1A1F run whose budget is smaller than a prompt equals the reference, through
the p2p and async connectors."""

from __future__ import annotations

import math

import pytest
from helpers.e2e import launch_checked
from helpers.engine_runs import assert_same, engine_of, tokens, whole

from afd.engine.engine import Request

SHARED_TEST_TAG = True  # one zygote for the module's launches (tests/conftest.py)

# ---------------------------------------------------------------- launched: real rank processes
E2E_PROMPTS = [tokens(30, 11), [7, 3], tokens(13, 12)]
E2E_BUDGET = 8
E2E_NEW = 3


def steps_in_process(models) -> int:
    """Steps the single-process engine takes for the e2e prompts at the e2e budget."""
    engine = engine_of(models, E2E_BUDGET)
    for p in E2E_PROMPTS:
        engine.add(Request(list(p), E2E_NEW, prompt_logprobs=True))
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
    return steps


@pytest.mark.timeout(120)
@pytest.mark.parametrize("connector", ["p2p", "async"])
def test_launched_1a1f_with_a_small_budget_equals_reference(models, connector: str) -> None:
    """1A1F with an 8-token budget and a 30-token prompt: the attention rank chunks the prefill (as many
    steps as the in-process engine) and every output equals the whole-prefill reference."""
    extra = {"timeout_s": 60} if connector == "p2p" else {"recv_poll_timeout_ms": 100}
    outputs, stats = launch_checked(
        connector, 1, 1, E2E_PROMPTS, max_new_tokens=E2E_NEW, max_num_batched_tokens=E2E_BUDGET, **extra
    )
    assert_same(outputs, whole(E2E_PROMPTS, E2E_NEW), tol=1e-4)
    (replica,) = stats["replicas"]
    assert replica["num_steps"] == steps_in_process(models) >= math.ceil(sum(map(len, E2E_PROMPTS)) / E2E_BUDGET)
