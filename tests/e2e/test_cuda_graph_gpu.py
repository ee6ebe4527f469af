"""The GPU half of tests/unit/test_cuda_graph.py: bf16 and real model shapes on CUDA, graphs and host syncs."""

from __future__ import annotations

import random

import pytest
import torch

from afd.buckets import batch_buckets
from afd.engine.engine import Engine, LocalExchange, Request
from afd.engine.graphs.decode import DecodeGraphRunner
from afd.model.weights import load_attention_model, load_ffn_model

BLOCK = 4


@pytest.fixture(scope="module")
def tiny():
    return load_attention_model("tiny"), load_ffn_model("tiny")


# --- on the device -----------------------------------------------------------------------------------


def _gpu_run(models, prompts, *, mode: str, max_new_tokens: int = 8):
    """mode: "eager" (enforce_eager), "padded" (the graph layout run eagerly), "graph" (replayed)."""
    attn, ffn = models
    engine = Engine(
        attn,
        LocalExchange(ffn),
        4096,
        block_size=BLOCK,
        max_num_seqs=256,
        num_blocks=2048,
        enforce_eager=mode != "graph",
    )
    assert (engine.cuda_graphs is None) == (mode != "graph")
    if mode == "padded":
        engine.cuda_graphs = DecodeGraphRunner(attn, engine.exchange, engine.kv_cache, 256, capture=False)
    for p in prompts:
        engine.add(Request(list(p), max_new_tokens))
    return engine, engine.run()


def _max_diff(got, want) -> float:
    return max(abs(a - b) for g, w in zip(got, want, strict=True) for a, b in zip(g.logprobs, w.logprobs, strict=True))


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_replay_equals_eager_for_every_bucket_bf16() -> None:
    """For every batch bucket (padded and full), prompts of 1-14 tokens decoding across block boundaries of 4:
    the replayed graphs give the tokens of the same padded step run eagerly, logprobs within 1e-3 (bf16), and
    the tokens of the plain eager engine (whose lone decode takes the expanded, not the absorbed, attention)."""
    models = (
        load_attention_model("tiny", dtype="bfloat16", device="cuda"),
        load_ffn_model("tiny", dtype="bfloat16", device="cuda"),
    )
    rng = random.Random(0)
    worst = {}
    for bucket in batch_buckets(256):
        for size in sorted({bucket, bucket // 2 + 1}):
            prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 14))] for _ in range(size)]
            _, eager = _gpu_run(models, prompts, mode="eager")
            _, padded = _gpu_run(models, prompts, mode="padded")
            engine, got = _gpu_run(models, prompts, mode="graph")
            assert engine.cuda_graphs.captured and not engine.cuda_graphs.disabled
            assert engine.cuda_graphs.captured == [bucket]  # one graph per bucket, every context
            for g, p, e in zip(got, padded, eager, strict=True):
                assert g.token_ids == p.token_ids == e.token_ids, (bucket, size)
                assert g.logprobs == pytest.approx(p.logprobs, abs=1e-3), (bucket, size)
            worst[size] = (_max_diff(got, padded), _max_diff(got, eager))
            assert not engine.kv_cache.cache[:, :BLOCK].any()
    print("max |dlogprob| graph vs padded eager, graph vs eager, by batch:", worst)


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_warmed_engine_captures_no_decode_graph_while_generating() -> None:
    """The warm-up (as a server runs it) captures one decode graph per batch bucket; then batches of 1 to 100
    sequences with prompts of 1-300 tokens, and a ragged batch whose contexts reach ~9,000 tokens (well past any
    warm-up bound of a context-keyed design), decode through those graphs only, and the prompt steps through the
    prefill graphs the warm-up captured (every bucket, each way its cores run): 0 captured while serving."""
    from afd.engine.warm_up import warm_up_engine

    attn = load_attention_model("tiny", dtype="bfloat16", device="cuda")
    ffn = load_ffn_model("tiny", dtype="bfloat16", device="cuda")
    engine = Engine(attn, LocalExchange(ffn), 4096, max_num_seqs=256, num_blocks=2048, max_model_len=16384)
    warm_up_engine(engine)
    runner = engine.cuda_graphs
    assert runner is not None and not runner.disabled
    assert runner.captured == runner.buckets == batch_buckets(256)
    rng = random.Random(1)
    for size in (1, 7, 100):
        for _ in range(size):
            engine.add(Request([rng.randrange(256) for _ in range(rng.randint(1, 300))], rng.randint(1, 24)))
        outputs = engine.run()
        assert len(outputs) == size and all(out.token_ids for out in outputs)
    for n in (9000, 5, 6100):  # prefilled in chunks, then decoded together: contexts 6-9,016 in one step
        engine.add(Request([rng.randrange(256) for _ in range(n)], 16))
    outputs = engine.run()
    assert len(outputs) == 3 and all(out.token_ids for out in outputs)
    assert engine.graphs_captured_while_serving == 0 and runner.captured == batch_buckets(256)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_decode_buckets_stop_at_the_token_budget() -> None:
    """A step decodes at most `max_num_batched_tokens` sequences: with a budget of 8 below `max_num_seqs` no decode
    graph is sized above 8 rows (a warmed async 1A1F rank once captured buckets its exchange window cannot hold)."""
    attn = load_attention_model("tiny", dtype="bfloat16", device="cuda")
    ffn = load_ffn_model("tiny", dtype="bfloat16", device="cuda")
    engine = Engine(attn, LocalExchange(ffn), 8, max_num_seqs=1024, block_size=BLOCK, num_blocks=64)
    assert engine.cuda_graphs is not None and engine.cuda_graphs.buckets == batch_buckets(8)
