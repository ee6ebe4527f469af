"""Inputs, steps and the SDPA reference of the prefill attention kernel, shared by its CPU and GPU tests."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F  # noqa: E402

from afd.model.attention_side import MLAttention, rope_parameters  # noqa: E402
from afd.model.batch import Batch
from afd.model.kv_cache import PagedLatentCache, blocks_needed  # noqa: E402


def cu_seqlens(lens: list[int], device: torch.device | str) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)


def sdpa_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_lens: list[int], key_lens: list[int], scale: float
) -> torch.Tensor:
    """Per sequence, the model's eager SDPA with its masks: none for one query, causal for a fresh prompt,
    `tril(ctx)` for a chunk after ctx cached tokens. q [Tq, nh, D], k [Tk, nh, D], v [Tk, nh, Dv]."""
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    a = b = 0
    for n, L in zip(query_lens, key_lens, strict=True):
        ctx = L - n
        mask = None if n <= 1 or ctx == 0 else torch.ones(n, L, dtype=torch.bool, device=q.device).tril(ctx)
        if n:
            o = F.scaled_dot_product_attention(
                q[a : a + n].transpose(0, 1),
                k[b : b + L].transpose(0, 1),
                v[b : b + L].transpose(0, 1),
                attn_mask=mask,
                is_causal=n > 1 and ctx == 0,
                scale=scale,
            )
            out[a : a + n] = o.transpose(0, 1)
        a, b = a + n, b + L
    return out


def random_inputs(query_lens, context_lens, nh, dn, dr, dv, dtype, device, gen):
    """q [Tq, nh, dn + dr], k_nope [Tk, nh, dn], k_rope [Tk, dr] (shared by heads), v [Tk, nh, dv]."""
    key_lens = [n + c for n, c in zip(query_lens, context_lens, strict=True)]
    Tq, Tk = sum(query_lens), sum(key_lens)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    return key_lens, randn(Tq, nh, dn + dr), randn(Tk, nh, dn), randn(Tk, dr), randn(Tk, nh, dv)


def expand_k(k_nope: torch.Tensor, k_rope: torch.Tensor) -> torch.Tensor:
    Tk, nh, _ = k_nope.shape
    return torch.cat([k_nope, k_rope.unsqueeze(1).expand(Tk, nh, k_rope.shape[-1])], dim=-1)


def _attention_and_step(config, dtype, device, query_lens, context_lens, seed: int = 0):
    """One MLAttention layer with random weights, a paged cache whose context rows hold random latents,
    the step's batch prepared on it, and this step's q, kv_c, k_pe (written to the cache as forward does)."""
    torch.manual_seed(seed)
    _, _, scale = rope_parameters(config)
    attn = MLAttention(config, 0, scale)
    for p in attn.parameters():
        p.data.normal_(0.0, 0.5 / p.shape[-1] ** 0.5)
    attn = attn.to(device=device, dtype=dtype)
    num_blocks = sum(blocks_needed(n + ctx, 4) for n, ctx in zip(query_lens, context_lens, strict=True))
    cache = PagedLatentCache(config, num_blocks=num_blocks, block_size=4, max_num_seqs=8, dtype=dtype, device=device)
    slots = [cache.allocate(n + ctx) for n, ctx in zip(query_lens, context_lens, strict=True)]
    cache.cache[:, 4:-1].normal_()  # cached contexts: random latents (the null block stays zero)
    batch = Batch(slots=slots, query_lens=list(query_lens), context_lens=list(context_lens))
    cache.prepare(batch)
    T, nh = sum(query_lens), config.num_attention_heads
    q = torch.randn(T, nh, config.qk_head_dim, device=device, dtype=dtype)
    kv_c = torch.randn(T, config.kv_lora_rank, device=device, dtype=dtype)
    k_pe = torch.randn(T, config.qk_rope_head_dim, device=device, dtype=dtype)
    cache.write(0, batch.slot_mapping, torch.cat([kv_c, k_pe], dim=-1))
    return attn, cache, batch, q, kv_c, k_pe


STEPS = {  # (query_lens, context_lens) of one engine step
    "fresh-prompts": ([3, 17, 1], [0, 0, 0]),
    "lone-decode-and-chunk": ([1, 3], [9, 3]),
    "decodes-between-chunks": ([5, 4, 1, 1, 17], [0, 9, 7, 3, 0]),
    "three-prompts": ([3, 8, 2], [0, 0, 0]),
    "chunks-around-a-decode": ([4, 1, 6, 2, 3], [5, 2, 0, 0, 1]),
    # the engine's order, decodes first: the prompts' rows are read and written as views
    "decodes-then-prompts": ([1, 1, 1, 5, 7], [4, 6, 2, 0, 0]),
    "decodes-then-chunks": ([1, 1, 6, 3], [3, 5, 2, 0]),
}
