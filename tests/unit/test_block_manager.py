"""`BlockManager` on its own: sequence reservations over a small CPU pool, check-then-act, and cache sizing."""

from __future__ import annotations

import pytest
import torch

from afd.engine.block_manager import BlockManager, size_cache
from afd.engine.request import Request
from afd.engine.sequence import SequenceState
from afd.model.kv_cache import PagedLatentCache
from afd.model.weights import load_model_config

BLOCK = 4


def manager(num_blocks: int = 6, max_num_seqs: int = 4) -> BlockManager:
    config = load_model_config("tiny")
    cache = PagedLatentCache(
        config, num_blocks=num_blocks, block_size=BLOCK, max_num_seqs=max_num_seqs, dtype=torch.float32, device="cpu"
    )
    return BlockManager(cache)


def seq(request_id: int, prompt_len: int, max_new_tokens: int) -> SequenceState:
    return SequenceState(request_id, Request(list(range(1, prompt_len + 1)), max_new_tokens))


def test_allocate_and_free_count_blocks_of_whole_capacities() -> None:
    bm = manager(num_blocks=6)
    a, b, c = seq(0, 5, 4), seq(1, 10, 4), seq(2, 2, 1)  # capacities 8, 13, 2 -> 2, 4, 1 blocks
    assert [bm.blocks_for(s) for s in (a, b, c)] == [2, 4, 1]
    assert bm.can_allocate(a)
    bm.allocate(a)
    assert a.slot >= 0 and bm.num_free_blocks == 4 and bm.cache_tokens_used == 8
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.slot not in (-1, a.slot) and bm.num_free_blocks == 0 and bm.cache_tokens_used == 21
    assert bm.usage == 1.0
    assert not bm.can_allocate(c)  # check-then-act: no block left
    bm.free(a)
    assert bm.num_free_blocks == 2 and bm.cache_tokens_used == 13
    assert bm.usage == pytest.approx(1 - 2 / 6)
    assert bm.can_allocate(c)
    bm.allocate(c)
    bm.free(b)
    bm.free(c)
    assert bm.num_free_blocks == 6 and bm.cache_tokens_used == 0 and bm.kv_cache.num_sequences == 0


def test_a_free_slot_is_needed_as_well_as_blocks() -> None:
    bm = manager(num_blocks=6, max_num_seqs=1)
    a, b = seq(0, 1, 1), seq(1, 1, 1)
    bm.allocate(a)
    assert bm.num_free_blocks == 5 and not bm.can_allocate(b)  # blocks are free, the only slot is not
    bm.free(a)
    assert bm.can_allocate(b)


def test_a_sequence_larger_than_the_pool_is_refused_with_the_numbers() -> None:
    bm = manager(num_blocks=6)
    bm.check_fits(seq(0, 20, 5))  # 24 rows = 6 blocks: fits exactly
    with pytest.raises(ValueError, match=r"needs 7 KV-cache blocks of 4 tokens \(25 tokens\).*holds 6 blocks"):
        bm.check_fits(seq(0, 21, 5))


def test_size_cache_takes_the_given_size_else_the_token_budget_else_what_can_be_used() -> None:
    config = load_model_config("tiny")
    common = dict(block_size=BLOCK, gpu_memory_utilization=0.9, activation_bytes=10**12)
    cpu = torch.device("cpu")

    def blocks(**kwargs) -> int:
        return size_cache(config, torch.float32, cpu, **(common | kwargs)).num_blocks

    assert blocks(num_blocks=7, max_num_seqs=2, max_model_len=64, max_cache_tokens=None) == 7
    assert blocks(num_blocks=None, max_num_seqs=2, max_model_len=64, max_cache_tokens=30) == 30 // BLOCK
    # a CPU byte budget never turns into more than max_num_seqs x max_model_len tokens (activations ignored on CPU)
    assert blocks(num_blocks=None, max_num_seqs=2, max_model_len=10, max_cache_tokens=None) == -(-20 // BLOCK)
    cache = size_cache(
        config, torch.float32, cpu, num_blocks=50, max_num_seqs=3, max_model_len=10, max_cache_tokens=None, **common
    )
    assert cache.max_num_seqs == 3 and cache.block_tables.shape == (3, -(-10 // BLOCK))
