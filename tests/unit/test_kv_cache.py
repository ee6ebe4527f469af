"""The paged MLA latent cache: exactness across block boundaries, block reuse, waiting when the pool is
full, rejecting what can never fit, and turning a memory budget into a block count."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from afd.engine.engine import Engine, LocalExchange, Request
from afd.engine.generate import generate
from afd.model.batch import Batch
from afd.model.kv_cache import (
    BlockPool,
    DeviceMemory,
    GiB,
    PagedLatentCache,
    activation_bytes_estimate,
    context_rows,
    latent_bytes_per_token,
    num_cache_blocks,
)
from afd.model.weights import load_attention_model, load_ffn_model, load_model_config

BLOCK = 4
# Lengths around multiples of the block size: one short of, exactly at and one past a block boundary.
PROMPTS = [[3, 1, 4], [1, 5, 9, 2], [6, 5, 3, 5, 8], [9, 7, 9, 3, 2, 3, 8], [4, 6, 2, 6, 4, 3, 3, 8], [2] * 9, [7]]


@pytest.fixture(scope="module")
def models():
    return load_attention_model("tiny"), load_ffn_model("tiny")


def _run(models, prompts, max_new_tokens, **engine_args):
    attn, ffn = models
    engine = Engine(attn, LocalExchange(ffn), engine_args.pop("max_num_batched_tokens", 64), **engine_args)
    for p in prompts:
        engine.add(Request(list(p), max_new_tokens, prompt_logprobs=True))
    return engine, engine.run()


def _assert_same(got, want, tol=1e-5):
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        assert g.logprobs == pytest.approx(w.logprobs, abs=tol)
        assert g.prompt_logprobs[1:] == pytest.approx(w.prompt_logprobs[1:], abs=tol)


@pytest.mark.timeout(60)
def test_decode_across_block_boundaries_equals_recompute(models):
    """Every decode step reads its context through the block table, across 1-3 block boundaries: the
    logprobs equal one prefill of prompt + continuation with no cache at all."""
    _, outs = _run(models, PROMPTS, 7, block_size=BLOCK)
    for out in outs:
        (full,) = generate("tiny", [out.prompt_ids + out.token_ids], max_new_tokens=0, prompt_logprobs=True)
        assert full.prompt_logprobs[len(out.prompt_ids) :] == pytest.approx(out.logprobs, abs=1e-5)
        assert full.prompt_logprobs[1 : len(out.prompt_ids)] == pytest.approx(out.prompt_logprobs[1:], abs=1e-5)


@pytest.mark.timeout(60)
def test_block_size_does_not_change_results(models):
    """Blocks of 1, 4 and 16 tokens (scattered, boundary-aligned or one block per sequence) give the
    same bits: the paged gather returns the same values a contiguous cache held, padding zeros included."""
    want = _run(models, PROMPTS, 6, block_size=16)[1]
    for block_size in (1, BLOCK):
        got = _run(models, PROMPTS, 6, block_size=block_size)[1]
        assert [o.to_json() for o in got] == [o.to_json() for o in want]


@pytest.mark.timeout(60)
def test_padding_reads_zeros_not_stale_rows(models):
    """The batched decode pads short contexts; padding must come from the zero (null) block, never from
    whatever an unused or freed row holds (NaN here: `0 * NaN` would poison the output)."""
    want = _run(models, PROMPTS, 5, block_size=BLOCK)[1]
    attn, ffn = models
    engine = Engine(attn, LocalExchange(ffn), 64, block_size=BLOCK, num_blocks=64)
    engine.kv_cache.cache[:, BLOCK:] = float("nan")  # every row but the null block's
    for p in PROMPTS:
        engine.add(Request(list(p), 5, prompt_logprobs=True))
    got = engine.run()
    assert all(math.isfinite(v) for o in got for v in o.logprobs)
    _assert_same(got, want, tol=0)


@pytest.mark.timeout(60)
def test_many_sequences_reuse_freed_blocks(models):
    """A pool of 6 blocks serves 12 requests needing 27 blocks in all: blocks are freed and handed out
    again (not in order), every output equals running its request alone, and the pool ends empty."""
    prompts = [[(7 * i + j) % 250 + 1 for j in range(1 + (5 * i) % 9)] for i in range(12)]
    max_new = [1 + (3 * i) % 7 for i in range(12)]
    alone = []
    for p, m in zip(prompts, max_new, strict=True):
        alone.append(_run(models, [p], m, block_size=BLOCK)[1][0])
    attn, ffn = models
    engine = Engine(attn, LocalExchange(ffn), 16, block_size=BLOCK, num_blocks=6, max_num_seqs=4)
    handed_out = []
    allocate = engine.kv_cache.pool.allocate

    def recording_allocate(n):
        blocks = allocate(n)
        handed_out.append(blocks)
        return blocks

    engine.kv_cache.pool.allocate = recording_allocate
    for p, m in zip(prompts, max_new, strict=True):
        engine.add(Request(p, m, prompt_logprobs=True))
    got = engine.run()
    assert sum(map(len, handed_out)) == 27  # the same 6 blocks served every sequence
    assert any(b != list(range(b[0], b[0] + len(b))) for b in handed_out)  # non-contiguous tables occurred
    _assert_same(got, alone)
    cache = engine.kv_cache
    assert cache.pool.num_free == cache.num_blocks == 6 and cache.num_sequences == 0
    assert engine.cache_tokens_used == 0


@pytest.mark.timeout(60)
def test_full_pool_makes_the_next_request_wait(models):
    """A pool that holds one request: the second waits in the queue (no crash, no preemption) until the
    first finishes and frees its blocks, then runs; both outputs equal running alone."""
    prompt_a, prompt_b = [5, 17, 33, 2, 9], [4, 8, 15, 16, 23, 42]
    want = [_run(models, [p], 6, block_size=BLOCK)[1][0] for p in (prompt_a, prompt_b)]
    attn, ffn = models
    # a needs 5 + 5 = 10 rows -> 3 blocks; b needs 6 + 5 = 11 -> 3 blocks; the pool holds 4.
    engine = Engine(attn, LocalExchange(ffn), 64, block_size=BLOCK, num_blocks=4)
    ids = [engine.add(Request(p, 6, prompt_logprobs=True)) for p in (prompt_a, prompt_b)]
    running, finished = [], []
    while engine.has_work():
        outs = engine.step()
        running.append([s.request_id for s in engine.running])
        finished += outs
        assert len(running) < 50
    assert max(len(r) for r in running) == 1  # never both at once
    assert running[0] == [ids[0]] and ids[1] in running[-2]
    assert [o.request_id for o in finished] == ids
    _assert_same(finished, want)


@pytest.mark.timeout(30)
def test_a_request_that_can_never_fit_is_rejected(models):
    """Needing more blocks than the whole pool is refused at add() with one sentence naming the numbers
    (before, a request over max_cache_tokens waited forever and `run()` never returned)."""
    attn, ffn = models
    engine = Engine(attn, LocalExchange(ffn), 64, block_size=BLOCK, num_blocks=3)
    with pytest.raises(ValueError) as info:
        engine.add(Request([1, 2, 3, 4, 5], 9))  # 5 + 8 = 13 rows -> 4 blocks
    msg = str(info.value)
    assert "needs 4 KV-cache blocks of 4 tokens (13 tokens)" in msg
    assert "holds 3 blocks (12 tokens)" in msg and msg.count(". ") == 0
    assert not engine.has_work()
    engine.add(Request([1, 2, 3, 4, 5], 8))  # 12 rows: fits exactly
    # The constructor's token budget (max_cache_tokens) is the pool size in whole blocks.
    engine = Engine(attn, LocalExchange(ffn), 64, max_cache_tokens=12, block_size=BLOCK)
    assert engine.kv_cache.num_tokens == 12
    with pytest.raises(ValueError, match="needs 4 KV-cache blocks"):
        engine.add(Request([1, 2, 3, 4, 5], 9))


@pytest.mark.timeout(60)
def test_block_tables_widen_for_a_sequence_longer_than_the_model_length(models):
    """Block tables start `max_model_len` wide; a longer sequence widens them and still decodes exactly."""
    want = _run(models, PROMPTS[:3], 12, block_size=BLOCK)[1]
    engine, got = _run(models, PROMPTS[:3], 12, block_size=BLOCK, max_model_len=8)
    assert engine.kv_cache.block_tables.shape[1] > 2
    _assert_same(got, want, tol=0)


@pytest.mark.timeout(30)
def test_cache_rows_follow_the_block_table():
    """Unit level: a sequence whose blocks are not contiguous writes and reads each token at
    `block * block_size + offset`; decode contexts are padded with the zero row."""
    config = load_model_config("tiny")
    cache = PagedLatentCache(config, num_blocks=8, block_size=BLOCK, max_num_seqs=4, dtype=torch.float32, device="cpu")
    first = cache.allocate(6)  # blocks 1, 2
    second = cache.allocate(3)  # block 3
    cache.free(first)
    third = cache.allocate(10)  # blocks 1, 2, 4: a hole where `second` sits
    assert cache._blocks[third] == [1, 2, 4]
    batch = Batch(slots=[third, second], query_lens=[10, 3], context_lens=[0, 0])
    cache.prepare(batch)
    assert batch.slot_mapping.tolist() == [4, 5, 6, 7, 8, 9, 10, 11, 16, 17, 12, 13, 14]
    width = config.kv_lora_rank + config.qk_rope_head_dim
    latent = torch.randn(13, width)
    for layer in range(config.num_hidden_layers):
        cache.write(layer, batch.slot_mapping, latent * (layer + 1))
    # the next step: one decode token each, batched, contexts of 11 and 4 tokens
    step = Batch(slots=[third, second], query_lens=[1, 1], context_lens=[10, 3])
    cache.prepare(step)
    assert step.decode_token_rows.tolist() == [0, 1]
    # the decode kernel's inputs: block-table rows as wide as the longest context needs, each own length
    assert step.decode_tables.tolist() == [[1, 2, 4], [3, 0, 0]] and step.decode_lens.tolist() == [11, 4]
    assert step.decode_lens.dtype == torch.int32
    step = Batch(slots=[third, second], query_lens=[1, 1], context_lens=[10, 3], batch_decodes=True)
    cache.prepare(step)  # a CUDA-graph step gets the same tables and lengths (copied into its static buffers)
    assert step.decode_tables.tolist() == [[1, 2, 4], [3, 0, 0]] and step.decode_lens.tolist() == [11, 4]
    # the eager gather's rows: each position through the table, past each length the zero row
    rows, valid = context_rows(step.decode_tables, step.decode_lens, BLOCK, 11)
    assert rows.tolist() == [[4, 5, 6, 7, 8, 9, 10, 11, 16, 17, 18], [12, 13, 14, 15] + [0] * 7]
    assert valid.sum(1).tolist() == [11, 4]
    new = torch.randn(2, width)
    cache.write(2, step.slot_mapping, new)
    got = cache.read(2, rows)  # [2, 11, width]
    torch.testing.assert_close(got[0], torch.cat([latent[:10] * 3, new[:1]]), rtol=0, atol=0)
    torch.testing.assert_close(got[1, :4], torch.cat([latent[10:] * 3, new[1:]]), rtol=0, atol=0)
    assert got[1, 4:].abs().sum() == 0
    # a sequence decoded alone reads its context through `context_rows`
    alone = Batch(slots=[third], query_lens=[1], context_lens=[11])
    cache.prepare(alone)
    assert alone.decode_tables is None and alone.context_rows[0].tolist() == [4, 5, 6, 7, 8, 9, 10, 11, 16, 17, 18, 19]
    # writing past the reserved blocks is refused
    alone = Batch(slots=[second], query_lens=[1], context_lens=[4])
    with pytest.raises(ValueError, match="reserved 4 tokens"):
        cache.prepare(alone)


@pytest.mark.timeout(30)
def test_a_chunk_after_cached_context_reads_it_through_the_block_table(models):
    """A prompt fed in two chunks (the second attends to the first through the block table, across a
    block boundary, with the causal mask) gives the hidden states of one whole prefill."""
    attn, ffn = models
    cache = PagedLatentCache(
        attn.config, num_blocks=8, block_size=BLOCK, max_num_seqs=2, dtype=torch.float32, device="cpu"
    )
    prompt = PROMPTS[5] + PROMPTS[3]  # 16 tokens
    exchange = LocalExchange(ffn)
    with torch.inference_mode():
        whole = attn(torch.tensor(prompt), torch.arange(16), Batch([0], [16], [0]), None, exchange)
        slot = cache.allocate(16)
        first = attn(torch.tensor(prompt[:7]), torch.arange(7), Batch([slot], [7], [0]), cache, exchange)
        second = Batch([slot], [9], [7])
        rest = attn(torch.tensor(prompt[7:]), torch.arange(7, 16), second, cache, exchange)
    assert second.context_rows[0].tolist() == [4 + i for i in range(16)]
    torch.testing.assert_close(torch.cat([first, rest]), whole, atol=1e-5, rtol=0)


def test_block_pool_is_check_then_act():
    pool = BlockPool(3)
    assert pool.can_allocate(3) and not pool.can_allocate(4)
    a = pool.allocate(2)
    assert a == [1, 2] and pool.num_free == 1  # block 0 is the null block, never handed out
    with pytest.raises(RuntimeError, match="2 blocks were asked for but 1 are free"):
        pool.allocate(2)
    pool.free(a)
    assert pool.allocate(3) == [1, 2, 3]


def test_sizing_turns_a_budget_into_blocks():
    v2 = load_model_config("deepseek-v2-lite")
    per_token = latent_bytes_per_token(v2, torch.bfloat16)
    assert per_token == (512 + 64) * 27 * 2
    block_bytes = 16 * per_token
    huge = 10**12
    # CPU: a plain 4 GiB budget, less the null block, never more than max_num_seqs x max_model_len can use
    assert num_cache_blocks(block_size=16, bytes_per_token=per_token, max_useful_tokens=huge) == (
        4 * GiB // block_bytes - 1
    )
    assert num_cache_blocks(block_size=16, bytes_per_token=per_token, max_useful_tokens=100) == 7
    # an explicit token budget: whole blocks, rounded down
    assert num_cache_blocks(block_size=16, bytes_per_token=per_token, max_useful_tokens=huge, max_cache_tokens=47) == 2
    with pytest.raises(ValueError, match="less than one block of 16 tokens"):
        num_cache_blocks(block_size=16, bytes_per_token=per_token, max_useful_tokens=huge, max_cache_tokens=15)
    # CUDA: 0.9 of 140 GiB = 126 GiB, less 31 GiB of weights and 10 GiB of activations = 85 GiB
    memory = DeviceMemory(total=140 * GiB, free=105 * GiB, this_process=31 * GiB)
    gpu = dict(block_size=16, bytes_per_token=per_token, max_useful_tokens=huge, memory=memory)
    assert num_cache_blocks(**gpu, activation_bytes=10 * GiB) == 85 * GiB // block_bytes - 1
    assert num_cache_blocks(**gpu, activation_bytes=10 * GiB, gpu_memory_utilization=0.5) == (
        (70 - 31 - 10) * GiB // block_bytes - 1
    )
    # ... but never more than is free now (another process holds part of the GPU)
    shared = DeviceMemory(total=140 * GiB, free=50 * GiB, this_process=31 * GiB)
    assert num_cache_blocks(**{**gpu, "memory": shared}, activation_bytes=10 * GiB) == 40 * GiB // block_bytes - 1
    with pytest.raises(ValueError, match="no GPU memory is left for the KV cache: 0.2 of 140.0 GiB"):
        num_cache_blocks(**gpu, activation_bytes=10 * GiB, gpu_memory_utilization=0.2)
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        num_cache_blocks(**gpu, gpu_memory_utilization=1.5)
    # the activation estimate grows with the step's tokens and covers at least the fp32 logits
    act = activation_bytes_estimate(v2, torch.bfloat16, 8192)
    assert act == 2 * activation_bytes_estimate(v2, torch.bfloat16, 4096)
    assert act > 8192 * v2.vocab_size * 4 * 2


@pytest.mark.timeout(30)
def test_engine_logs_its_pool(models, caplog):
    """CPU default: enough for max_num_seqs sequences of the model's length, within 4 GiB; logged at INFO."""
    attn, ffn = models
    with caplog.at_level(logging.INFO, logger="afd.engine.engine"):
        engine = Engine(attn, LocalExchange(ffn), 64, max_num_seqs=2, block_size=16)
    cache = engine.kv_cache
    assert cache.num_tokens == 2 * attn.config.max_position_embeddings
    assert f"KV cache: {cache.num_blocks} blocks x 16 tokens = {cache.num_tokens} tokens, " in caplog.text
    assert caplog.text.rstrip().endswith("GiB")
