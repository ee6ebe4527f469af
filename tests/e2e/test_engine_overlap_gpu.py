"""The GPU half of tests/unit/test_engine_overlap.py: bf16 and real model shapes on CUDA, graphs and host syncs."""

from __future__ import annotations

import random

import pytest
import torch
from helpers.overlap import assert_same, assert_streamed, drive, tokens

from afd.engine.engine import Engine, LocalExchange, Request
from afd.engine.sampling import SamplingParams
from afd.model.weights import load_attention_model, load_ffn_model

# --- on the device -----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_overlap_with_graphs_equals_stepping_one_at_a_time_bf16():
    """On by default with CUDA graphs; the same steps replay the same graphs, with the input ids of a step launched
    ahead gathered on the device instead of copied from the host: the same tokens, and logprobs within 1e-3 (the
    same bits unless a kernel is not deterministic between two engines' captures; the largest gap is printed).
    Greedy and seeded requests of different lengths, arrivals while a step is in flight, several graph buckets."""
    models = (
        load_attention_model("tiny", dtype="bfloat16", device="cuda"),
        load_ffn_model("tiny", dtype="bfloat16", device="cuda"),
    )
    rng = random.Random(0)
    requests = [
        Request(
            tokens(rng.randint(1, 14), i),
            rng.randint(2, 12),
            sampling=SamplingParams(0.9, 0.95, 40, i) if i % 3 else None,
        )
        for i in range(11)
    ]
    arrive_after = sorted(rng.randrange(12) for _ in requests)
    attn, ffn = models
    assert Engine(attn, LocalExchange(ffn), 64).overlap_steps  # the default on CUDA
    off = drive(models, False, requests, arrive_after)
    on = drive(models, True, requests, arrive_after)
    assert on.engine.cuda_graphs is not None and on.engine.cuda_graphs.captured and not on.engine.cuda_graphs.disabled
    assert on.engine.overlapped_steps > 0 and on.in_flight_events > 0
    assert on.steps == off.steps
    assert_same(on.outputs, off.outputs, tol=1e-3)
    assert_streamed(on)
    pairs = [
        (a, b)
        for g, w in zip(on.outputs, off.outputs, strict=True)
        for a, b in zip(g.logprobs, w.logprobs, strict=True)
    ]
    gap = max(abs(a - b) for a, b in pairs)
    print(f"overlap on vs off, bf16 with graphs: largest |dlogprob| {gap:.3g}")


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_step_clock_times_every_launched_step_within_the_wall_time():
    """`StepClock`: every launched step (prefill chunks that sample nothing included) is counted once the run ends,
    and their device time is positive and no more than the run's wall time (steps never overlap on the stream)."""
    import time

    attn = load_attention_model("tiny", dtype="bfloat16", device="cuda")
    engine = Engine(attn, LocalExchange(load_ffn_model("tiny", dtype="bfloat16", device="cuda")), 8, max_num_seqs=4)
    launched = 0
    launch = engine.runner.launch

    def counting(*args, **kwargs):
        nonlocal launched
        launched += 1
        return launch(*args, **kwargs)

    engine.runner.launch = counting
    for i in range(5):
        engine.add(Request(tokens(3 + 5 * i, i), 6))  # prompts over the 8-token budget: chunks that sample nothing
    torch.cuda.synchronize()
    start = time.perf_counter()
    engine.run()
    wall = time.perf_counter() - start
    clock = engine.runner.step_clock
    assert launched > 0 and clock.steps == launched
    assert 0 < clock.seconds <= wall
    assert 0 < clock.prompt_steps == clock.prompt_host_steps < clock.steps and clock.prompt_seconds < clock.seconds
    assert 0 <= clock.idle_ahead_seconds <= clock.idle_seconds and clock.seconds + clock.idle_seconds <= wall
    assert engine.load().steps == launched and engine.load().step_device_s == clock.seconds
