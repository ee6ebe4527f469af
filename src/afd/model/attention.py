"""Multi-head latent attention (MLA) over the paged latent cache.

Three paths, one result: batched single-token decodes attend in the absorbed form (Triton kernel over the
paged latents on CUDA, einsums elsewhere); prompts and chunks expand keys and values through `kv_b_proj`
(one varlen Triton launch on CUDA, SDPA per sequence elsewhere).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from afd import kernels
from afd.model.batch import Batch, GraphedLayout
from afd.model.config import ModelConfig
from afd.model.fp8 import StackedFP8, linear, linear_weight
from afd.model.kv_cache import DecodeContext, PagedLatentCache, context_rows, decode_context
from afd.model.layers import RMSNorm, apply_rope

# --- attention side --------------------------------------------------------------------------------


class MLAttention(nn.Module):
    """Multi-head latent attention; caches the compressed latent, expands keys/values per sequence."""

    def __init__(self, config: ModelConfig, layer_idx: int, softmax_scale: float) -> None:
        super().__init__()
        c = config
        self.config, self.layer_idx, self.softmax_scale = c, layer_idx, softmax_scale
        self.num_heads = c.num_attention_heads
        q_out = c.num_attention_heads * c.qk_head_dim
        block = c.fp8_block  # every projection below is block-scaled FP8 when set (afd.model.fp8)
        if c.q_lora_rank is None:
            self.q_proj = linear(c.hidden_size, q_out, block)
        else:
            self.q_a_proj = linear(c.hidden_size, c.q_lora_rank, block, bias=c.attention_bias)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank)
            self.q_b_proj = linear(c.q_lora_rank, q_out, block)
        kv_a_out = c.kv_lora_rank + c.qk_rope_head_dim
        self.kv_a_proj_with_mqa = linear(c.hidden_size, kv_a_out, block, bias=c.attention_bias)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank)
        kv_b_out = c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim)
        self.kv_b_proj = linear(c.kv_lora_rank, kv_b_out, block)
        self.o_proj = linear(c.num_attention_heads * c.v_head_dim, c.hidden_size, block, bias=c.attention_bias)
        # the two projections of x, one FP8 GEMM where they stack (`StackedFP8`)
        first = self.q_proj if c.q_lora_rank is None else self.q_a_proj
        self._fp8_x_proj = StackedFP8([first, self.kv_a_proj_with_mqa]) if block else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: Batch, kv_cache: PagedLatentCache | None
    ) -> torch.Tensor:
        """x [T, H] (normed) -> [T, H]: `project`, `attend`, then the output projection."""
        q, kv_c, k_pe = self.project(x, cos, sin, batch, kv_cache)
        return self.o_proj(self.attend(q, kv_c, k_pe, batch, kv_cache).flatten(1))

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: Batch, kv_cache: PagedLatentCache | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The row-wise part: q [T, nh, D] with its rope part rotated, this step's latents kv_c [T, C] and k_pe [T, R],
        already written to the cache at `batch.slot_mapping`. Why apart from `attend`: it depends on the token count
        only, so a prefill CUDA graph (graphs.prefill) can hold it while the layout-dependent core runs eagerly."""
        c, nh = self.config, self.num_heads
        T = x.shape[0]
        if self._fp8_x_proj is not None:
            q, kv_a = self._fp8_x_proj(x)  # column slices of one output
            q = q.contiguous() if c.q_lora_rank is None else q  # the attention cores take q's rows packed
        else:
            q = self.q_proj(x) if c.q_lora_rank is None else self.q_a_proj(x)
            kv_a = self.kv_a_proj_with_mqa(x)
        if c.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q = q.view(T, nh, c.qk_head_dim)  # [T, nh, D]
        q_pe = q[..., c.qk_nope_head_dim :]
        kv_c, k_pe = kv_a.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        kv_c = self.kv_a_layernorm(kv_c)  # [T, C]
        apply_rope(q_pe, cos, sin, c.rope_interleave, out=q_pe)  # in place: q is now [q_nope | rotated q_pe]
        k_pe = apply_rope(k_pe, cos, sin, c.rope_interleave)  # [T, R]
        if kv_cache is not None:  # every token of the step at once, before any sequence reads its context
            kv_cache.write(self.layer_idx, batch.slot_mapping, torch.cat([kv_c, k_pe], dim=-1))
        return q, kv_c, k_pe

    def attend(
        self,
        q: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        batch: Batch,
        kv_cache: PagedLatentCache | None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The core, which depends on the step's layout: every sequence's queries against its keys -> [T, nh, Dv]
        (into `out` when given)."""
        if batch.graphed is not None:
            return self._attend_graphed(q, kv_c, k_pe, batch.graphed, kv_cache, out)
        c, nh = self.config, self.num_heads
        T = q.shape[0]
        q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        decodes = batch.decode_seqs if kv_cache is not None else []
        if decodes and len(decodes) == len(batch.query_lens):  # all decodes (graphed steps): rows in order
            o = self._decode_attention(q_nope, q_pe, kv_cache, decode_context(batch, kv_cache.block_size))
            return o if out is None else out.copy_(o)
        out = q.new_empty(T, nh, c.v_head_dim) if out is None else out  # [T, nh, Dv]
        if decodes:  # one pass over every single-token sequence instead of a loop over them
            context = decode_context(batch, kv_cache.block_size)
            Bd = len(decodes)
            if decodes[-1] == Bd - 1:  # the engine's order, decodes first: rows [0, Bd), no gather or scatter
                out[:Bd] = self._decode_attention(q_nope[:Bd], q_pe[:Bd], kv_cache, context)
            else:
                rows = batch.decode_token_rows  # [Bd]
                out[rows] = self._decode_attention(q_nope[rows], q_pe[rows], kv_cache, context)  # [Bd, nh, Dv]
        self._prefill_attention(out, q, kv_c, k_pe, batch, kv_cache, set(decodes))
        return out

    def _attend_graphed(
        self,
        q: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        layout: GraphedLayout,
        kv_cache: PagedLatentCache,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        """The core of a step laid out as `layout` says, in fixed shapes with no host read, so a CUDA graph holds
        it: the decode rows [0, D) in the absorbed form (padding rows attend to the zero row), then the prompts'
        keys (the step's own rows, or gathered from the cache, where this step's latents already are) expanded and
        the prompts' rows overwritten by the tiled varlen kernel. Rows of no sequence stay finite (zero, or a
        padding decode's zero)."""
        c, nh = self.config, self.num_heads
        out = q.new_zeros(q.shape[0], nh, c.v_head_dim) if out is None else out  # [Tp, nh, Dv]
        D, W = layout.decode_tables.shape
        q_nope, q_pe = q[:D].split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        context = DecodeContext(layout.decode_tables, layout.decode_lens, kv_cache.block_size, W * kv_cache.block_size)
        out[:D] = self._decode_attention(q_nope, q_pe, kv_cache, context)  # [D, nh, Dv]
        if layout.key_rows is None:  # fresh prompts only: their keys are their own rows
            keys_c, keys_pe = kv_c, k_pe
        else:
            latents = kv_cache.read(self.layer_idx, layout.key_rows)  # [K, C + R]
            keys_c, keys_pe = latents.split([c.kv_lora_rank, c.qk_rope_head_dim], -1)
        kv = self.kv_b_proj(keys_c).view(keys_c.shape[0], nh, c.qk_nope_head_dim + c.v_head_dim)
        k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)  # [K, nh, Dn], [K, nh, Dv]: views
        cu_q, cu_k = layout.cu_seqlens_q, layout.cu_seqlens_k
        if kernels.enabled(q.device):
            from afd.kernels.prefill_attention import prefill_attention

            prefill_attention(q, k_nope, keys_pe, v, cu_q, cu_k, 0, self.softmax_scale, out=out, tiles=layout.tiles)
            return out
        # never captured here: the eager oracle reads the layout back, one SDPA per prompt (queries at the end)
        for (q0, q1), (k0, k1) in zip(
            itertools.pairwise(cu_q.tolist()), itertools.pairwise(cu_k.tolist()), strict=True
        ):
            if q1 > q0:
                k = torch.cat([k_nope[k0:k1], keys_pe[k0:k1, None].expand(-1, nh, -1)], dim=-1)
                ctx = (k1 - k0) - (q1 - q0)
                is_visible = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool, device=q.device).tril(ctx)
                out[q0:q1] = F.scaled_dot_product_attention(
                    q[q0:q1].transpose(0, 1), k.transpose(0, 1), v[k0:k1].transpose(0, 1),
                    attn_mask=is_visible, scale=self.softmax_scale,
                ).transpose(0, 1)  # fmt: skip
        return out

    def _prefill_attention(
        self,
        out: torch.Tensor,
        q: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        batch: Batch,
        kv_cache: PagedLatentCache | None,
        batched: set[int],
    ) -> None:
        """Every sequence not in `batched` (prompts, prompt chunks, a lone decode) into its rows of `out`.

        q: [T, nh, D], kv_c: [T, C], k_pe: [T, R] (this step's new latents), out: [T, nh, Dv], written in
        place. On CUDA with the Triton kernels all of them go through one varlen kernel launch; elsewhere
        (the CPU path and the oracle) one SDPA per sequence.
        """
        seqs = [i for i in range(len(batch.query_lens)) if i not in batched]
        if not seqs:
            return
        if kernels.enabled(q.device):
            self._prefill_attention_varlen(out, q, kv_c, k_pe, batch, kv_cache, seqs)
        else:
            self._prefill_attention_sdpa(out, q, kv_c, k_pe, batch, kv_cache, seqs)

    def _sequence_latents(
        self,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        batch: Batch,
        kv_cache: PagedLatentCache | None,
        i: int,
        row: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The key latents sequence `i` (its queries at rows `row`...) attends to: [L, C], [L, R], L = its
        context + its new tokens."""
        c = self.config
        n, ctx = batch.query_lens[i], batch.context_lens[i]
        if ctx == 0:  # a fresh prompt attends to its own new latents
            return kv_c[row : row + n], k_pe[row : row + n]
        if kv_cache is None:
            raise ValueError("a sequence with cached context needs a kv_cache")
        latents = kv_cache.read(self.layer_idx, batch.context_rows[i])  # [ctx + n, C + R]
        seq_kv_c, seq_k_pe = latents.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        return seq_kv_c, seq_k_pe

    def _prefill_attention_sdpa(
        self,
        out: torch.Tensor,
        q: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        batch: Batch,
        kv_cache: PagedLatentCache | None,
        seqs: list[int],
    ) -> None:
        """The eager path: per sequence, keys and values expanded through kv_b_proj, then one SDPA."""
        c, nh = self.config, self.num_heads
        starts = batch.starts
        for i in seqs:
            n, ctx, row = batch.query_lens[i], batch.context_lens[i], starts[i]
            seq_kv_c, seq_k_pe = self._sequence_latents(kv_c, k_pe, batch, kv_cache, i, row)
            L = seq_kv_c.shape[0]
            kv = self.kv_b_proj(seq_kv_c).view(L, nh, c.qk_nope_head_dim + c.v_head_dim)
            k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)  # [L, nh, *]
            k = torch.cat([k_nope, seq_k_pe.unsqueeze(1).expand(L, nh, c.qk_rope_head_dim)], dim=-1)
            # A decode token sees its whole context and a fresh prompt is plainly causal: neither needs a
            # mask, which keeps SDPA off its slow masked path. Only a chunk after cached context builds one.
            is_visible = None if n == 1 or ctx == 0 else torch.ones(n, L, dtype=torch.bool, device=q.device).tril(ctx)
            o = F.scaled_dot_product_attention(
                q[row : row + n].transpose(0, 1),  # [nh, n, D]
                k.transpose(0, 1),  # [nh, L, D]
                v.transpose(0, 1),  # [nh, L, Dv]
                attn_mask=is_visible,
                is_causal=n > 1 and ctx == 0,
                scale=self.softmax_scale,
            )
            out[row : row + n] = o.transpose(0, 1)

    def _prefill_attention_varlen(
        self,
        out: torch.Tensor,
        q: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        batch: Batch,
        kv_cache: PagedLatentCache | None,
        seqs: list[int],
    ) -> None:
        """The kernel path: the key latents of all `seqs` concatenated, keys and values expanded by one
        kv_b_proj call, one varlen attention launch (afd.kernels.prefill_attention), no host sync.

        When `seqs` sit on consecutive rows (the engine's order: decodes first, then chunks and prompts) the
        kernel reads and writes views of those rows, and fresh prompts' keys are their own latents as they are;
        otherwise (decodes between them) the queries are gathered and the outputs scattered back. Sequence
        lengths come from the host lists; their device copy (cu_seqlens and, for the gather, the query rows) is
        one pinned asynchronous copy per step, kept in the batch.
        """
        from afd.kernels.prefill_attention import prefill_attention

        c, nh = self.config, self.num_heads
        query_lens = [batch.query_lens[i] for i in seqs]
        key_lens = [batch.context_lens[i] + n for i, n in zip(seqs, query_lens, strict=True)]
        starts = batch.starts
        Tq = sum(query_lens)
        first = starts[seqs[0]]
        consecutive = seqs[-1] - seqs[0] == len(seqs) - 1  # then their rows are [first, first + Tq)
        if consecutive and all(batch.context_lens[i] == 0 for i in seqs):  # fresh prompts only
            keys_c, keys_pe = kv_c[first : first + Tq], k_pe[first : first + Tq]  # [Lk, C], [Lk, R]: views
        else:
            parts = [self._sequence_latents(kv_c, k_pe, batch, kv_cache, i, starts[i]) for i in seqs]
            keys_c, keys_pe = (torch.cat(p) for p in zip(*parts, strict=True))  # [Lk, C], [Lk, R]
        Lk = keys_c.shape[0]
        kv = self.kv_b_proj(keys_c).view(Lk, nh, c.qk_nope_head_dim + c.v_head_dim)
        k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)  # [Lk, nh, Dn], [Lk, nh, Dv]: views
        S = len(seqs)
        # the key table starts 16-byte aligned whatever S is: Triton compiles a kernel again for each alignment of a
        # pointer argument, so an unaligned table made a fresh server compile the prefill kernel mid-run
        k_at = -(-(S + 1) // 4) * 4
        meta = batch.varlen_meta.get(tuple(seqs))  # the same for every layer of the step: built by the first
        if meta is None:
            gap = [0] * (k_at - S - 1)
            cu_seqlens = [0, *itertools.accumulate(query_lens), *gap, 0, *itertools.accumulate(key_lens)]
            meta = torch.tensor(cu_seqlens, dtype=torch.int32)  # [k_at + S + 1] (+ [Tq] query rows below)
            if not consecutive:  # append the step row of every packed query: its sequence's first row + its index
                shift = torch.tensor([starts[i] for i in seqs], dtype=torch.int32) - meta[:S]  # [S]
                q_rows = torch.arange(Tq, dtype=torch.int32) + shift.repeat_interleave(torch.tensor(query_lens))
                meta = torch.cat([meta, q_rows])
            meta = meta.pin_memory().to(q.device, non_blocking=True) if q.is_cuda else meta.to(q.device)
            batch.varlen_meta[tuple(seqs)] = meta
        cu_seqlens_q, cu_seqlens_k = meta[: S + 1], meta[k_at : k_at + S + 1]  # [S + 1] int32 each
        args = (k_nope, keys_pe, v, cu_seqlens_q, cu_seqlens_k, max(query_lens), self.softmax_scale)
        if consecutive:
            prefill_attention(q[first : first + Tq], *args, out=out[first : first + Tq])
        else:  # decodes (attended in their own batched pass) sit between: gather the queries, scatter back
            rows = meta[k_at + S + 1 :].long()  # [Tq]
            out.index_copy_(0, rows, prefill_attention(q.index_select(0, rows), *args))

    def _decode_attention(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_cache: PagedLatentCache,
        context: DecodeContext,
    ) -> torch.Tensor:
        """Single-token queries against their cached latents, keys and values never expanded (absorbed MLA).

        q_nope: [B, nh, Dn], q_pe: [B, nh, R], context: where each context's rows sit and its length
        (`decode_context`) -> [B, nh, Dv]. Scores are `(q_nope W_uk) . kv_c + q_pe . k_pe`, the output
        `(probs . kv_c) W_uv`: the same products as expanding K and V, associated the other way, so nothing of
        size L x heads is built. On CUDA a Triton kernel reads the latents in place from the paged pool, each
        sequence up to its own length; the einsums below (CPU, and CUDA inside `afd.kernels.eager_ops()`) gather
        them first, padded to the longest context, and are its test oracle.
        """
        c, nh = self.config, self.num_heads
        w = linear_weight(self.kv_b_proj, q_nope.dtype).view(nh, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        w_uk, w_uv = w.split([c.qk_nope_head_dim, c.v_head_dim], dim=1)  # [nh, Dn, C], [nh, Dv, C]
        q_latent = torch.einsum("bhd,hdc->bhc", q_nope, w_uk)  # [B, nh, C]
        if kernels.enabled(q_nope.device):
            from afd.kernels.mla_decode import mla_decode

            cache_layer = kv_cache.cache[self.layer_idx]  # [rows, C + R], a view of the pool
            ctx = context
            o_latent = mla_decode(q_latent, q_pe, cache_layer, ctx.table, ctx.lens, self.softmax_scale, page=ctx.page)
        else:
            rows, is_valid = context_rows(context.table, context.lens, context.page, context.width)  # [B, L]
            latents = kv_cache.read(self.layer_idx, rows)  # [B, L, C + R]: past a length, the zero row
            kv_c, k_pe = latents.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)  # [B, L, C], [B, L, R]
            scores = torch.einsum("bhc,blc->bhl", q_latent, kv_c) + torch.einsum("bhr,blr->bhl", q_pe, k_pe)
            scores = scores.float().mul_(self.softmax_scale).masked_fill_(~is_valid[:, None, :], float("-inf"))
            probs = scores.softmax(dim=-1).to(kv_c.dtype)  # [B, nh, L]
            o_latent = torch.einsum("bhl,blc->bhc", probs, kv_c)  # [B, nh, C]
        return torch.einsum("bhc,hvc->bhv", o_latent, w_uv)  # [B, nh, Dv]
