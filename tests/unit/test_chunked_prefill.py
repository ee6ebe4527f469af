"""Chunked prefill: a step is the running decodes plus prompt chunks within `max_num_batched_tokens`.

A prompt longer than what is left of the budget is prefilled over several steps and sampled only after
its last chunk; tokens, logprobs and prompt logprobs equal one whole prefill (fp32, tiny preset), in the
single-process engine and through the p2p and async connectors.
"""

from __future__ import annotations

import math

import pytest
from helpers.e2e import MODEL
from helpers.engine_runs import assert_same, engine_of, tokens, whole

from afd.cli.args import run_spec
from afd.cli.main import build_parser
from afd.engine.engine import Request
from afd.engine.sampling import SamplingParams

PROMPTS = [tokens(37, 1), [7, 3], tokens(20, 2), [9]]


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
