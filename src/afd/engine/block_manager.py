"""Which sequences hold which part of the paged latent pool: reservations by sequence, check-then-act.

The pool's tensors and its block tables live in the model layer (`afd.model.kv_cache.PagedLatentCache`, whose
`prepare` needs every slot's blocks); here is what the scheduler asks of it, in whole sequences: may this one be
admitted (`can_allocate`), admit it (`allocate`), give its blocks back (`free`). A sequence reserves the blocks of
everything it will ever cache at admission, so a running sequence never needs more and nothing is preempted.
Also here: how many blocks the pool gets (`size_cache`), fixed once when an engine is built.
"""

from __future__ import annotations

import torch

from afd.engine.sequence import SequenceState
from afd.model.config import ModelConfig
from afd.model.kv_cache import (
    PagedLatentCache,
    blocks_needed,
    device_memory,
    latent_bytes_per_token,
    num_cache_blocks,
)


def size_cache(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    *,
    num_blocks: int | None,
    block_size: int,
    max_num_seqs: int,
    max_model_len: int,
    max_cache_tokens: int | None,
    gpu_memory_utilization: float,
    activation_bytes: int,
) -> PagedLatentCache:
    """The pool: `num_blocks` if given, else `max_cache_tokens` tokens, else on CUDA `gpu_memory_utilization` of
    the GPU's memory less the weights and `activation_bytes`, else (CPU) a 4 GiB budget; never more than
    `max_num_seqs` sequences of `max_model_len` tokens could use."""
    if num_blocks is None:
        cuda = device.type == "cuda"
        num_blocks = num_cache_blocks(
            block_size=block_size,
            bytes_per_token=latent_bytes_per_token(config, dtype),
            max_useful_tokens=max_num_seqs * max_model_len,
            max_cache_tokens=max_cache_tokens,
            memory=device_memory(device) if cuda and max_cache_tokens is None else None,
            gpu_memory_utilization=gpu_memory_utilization,
            activation_bytes=activation_bytes if cuda else 0,
        )
    return PagedLatentCache(
        config,
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        dtype=dtype,
        device=device,
        max_blocks_per_seq=blocks_needed(max_model_len, block_size),
    )


class BlockManager:
    """Sequence-level reservations over one `PagedLatentCache`: a sequence's slot and blocks, its capacity."""

    def __init__(self, kv_cache: PagedLatentCache) -> None:
        self.kv_cache = kv_cache
        self.cache_tokens_used = 0  # tokens reserved by the sequences holding blocks (their capacities)

    @property
    def num_free_blocks(self) -> int:
        return self.kv_cache.pool.num_free

    @property
    def usage(self) -> float:
        """The share of blocks in use, 0..1."""
        pool = self.kv_cache.pool
        return 1.0 - pool.num_free / pool.num_blocks

    def blocks_for(self, seq: SequenceState) -> int:
        """Blocks the whole sequence reserves (`SequenceState.capacity` rows)."""
        return self.kv_cache.blocks_for(seq.capacity)

    def check_fits(self, seq: SequenceState) -> None:
        """Raise when the sequence needs more blocks than the whole pool holds: it could never be admitted."""
        cache, tokens = self.kv_cache, seq.capacity
        if cache.blocks_for(tokens) > cache.num_blocks:
            request = seq.request
            raise ValueError(
                f"a request of {len(request.prompt_ids)} prompt tokens and {request.max_new_tokens} new tokens "
                f"needs {cache.blocks_for(tokens)} KV-cache blocks of {cache.block_size} tokens ({tokens} tokens) "
                f"but the whole cache holds {cache.num_blocks} blocks ({cache.num_tokens} tokens); shorten it, "
                "lower max_new_tokens or give the cache more memory"
            )

    def can_allocate(self, seq: SequenceState) -> bool:
        """Whether `allocate(seq)` would succeed now (a free slot and the blocks of its capacity)."""
        return self.kv_cache.can_allocate(seq.capacity)

    def allocate(self, seq: SequenceState) -> None:
        """Reserve the sequence's blocks; sets `seq.slot`."""
        seq.slot = self.kv_cache.allocate(seq.capacity)
        self.cache_tokens_used += seq.capacity

    def free(self, seq: SequenceState) -> None:
        """Give the sequence's blocks and slot back."""
        self.kv_cache.free(seq.slot)
        self.cache_tokens_used -= seq.capacity
