"""Decode CUDA graphs captured at warm-up: the batch buckets up to `max_num_seqs` (one graph each, whatever the
context), and on CPU (a runner that records its buckets and runs the padded step eagerly instead of capturing) that
the warm-up asks for exactly the batch buckets, that a warmed engine captures nothing while serving at any context,
and that a step whose bucket is missing counts as captured while serving."""

from __future__ import annotations

import pytest

from afd.buckets import batch_buckets, pick_bucket
from afd.engine.engine import Engine, LocalExchange, Request
from afd.engine.graphs.decode import DecodeGraphRunner
from afd.engine.warm_up import warm_up_decode_graphs
from afd.model.weights import load_attention_model, load_ffn_model


@pytest.mark.parametrize("max_num_seqs", [1, 7, 256, 1024, 1000, 3000])
def test_batch_buckets_reach_max_num_seqs_and_cover_every_batch(max_num_seqs: int) -> None:
    buckets = batch_buckets(max_num_seqs)
    assert buckets[-1] == max_num_seqs and buckets == sorted(set(buckets)) and buckets[0] == 1
    for b in range(1, max_num_seqs + 1):
        bucket = pick_bucket(b, buckets)
        assert bucket is not None and b <= bucket <= max(b * 2 - 1, 1) and (b <= 256 or bucket <= b * 1.25)


def test_batch_bucket_lists() -> None:
    assert batch_buckets(1) == [1]
    assert batch_buckets(7) == [1, 2, 4, 7]
    assert batch_buckets(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert batch_buckets(1024) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 320, 384, 448, 512, 640, 768, 896, 1024]


# --- the runner and the warm-up on CPU ------------------------------------------------------------------------------

BLOCK = 4


@pytest.fixture(scope="module")
def tiny():
    return load_attention_model("tiny"), load_ffn_model("tiny")


def _engine(models, max_num_seqs: int = 8) -> Engine:
    attn, ffn = models
    engine = Engine(attn, LocalExchange(ffn), 64, block_size=BLOCK, max_num_seqs=max_num_seqs, num_blocks=256)
    assert engine.cuda_graphs is None and engine.graphs_captured_while_serving == 0  # CPU never captures
    # the graph layout run eagerly: the runner records each key it "captures"
    engine.cuda_graphs = DecodeGraphRunner(attn, engine.exchange, engine.kv_cache, max_num_seqs, capture=False)
    return engine


@pytest.mark.timeout(180)
def test_warm_up_captures_exactly_the_batch_buckets_and_a_warmed_engine_captures_nothing_while_serving(tiny) -> None:
    """One graph per bucket: prompts of 1 to 300 tokens (contexts far past any bucket of old) replay them all."""
    engine = _engine(tiny)
    runner = engine.cuda_graphs
    assert runner.warm_up_keys() == runner.buckets == [1, 2, 4, 8]
    captured = warm_up_decode_graphs(engine)
    assert captured == 4 and runner.captured == [1, 2, 4, 8] and runner.captured_while_serving == 0
    for prompt in ([3, 1, 4], [1, 5, 9, 2, 6, 5, 3], [2] * 20, [7], [4] * 300, [9] * 120):
        engine.add(Request(prompt, 12))
    engine.run()
    assert engine.graphs_captured_while_serving == 0 and runner.captured == [1, 2, 4, 8]
    assert warm_up_decode_graphs(engine) == 0  # nothing left to capture


def test_warm_up_leaves_out_buckets_the_cache_cannot_fill(tiny) -> None:
    """A bucket no batch can reach (its smallest batch needs more blocks than the cache has) is not captured."""
    attn, ffn = tiny
    engine = Engine(attn, LocalExchange(ffn), 64, block_size=BLOCK, max_num_seqs=8, num_blocks=3)
    runner = DecodeGraphRunner(attn, engine.exchange, engine.kv_cache, 8, capture=False)
    assert runner.warm_up_keys() == [1, 2, 4]  # 3 sequences fill the 3 blocks: bucket 8 serves 5 or more


@pytest.mark.timeout(120)
def test_a_bucket_the_warm_up_left_out_is_captured_in_the_step_and_counted(tiny, caplog) -> None:
    engine = _engine(tiny)
    runner = engine.cuda_graphs
    assert runner.capture_keys([2, 4, 8]) == 3  # bucket 1 left out
    engine.add(Request([5] * 30, 3))  # one sequence: bucket 1
    with caplog.at_level("INFO", logger="afd"):
        engine.run()
    assert engine.graphs_captured_while_serving == runner.captured_while_serving == 1
    assert engine.load().graphs_captured == engine.graphs_captured_while_serving  # what the replica reports
    captures = [r.getMessage() for r in caplog.records if "decode CUDA graph of" in r.getMessage()]
    assert captures == [captures[0]] and "of 1 sequences" in captures[0] and "1 captured while serving" in captures[0]


def test_capture_keys_stops_when_the_device_has_no_room(tiny) -> None:
    engine = _engine(tiny)
    runner, calls = engine.cuda_graphs, []

    def room() -> bool:
        calls.append(1)
        return len(calls) <= 3

    assert runner.capture_keys(runner.warm_up_keys(), room) == 3 and runner.captured == [1, 2, 4]
    assert runner.captured_while_serving == 0


@pytest.mark.timeout(120)
def test_the_engine_warm_up_captures_the_decode_graphs(tiny) -> None:
    from afd.engine.warm_up import warm_up_engine

    engine = _engine(tiny, max_num_seqs=16)  # the warm-up's steps batch 16 sequences
    warm_up_engine(engine, force=True)
    runner = engine.cuda_graphs
    assert runner.captured == runner.buckets == [1, 2, 4, 8, 16] and runner.captured_while_serving == 0
