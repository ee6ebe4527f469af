"""Chunked prefill: a step is the running decodes plus prompt chunks within `max_num_batched_tokens`.

A prompt longer than what is left of the budget is prefilled over several steps and sampled only after
its last chunk; tokens, logprobs and prompt logprobs equal one whole prefill (fp32, tiny preset), in the
single-process engine and through the p2p and async connectors.
"""

from __future__ import annotations

import math
import random

import pytest
from helpers.e2e import MODEL, launch_checked

from afd.cli.main import build_parser, run_spec
from afd.engine.engine import Engine, LocalExchange, Output, Request
from afd.engine.generate import generate
from afd.engine.sampling import SamplingParams
from afd.model.weights import load_attention_model, load_ffn_model

TOL = 1e-5


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 256) for _ in range(n)]  # the tiny preset's vocabulary


PROMPTS = [tokens(37, 1), [7, 3], tokens(20, 2), [9]]


@pytest.fixture(scope="module")
def models():
    return load_attention_model(MODEL), load_ffn_model(MODEL)


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


@pytest.mark.timeout(120)
@pytest.mark.parametrize("budget", [1, 5, 16])
@pytest.mark.parametrize(
    "sampling", [None, SamplingParams(temperature=0.8, top_k=20, seed=3)], ids=["greedy", "seeded"]
)
def test_chunked_prefill_equals_whole_prefill(models, budget: int, sampling: SamplingParams | None) -> None:
    """Budgets smaller than one prompt (down to one token a step): same tokens, logprobs and prompt
    logprobs as one whole prefill; the 37-token prompt needs ceil(37 / budget) steps before its first token."""
    engine = engine_of(models, budget)
    for p in PROMPTS:
        engine.add(Request(list(p), 4, prompt_logprobs=True, sampling=sampling))
    steps_to_first_token, outputs, steps = None, {}, 0
    while engine.has_work():
        for out in engine.step():
            outputs[out.request_id] = out
        steps += 1
        assert steps < 1000, "the engine does not make progress"
        first = next((s for s in engine.running if s.request_id == 0), None)
        if steps_to_first_token is None and (0 in outputs or (first and first.token_ids)):
            steps_to_first_token = steps
    assert steps_to_first_token == math.ceil(len(PROMPTS[0]) / budget)
    assert_same([outputs[k] for k in sorted(outputs)], whole(PROMPTS, 4, sampling))


@pytest.mark.timeout(60)
def test_prompt_only_scoring_across_chunks(models) -> None:
    """max_new_tokens=0 (prompt scoring): every prompt logprob of a chunked prompt equals the whole prefill's."""
    engine = engine_of(models, 6)
    for p in PROMPTS:
        engine.add(Request(list(p), 0, prompt_logprobs=True))
    got = engine.run()
    assert all(o.token_ids == [] for o in got)
    assert_same(got, whole(PROMPTS, 0))


@pytest.mark.timeout(60)
def test_decodes_keep_running_while_a_long_prompt_is_chunked(models) -> None:
    """A running sequence gets a token in every step while a 40-token prompt arrives and is prefilled in
    chunks of what its decode leaves of an 8-token budget (7, 7, 7, 7, 7, 5: six steps)."""
    short, long = [1, 2, 3], tokens(40, 7)
    engine = engine_of(models, 8)
    short_id = engine.add(Request(short, 30, prompt_logprobs=True))
    engine.step()
    (running,) = engine.running
    assert len(running.token_ids) == 1
    long_id = engine.add(Request(long, 3, prompt_logprobs=True))
    cached, made = [], []
    while True:
        before = len(running.token_ids)
        assert not engine.step()
        made.append(len(running.token_ids) - before)
        seq = next(s for s in engine.running if s.request_id == long_id)
        cached.append(seq.num_cached)
        if seq.token_ids:
            break
        assert len(cached) < 20, "the long prompt never finished its prefill"
    assert cached == [7, 14, 21, 28, 35, 40]
    assert made == [1] * 6, "the running sequence must get a token in every step of the chunking"
    outputs = {o.request_id: o for o in engine.run()}
    assert_same([outputs[short_id]], whole([short], 30))
    assert_same([outputs[long_id]], whole([long], 3))


def test_cli_keeps_the_budget_as_given() -> None:
    """`--max-num-batched-tokens` is the per-step budget (vLLM's meaning): no longer raised to the longest prompt."""
    args = build_parser().parse_args(
        ["launch", "--model", MODEL, "--prompt-ids", "1,2,3,4,5,6,7,8,9,10", "--max-num-batched-tokens", "4"]
    )
    assert run_spec(args, [list(range(1, 11))]).max_num_batched_tokens == 4


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
