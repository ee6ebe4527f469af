"""Overlapped steps (`Engine(overlap_steps=True)`): launching the next decode step before reading the
tokens of the one in flight gives the same outputs as stepping one at a time (tiny preset, fp32, CPU).

Where both schedules are the same step for step (no stop token, no abort) the outputs are bit for bit equal. A
stop token or an abort while a step is in flight costs the overlapped engine one wasted row in the next step,
so the batch differs by that row and the other sequences' logprobs may move in the last bits (CPU matmuls are
not batch-invariant, ~1e-6); their tokens stay equal.
"""

from __future__ import annotations

import pytest
from helpers.overlap import Recorder, assert_same, assert_streamed, drive, tokens

from afd.engine.engine import Engine, LocalExchange, Output, Request
from afd.engine.sampling import SamplingParams
from afd.runtime.online import step_summary

TOL = 1e-5  # only where a wasted row changes the batch (module docstring)


PROMPTS = [[1, 2, 3], [4, 5], tokens(9, 1), [200], tokens(14, 2)]


@pytest.mark.timeout(60)
def test_greedy_requests_of_every_length_equal_stepping_one_at_a_time(models):
    requests = [
        Request(p, n, prompt_logprobs=i == 2) for i, (p, n) in enumerate(zip(PROMPTS, [5, 1, 9, 0, 3], strict=True))
    ]
    off, on = drive(models, False, requests), drive(models, True, requests)
    assert [len(o.token_ids) for o in off.outputs] == [5, 1, 9, 0, 3]
    assert_same(on.outputs, off.outputs)
    assert on.steps == off.steps  # the same steps, launched earlier
    assert on.engine.overlapped_steps > 0 and off.engine.overlapped_steps == 0
    assert_streamed(on)
    assert_streamed(off)


@pytest.mark.timeout(60)
def test_a_steady_decode_launches_every_step_but_the_first_ahead(models):
    """Three prompts of 8 tokens each: one prefill, then 7 decode steps; the prefill is scheduled as usual, each
    of the 7 decode steps is launched before the tokens of the step before it are read; none past the last length."""
    requests = [Request(p, 8) for p in PROMPTS[:3]]
    on = drive(models, True, requests)
    assert on.steps == [sum(map(len, PROMPTS[:3]))] + [3] * 7
    assert on.engine.overlapped_steps == 7
    assert_same(on.outputs, drive(models, False, requests).outputs)


@pytest.mark.timeout(60)
def test_stop_tokens_mid_run_finish_the_same_and_waste_one_row(models):
    reference = drive(models, False, [Request(p, 8) for p in PROMPTS]).outputs
    # stop tokens that end two requests in the middle of the run (the first token equal to them ends them)
    stops = [reference[2].token_ids[3], reference[4].token_ids[1]]
    requests = [Request(p, 8, stop_token_ids=stops) for p in PROMPTS]
    off, on = drive(models, False, requests), drive(models, True, requests)
    assert "stop" in [o.finish_reason for o in off.outputs]
    assert any(len(o.token_ids) < 8 for o in off.outputs if o.finish_reason == "stop")
    assert_same(on.outputs, off.outputs, tol=TOL)
    # the overlapped engine decoded a stopped sequence once more before it knew, and dropped that row
    assert sum(on.steps) > sum(off.steps) and len(on.steps) == len(off.steps)
    assert_streamed(on)


@pytest.mark.timeout(60)
def test_requests_arriving_while_a_step_is_in_flight(models):
    requests = [Request(p, n) for p, n in zip(PROMPTS, [9, 6, 4, 7, 5], strict=True)]
    arrive_after = [0, 2, 3, 3, 6]
    off = drive(models, False, requests, arrive_after)
    on = drive(models, True, requests, arrive_after)
    assert on.in_flight_events > 0  # requests entered while a step was in flight
    assert_same(on.outputs, off.outputs)
    assert on.steps == off.steps
    assert on.engine.overlapped_steps > 0
    assert_streamed(on)


def run_engine(models, overlap: bool, requests: list[Request], **kwargs) -> tuple[list[Output], list[int], Engine]:
    attn, ffn = models
    rec = Recorder(ffn)
    engine = Engine(attn, rec, kwargs.pop("budget", 64), overlap_steps=overlap, **kwargs)
    ids = [engine.add(r) for r in requests]
    outputs = engine.run()
    assert [o.request_id for o in outputs] == ids
    assert engine.kv_cache.pool.num_free == engine.kv_cache.num_blocks
    return outputs, rec.steps, engine


