"""A prepared step of a given layout over a real paged cache, for the prefill-graph tests."""

from __future__ import annotations

import random

import torch

from afd.model.batch import Batch
from afd.model.kv_cache import PagedLatentCache


def prepared_step(attn, cache: PagedLatentCache, layout: list[tuple[int, int]], seed: int):
    """Sequences of (query length, cached context) with random input ids, prepared on the cache's device:
    (batch, input ids [T], positions [T])."""
    rng = random.Random(seed)
    slots = [cache.allocate(ctx + n) for n, ctx in layout]
    batch = Batch(slots=slots, query_lens=[n for n, _ in layout], context_lens=[ctx for _, ctx in layout])
    ids = torch.tensor([rng.randrange(attn.config.vocab_size) for n, _ in layout for _ in range(n)])
    pos = torch.tensor([ctx + i for n, ctx in layout for i in range(n)])
    return (batch, *cache.prepare(batch, ids, pos))
