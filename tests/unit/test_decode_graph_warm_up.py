"""Decode CUDA graphs captured at warm-up: the batch buckets up to `max_num_seqs`, the keys the warm-up captures
(pure), and on CPU (a runner that records its keys and runs the padded step eagerly instead of capturing) that the
warm-up asks for every batch bucket and that a step whose key is missing counts as captured while serving."""

from __future__ import annotations

import pytest

from afd.buckets import batch_buckets, context_bucket, context_buckets, decode_graph_keys, pick_bucket
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


@pytest.mark.parametrize("max_blocks", [1, 5, 7, 8, 9, 64, 100, 10240])
def test_context_buckets_are_every_value_context_bucket_takes(max_blocks: int) -> None:
    want = sorted({context_bucket(n, max_blocks) for n in range(1, max_blocks + 1)})
    assert context_buckets(max_blocks) == want


def test_warm_up_keys_are_every_key_a_step_within_the_context_meets_short_contexts_first() -> None:
    """Every (batch, longest context <= max_context) a cache of `num_blocks` can hold maps to a listed key; none
    listed is beyond the bound; the list is context-major."""
    bs, width, num_blocks, max_context = 4, 256, 300, 130
    buckets = batch_buckets(64)
    keys = decode_graph_keys(buckets, bs, width, max_context, num_blocks)
    assert len(keys) == len(set(keys)) and keys == sorted(keys, key=lambda k: (k[1], k[0]))
    needed = set()
    for n in range(1, 65):
        for length in range(1, max_context + 1):
            nblk = -(-length // bs)
            if nblk + n - 1 <= num_blocks:
                needed.add((pick_bucket(n, buckets), context_bucket(nblk, width) * bs))
    assert needed == set(keys)
    assert {n for n, _ in keys} == set(buckets)


def test_warm_up_keys_leave_out_batches_the_cache_cannot_hold() -> None:
    keys = decode_graph_keys([1, 2, 4, 8], 16, 64, 1024, num_blocks=6)
    assert (8, 16) not in keys and (4, 16) in keys and (4, 48) in keys and (4, 64) not in keys
    assert max(L for _, L in keys) == 6 * 16
    with pytest.raises(ValueError):
        decode_graph_keys([1], 16, 64, 0, 6)


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


@pytest.mark.timeout(120)
def test_warm_up_captures_every_batch_bucket_and_a_warmed_engine_captures_nothing_while_serving(tiny) -> None:
    engine = _engine(tiny)
    runner = engine.cuda_graphs
    captured = warm_up_decode_graphs(engine, max_context=64)
    assert captured == len(runner.captured) == len(runner.warm_up_keys(64)) > 0
    assert {n for n, _ in runner.captured} == set(runner.buckets) == {1, 2, 4, 8}
    assert runner.captured_while_serving == 0
    for prompt in ([3, 1, 4], [1, 5, 9, 2, 6, 5, 3], [2] * 20, [7]):
        engine.add(Request(prompt, 12))
    engine.run()
    assert engine.graphs_captured_while_serving == 0 and len(runner.captured) == captured
    assert warm_up_decode_graphs(engine, max_context=64) == 0  # nothing left to capture


@pytest.mark.timeout(120)
def test_a_key_the_warm_up_left_out_is_captured_in_the_step_and_counted(tiny, caplog) -> None:
    engine = _engine(tiny)
    warm_up_decode_graphs(engine, max_context=8)
    engine.add(Request([5] * 30, 3))  # contexts 31-33 tokens: past the warm-up's 8
    with caplog.at_level("INFO", logger="afd"):
        engine.run()
    assert engine.graphs_captured_while_serving == engine.cuda_graphs.captured_while_serving > 0
    assert engine.load().graphs_captured == engine.graphs_captured_while_serving  # what the replica reports
    captures = [r.getMessage() for r in caplog.records if "context rows in" in r.getMessage()]
    assert len(captures) == engine.graphs_captured_while_serving and "1 captured while serving" in captures[0]


def test_capture_keys_stops_when_the_device_has_no_room(tiny) -> None:
    engine = _engine(tiny)
    runner, calls = engine.cuda_graphs, []
    keys = runner.warm_up_keys(16)

    def room() -> bool:
        calls.append(1)
        return len(calls) <= 3

    assert runner.capture_keys(keys, room) == 3 and runner.captured == sorted(keys[:3])
    assert runner.captured_while_serving == 0


@pytest.mark.timeout(120)
def test_the_engine_warm_up_captures_the_decode_graphs(tiny) -> None:
    from afd.engine.warm_up import DECODE_WARM_UP_CONTEXT, warm_up_engine

    engine = _engine(tiny, max_num_seqs=16)  # the warm-up's steps batch 16 sequences
    warm_up_engine(engine, force=True)
    runner = engine.cuda_graphs
    assert runner.captured == sorted(runner.warm_up_keys(DECODE_WARM_UP_CONTEXT)) and runner.captured_while_serving == 0