@pytest.mark.timeout(60)
def test_a_request_waiting_for_blocks_enters_when_they_free_as_without_overlap(models):
    """A pool of 6 blocks of 4 tokens: A (1 block) and B (3 blocks) run, C (3 blocks) waits until A ends by
    length; the step after A's last one admits C with overlap on too (B is not launched ahead without it)."""
    requests = [Request([1, 2], 3), Request([4, 5, 6], 10), Request(tokens(9, 5), 4)]
    off, off_steps, _ = run_engine(models, False, requests, num_blocks=6, block_size=4)
    on, on_steps, engine = run_engine(models, True, requests, num_blocks=6, block_size=4)
    assert off_steps[:4] == [5, 2, 2, 1 + 9]  # C enters right after A's last decode
    assert_same(on, off)
    assert on_steps == off_steps and engine.overlapped_steps > 0


@pytest.mark.timeout(60)
def test_prefill_heavy_traffic_launches_mixed_steps_ahead_with_the_same_steps(models):
    """Prompts longer than the budget of 16 tokens, arriving while others decode: almost every step holds a chunk
    and decodes (and admits new prompts); launched ahead, they are the same steps with the same tokens."""
    requests = [Request(tokens(18 + 7 * i, i + 1), 6) for i in range(6)]
    arrive = [0, 0, 2, 3, 5, 9]
    off = drive(models, False, requests, arrive_after=arrive, budget=16)
    on = drive(models, True, requests, arrive_after=arrive, budget=16)
    assert_same(on.outputs, off.outputs)
    assert on.steps == off.steps
    assert on.steps.count(16) >= 10  # budget-full steps: chunks beside the decodes
    assert on.engine.overlapped_steps == len(on.steps) - 1  # every step but the first launched ahead
    assert_streamed(on)


@pytest.mark.timeout(60)
def test_a_full_engine_still_launches_ahead(models):
    """max_num_seqs 2 and four requests of 5 tokens: the queue's head cannot enter while two run, so each pair's
    prefill is scheduled as usual (the second pair's once the first ended) and its 4 decode steps are launched
    ahead (4 + 4)."""
    requests = [Request(p, 5) for p in PROMPTS[:4]]
    off, off_steps, _ = run_engine(models, False, requests, max_num_seqs=2)
    on, on_steps, engine = run_engine(models, True, requests, max_num_seqs=2)
    assert_same(on, off)
    assert on_steps == off_steps and engine.overlapped_steps == 8


@pytest.mark.timeout(60)
def test_decodes_capped_by_the_budget_are_not_launched_ahead(models):
    """Four decoding sequences and a budget of two tokens: a step decodes the first two; when one of them ends
    the next step takes a third, so no step is launched ahead while a running sequence sits one out."""
    attn, ffn = models
    requests = [Request([t], n) for t, n in zip([3, 5, 7, 9], [3, 6, 4, 4], strict=True)]
    runs = []
    for overlap in (False, True):
        rec = Recorder(ffn)
        engine = Engine(attn, rec, 4, overlap_steps=overlap)
        ids = [engine.add(r) for r in requests]
        engine.step()  # the four one-token prompts in one step
        engine.max_num_batched_tokens = 2
        outputs: dict[int, Output] = {}
        while engine.has_work():
            outputs.update((o.request_id, o) for o in engine.step())
        runs.append(([outputs[i] for i in ids], rec.steps, engine.overlapped_steps))
    (off, off_steps, _), (on, on_steps, overlapped) = runs
    assert off_steps[:3] == [4, 2, 2] and 1 in off_steps
    assert_same(on, off)
    assert on_steps == off_steps and overlapped > 0


@pytest.mark.timeout(60)
def test_abort_while_a_step_is_in_flight(models):
    requests = [Request(p, 9) for p in PROMPTS[:4]]
    off = drive(models, False, requests, abort=(1, 3))
    on = drive(models, True, requests, abort=(1, 3))
    assert on.in_flight_events == 1  # the abort came while a step holding the aborted sequence was in flight
    (aborted,) = on.aborted.values()
    # what it had streamed, not the token of the step in flight (dropped when that step is finalized)
    assert aborted.finish_reason == "abort" and aborted.token_ids == on.streamed[1] and len(aborted.token_ids) == 3
    assert aborted.token_ids == off.aborted[1].token_ids and aborted.logprobs == off.aborted[1].logprobs
    assert_same(on.outputs, off.outputs, tol=TOL)
    assert [len(o.token_ids) for o in on.outputs] == [9, 3, 9, 9]
    assert_streamed(on)


