"""Decode CUDA graphs (afd.engine.graphs.decode): bucket choice and padding layout (pure, CPU), the padded batched
decode step equal to the unpadded one (CPU, fp32, graphs replaced by an eager run of the padded batch), one bucket
serving every context, and a widened block table dropping the graphs bound to the old one."""

from __future__ import annotations

import pytest
import torch
from helpers.graph_fakes import RealRowsOnly

from afd.buckets import batch_buckets, pick_bucket
from afd.engine.engine import Engine, LocalExchange, Request
from afd.engine.graphs.decode import DecodeGraphRunner, StaticInputs, fill_static_inputs
from afd.model.weights import load_attention_model, load_ffn_model

BLOCK = 4
# Lengths around multiples of the block size, and a one-token prompt.
PROMPTS = [[3, 1, 4], [1, 5, 9, 2], [6, 5, 3, 5, 8], [9, 7, 9, 3, 2, 3, 8], [4, 6, 2, 6, 4, 3, 3, 8], [2] * 9, [7]]


def test_batch_buckets_are_capped_by_max_num_seqs() -> None:
    assert batch_buckets(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(1000)[-9:] == [256, 320, 384, 448, 512, 640, 768, 896, 1000]  # quarter octaves
    with pytest.raises(ValueError, match="at least 1"):
        batch_buckets(0)


def test_pick_bucket_is_the_smallest_that_fits() -> None:
    buckets = batch_buckets(48)
    assert [pick_bucket(n, buckets) for n in (1, 2, 3, 5, 8, 9, 33, 48)] == [1, 2, 4, 8, 8, 16, 48, 48]
    assert pick_bucket(49, buckets) is None and pick_bucket(0, buckets) is None


def test_fill_static_inputs_pads_rows_onto_scratch_and_the_null_block() -> None:
    n, W, scratch = 4, 6, 99
    static = StaticInputs(
        input_ids=torch.full((n,), 7),
        positions=torch.full((n,), 7),
        slot_mapping=torch.full((n,), 7),
        token_rows=torch.arange(n),
        tables=torch.full((n, W), 7),
        lens=torch.full((n,), 7, dtype=torch.int32),
    )
    tables = torch.tensor([[4, 5, 6], [8, 0, 0]])
    lens = torch.tensor([10, 2], dtype=torch.int32)
    fill_static_inputs(
        static, torch.tensor([5, 6]), torch.tensor([9, 1]), torch.tensor([26, 33]), tables, lens, scratch_row=scratch
    )
    assert static.input_ids.tolist() == [5, 6, 0, 0] and static.positions.tolist() == [9, 1, 0, 0]
    assert static.slot_mapping.tolist() == [26, 33, scratch, scratch]  # padding never writes a real row
    # real rows: their table prefix (entries past a length stay stale: nothing reads them); padding rows: a
    # length-1 context on the null block, whose zero row gives a finite, all-zero attention
    assert static.tables[:2, :3].tolist() == tables.tolist() and static.tables[2:, 0].tolist() == [0, 0]
    assert static.lens.tolist() == [10, 2, 1, 1] and static.lens.dtype == torch.int32
    batch = static.batch([9, 1])
    assert batch.decode_tables is static.tables and batch.decode_lens is static.lens and batch.batch_decodes
    assert batch.context_lens == [9, 1, 0, 0] and static.batch().context_lens == [0] * n
    with pytest.raises(ValueError, match="does not fit"):
        fill_static_inputs(static, *(torch.zeros(5, dtype=torch.long),) * 3, torch.zeros(5, 2).long(),
                           torch.ones(5, dtype=torch.int32), scratch_row=scratch)  # fmt: skip
    with pytest.raises(ValueError, match="does not fit"):  # wider than the static tables
        fill_static_inputs(static, *(torch.zeros(1, dtype=torch.long),) * 3, torch.zeros(1, W + 1).long(),
                           torch.ones(1, dtype=torch.int32), scratch_row=scratch)  # fmt: skip


@pytest.fixture(scope="module")
def tiny():
    return load_attention_model("tiny"), load_ffn_model("tiny")


def _run(models, prompts, max_new_tokens, *, padded: bool, max_num_seqs: int = 8, budget: int = 64):
    attn, ffn = models
    engine = Engine(attn, LocalExchange(ffn), budget, block_size=BLOCK, max_num_seqs=max_num_seqs)
    assert engine.cuda_graphs is None  # CPU never captures
    if padded:  # the graph runner's padded layout, run eagerly: what a replay computes, checked on CPU
        engine.cuda_graphs = DecodeGraphRunner(attn, engine.exchange, engine.kv_cache, max_num_seqs, capture=False)
    for p in prompts:
        engine.add(Request(list(p), max_new_tokens))
    return engine, engine.run()


@pytest.mark.timeout(120)
def test_padded_decode_steps_equal_unpadded_ones_across_block_boundaries(tiny) -> None:
    """Batches of 7 and of 1 decodes padded to buckets 8 and 1 (static tables as wide as the cache's), crossing
    1-3 block boundaries: same tokens, logprobs within 1e-5 (fp32), and the null block stays zero."""
    _, want = _run(tiny, PROMPTS, 9, padded=False)
    engine, got = _run(tiny, PROMPTS, 9, padded=True)
    assert engine.cuda_graphs.captured == [8]  # every decode step went through the runner
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-5)
    assert not engine.kv_cache.cache[:, :BLOCK].any()  # padding wrote only the scratch row
    _, want1 = _run(tiny, PROMPTS[3:4], 9, padded=False)
    engine1, got1 = _run(tiny, PROMPTS[3:4], 9, padded=True)
    assert engine1.cuda_graphs.captured == [1]
    assert got1[0].token_ids == want1[0].token_ids
    assert got1[0].logprobs == pytest.approx(want1[0].logprobs, abs=1e-5)


@pytest.mark.timeout(180)
def test_one_bucket_serves_ragged_and_very_different_contexts(tiny) -> None:
    """One graph per batch bucket, whatever the contexts: three sequences of 3, 300 and 41 prompt tokens decode
    together (padded to bucket 4, contexts ragged from 4 to ~310 in every step), then three of 2-4 tokens, through
    the one bucket captured once: the plain eager engine's tokens, logprobs within 1e-5 (fp32)."""
    attn, ffn = tiny
    rng = torch.Generator().manual_seed(3)
    runs = [[torch.randint(0, 256, (n,), generator=rng).tolist() for n in (3, 300, 41)], [[5, 9, 2], [8, 1], [3, 3, 7]]]
    # a budget that prefills every prompt in one step: the steps after it are all decodes of the three
    wants = [_run(tiny, prompts, 10, padded=False, max_num_seqs=4, budget=512)[1] for prompts in runs]
    engine = Engine(attn, LocalExchange(ffn), 512, block_size=BLOCK, max_num_seqs=4)
    engine.cuda_graphs = DecodeGraphRunner(attn, engine.exchange, engine.kv_cache, 4, capture=False)
    for prompts, want in zip(runs, wants, strict=True):
        for p in prompts:
            engine.add(Request(list(p), 10))
        got = engine.run()
        for g, w in zip(got, want, strict=True):
            assert g.token_ids == w.token_ids
            assert g.logprobs == pytest.approx(w.logprobs, abs=1e-5)
    assert engine.cuda_graphs.captured == [4] and engine.cuda_graphs.captured_while_serving == 1


def test_a_widened_block_table_drops_the_graphs_bound_to_the_old_one(tiny) -> None:
    """The cache widens its tables for a sequence longer than any before: the runner drops its graphs (they read
    the old static tables) and captures again on use, counted while serving."""
    attn, ffn = tiny
    engine = Engine(attn, LocalExchange(ffn), 64, block_size=BLOCK, max_num_seqs=4)
    runner = DecodeGraphRunner(attn, engine.exchange, engine.kv_cache, 4, capture=False)
    width = engine.kv_cache.block_tables.shape[1]
    assert runner.tables.shape == (4, width)
    runner.capture_for(3)
    assert runner.captured == [4] and runner.captured_while_serving == 0
    engine.kv_cache.block_tables = torch.zeros(4, width + 5, dtype=torch.long)  # what `prepare` does on a widening
    runner.capture_for(1)
    assert runner.captured == [1] and runner.tables.shape == (4, width + 5)


@pytest.mark.timeout(120)
def test_segmented_padded_steps_send_only_real_rows_and_equal_unpadded_ones(tiny) -> None:
    """The piecewise layout of disaggregated ranks (graphs between exchanges), run eagerly on CPU: a batch of
    7 decodes padded to bucket 8 hands the exchange exactly 7 rows at every boundary layer (what p2p's
    begin_step announced) and gives the unpadded engine's tokens and logprobs (1e-5, fp32)."""
    attn, ffn = tiny
    _, want = _run(tiny, PROMPTS, 9, padded=False)
    exchange = RealRowsOnly(LocalExchange(ffn))
    engine = Engine(attn, exchange, 64, block_size=BLOCK, max_num_seqs=8)
    engine.cuda_graphs = DecodeGraphRunner(attn, exchange, engine.kv_cache, 8, capture=False, segmented=True)
    for p in PROMPTS:
        engine.add(Request(list(p), 9))
    got = engine.run()
    assert engine.cuda_graphs.captured == [8]
    assert 8 not in exchange.rows_seen and exchange.rows_seen.count(7) >= len(attn.boundary_layers)
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-5)


def test_prefill_and_mixed_steps_do_not_take_the_graph() -> None:
    runner = DecodeGraphRunner.__new__(DecodeGraphRunner)
    runner.buckets, runner.disabled = batch_buckets(8), False
    assert runner.handles([1, 1, 1], [4, 9, 2])
    assert not runner.handles([1, 5], [4, 0])  # a prompt in the step
    assert not runner.handles([1], [0])  # a one-token prompt has no cached context
    assert not runner.handles([1] * 9, [3] * 9)  # beyond the largest bucket
    assert not runner.handles([], [])