@pytest.mark.timeout(60)
def test_aborting_every_sequence_of_the_step_in_flight(models):
    """The step in flight still has work (its copy to read) with nothing running; it streams nothing, and the
    blocks it was still writing serve the next request, whose output equals one run alone."""
    attn, ffn = models
    engine = Engine(attn, LocalExchange(ffn), 64, overlap_steps=True, num_blocks=4, block_size=4)
    first = engine.add(Request(tokens(6, 6), 8))
    engine.step()  # the prefill
    assert engine.step() == [] and engine.step_in_flight  # the first decode, left in flight
    aborted = engine.abort(first)
    assert aborted.finish_reason == "abort" and len(aborted.token_ids) == 1
    assert engine.has_work() and not engine.running
    assert engine.step() == [] and engine.last_step_tokens == [] and not engine.has_work()
    assert engine.kv_cache.pool.num_free == engine.kv_cache.num_blocks
    (out,) = run_engine(models, True, [Request(PROMPTS[4], 2)], num_blocks=4, block_size=4)[0]
    engine.add(Request(PROMPTS[4], 2))
    assert_same(engine.run(), [out])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("budget", [2, 5])
def test_chunked_prefill_with_a_small_budget(models, budget: int):
    """Budget 5: prompts are chunked around running decodes; budget 2: fewer than the decodes, so a decode
    step does not hold every sequence and none can be launched ahead until only two are left."""
    requests = [Request(p, 6, prompt_logprobs=True) for p in (tokens(13, 3), [7, 3], tokens(8, 4), [9])]
    off, on = drive(models, False, requests, budget=budget), drive(models, True, requests, budget=budget)
    assert max(off.steps) <= budget and len(off.steps) > 6
    assert_same(on.outputs, off.outputs)
    assert on.steps == off.steps
    assert on.engine.overlapped_steps > 0
    assert_streamed(on)
    # every step was launched ahead of its predecessor's tokens or after a step that had no successor (the last
    # one's, counted by reason); a replica's last log line says so
    not_ahead = on.engine.scheduler.not_ahead
    assert on.engine.overlapped_steps + sum(not_ahead.values()) == len(on.steps)
    assert not_ahead["nothing to run after the step"] >= 1
    line = step_summary(on.engine)
    assert line.startswith(f"steps launched ahead: {on.engine.overlapped_steps} (not ahead: ")
    assert "nothing to run after the step" in line and "device time" not in line  # CPU steps are not timed


@pytest.mark.timeout(60)
def test_seeded_sampling_draws_the_same_tokens(models):
    params = [
        SamplingParams(temperature=0.8, seed=1),
        SamplingParams(temperature=1.3, top_p=0.9, seed=2),
        SamplingParams(temperature=0.7, top_k=20, seed=3),
        SamplingParams(temperature=1.0, top_k=50, top_p=0.8, seed=4),
        None,
    ]
    requests = [Request(p, 8, sampling=s) for p, s in zip(PROMPTS, params, strict=True)]
    off, on = drive(models, False, requests, [0, 0, 2, 4, 4]), drive(models, True, requests, [0, 0, 2, 4, 4])
    greedy = drive(models, False, [Request(p, 8) for p in PROMPTS]).outputs
    assert sum(o.token_ids != g.token_ids for o, g in zip(off.outputs, greedy, strict=True)) >= 2  # it samples
    assert_same(on.outputs, off.outputs)
    assert on.engine.overlapped_steps > 0


def test_overlap_is_off_by_default_on_cpu_and_refuses_micro_batches(models):
    attn, ffn = models
    assert not Engine(attn, LocalExchange(ffn), 16).overlap_steps

    class TwoUbatches(LocalExchange):
        num_ubatches = 2

    assert not Engine(attn, TwoUbatches(ffn), 16).overlap_steps
    with pytest.raises(ValueError, match="micro-batches"):
        Engine(attn, TwoUbatches(ffn), 16, overlap_steps=True)
