"""The static buffers of a `GraphedLayout` for each token bucket of the prefill graphs, and which steps fit one.

Why: a step holding prompt tokens replays its row-wise pieces from graphs (afd.engine.graphs.prefill), but the
attention core between them reads the step's layout on the host, so it launched eagerly in every layer: on an H200
host some 0.5-1 ms a layer, as long as the device takes for a mixed step of a few decodes beside a short prompt.
The engine orders a step decodes first, then prompt chunks, then new prompts. The core then needs only fixed-shape
device buffers: the decodes' block tables and lengths (as a decode graph holds them), the cache rows of the
prompts' keys (a chunk's cached context and its new tokens, all in the cache once the step's latents are written),
and the prompts' row bounds with a table of query tiles for a fixed launch grid. Such a step runs its cores inside
the graphs. Two kinds per token bucket, since gathering and expanding keys costs what it reads: OWN_KEYS for
steps whose prompts are all fresh (their keys are their own rows, as they are), GATHERED_KEYS for steps with a
chunk after cached context (every prompt's keys gathered from the cache rows, up to K of them). Any other step
(a long prompt's later chunk, its context past K) is PAUSED: its pieces pause at the cores, which run eagerly.

Sizes per bucket of Tp tokens: D = min(Tp, max_seqs) decode rows, S = min(Tp, max_seqs) prompt slots,
G = ceil(Tp / BLOCK_M) + S tile programs and K = 2 Tp key rows: every step the bucket holds fits the first three;
K holds any step whose chunks' cached context is at most the bucket's size (a prompt split once across two steps
of this bucket always is). At Tp = 8,192 on an H200 the gathered keys cost ~4 ms a step over own keys.
"""

from __future__ import annotations

import itertools

import torch

from afd.engine.graphs.decode import fill_decode_tables
from afd.kernels.prefill_attention import query_tiles, tile_rows
from afd.model.batch import Batch, GraphedLayout
from afd.model.kv_cache import NULL_BLOCK, PagedLatentCache

PAUSED, OWN_KEYS, GATHERED_KEYS = "paused", "own keys", "gathered keys"  # how a graph runs its attention cores


def graphed_kind(batch: Batch, table_width: int, key_rows: int) -> str:
    """How a prepared step's cores can run: from a `GraphedLayout` when its batched single-token sequences come
    first (the engine's order), every other sequence is a prompt (chunk) of two or more tokens and no decode
    context is wider than the static tables; with the prompts' own rows as keys when all are fresh, else gathered
    (within `key_rows`); else PAUSED."""
    decodes = batch.decode_seqs
    if decodes and decodes[-1] != len(decodes) - 1:
        return PAUSED
    if batch.decode_tables is not None and batch.decode_tables.shape[1] > table_width:
        return PAUSED
    lens, contexts = batch.query_lens, batch.context_lens
    prompts = range(len(decodes), len(lens))
    if not all(lens[i] > 1 for i in prompts):
        return PAUSED
    if all(contexts[i] == 0 for i in prompts):
        return OWN_KEYS
    return GATHERED_KEYS if sum(lens[i] + contexts[i] for i in prompts) <= key_rows else PAUSED


def layout_meta(batch: Batch, slots: int, programs: int, block_m: int) -> list[int]:
    """The int32 words of one bucket's prompt metadata for a step that has a `graphed_kind`: the prompts' query
    row bounds [slots + 1] (absolute rows), their packed key bounds [slots + 1] (slots past the step's prompts are
    empty), each padded to a multiple of four words (16-byte aligned starts: Triton compiles per pointer
    alignment), then the tile table [2, programs]: each program's prompt (-1: none) and query tile. Pure, so the
    layout is checked on CPU."""
    first = len(batch.decode_seqs)
    starts = batch.starts
    prompt_lens = batch.query_lens[first:]
    if len(prompt_lens) > slots:
        raise ValueError(f"{len(prompt_lens)} prompts do not fit a layout of {slots} prompt slots")
    key_lens = [n + c for n, c in zip(prompt_lens, batch.context_lens[first:], strict=True)]
    empty = slots + 1 - len(prompt_lens)
    end = starts[first] + sum(prompt_lens) if prompt_lens else 0
    query_bounds = [starts[i] for i in range(first, len(starts))] + [end] * empty
    key_bounds = [0, *itertools.accumulate(key_lens)] + [sum(key_lens)] * (empty - 1)
    tiles = query_tiles(prompt_lens, block_m)
    if len(tiles) > programs:
        raise ValueError(f"{len(tiles)} query tiles do not fit a layout of {programs} programs")
    tiles += [(-1, 0)] * (programs - len(tiles))
    gap = [0] * (-(slots + 1) % 4)
    return query_bounds + gap + key_bounds + gap + [s for s, _ in tiles] + [m for _, m in tiles]


class LayoutBuffers:
    """One runner's `GraphedLayout` buffers: the decode tables and lengths and the key rows, shared by every bucket
    (bucket Tp reads their first rows), and per bucket its prompt metadata (bounds, tile table); `fill` refills
    them for a step."""

    def __init__(
        self, max_tokens: int, max_seqs: int, table_width: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.max_seqs, self.device = max_seqs, device
        self.block_m = tile_rows(dtype)
        rows = min(max_tokens, max_seqs)
        self.tables = torch.full((rows, table_width), NULL_BLOCK, dtype=torch.long, device=device)
        self.lens = torch.ones(rows, dtype=torch.int32, device=device)
        self.key_rows = torch.zeros(2 * max_tokens, dtype=torch.long, device=device)  # stale rows: still in the cache
        self._meta: dict[int, torch.Tensor] = {}

    @property
    def table_width(self) -> int:
        return self.tables.shape[1]

    def sizes(self, tokens: int) -> tuple[int, int, int, int]:
        """(decode rows, prompt slots, tile programs, key rows) of the bucket of `tokens`."""
        slots = min(tokens, self.max_seqs)
        return min(tokens, self.tables.shape[0]), slots, -(-tokens // self.block_m) + slots, 2 * tokens

    def kind(self, batch: Batch, tokens: int) -> str:
        """`graphed_kind` of a prepared step in the bucket of `tokens`."""
        return graphed_kind(batch, self.table_width, self.sizes(tokens)[3])

    def layout(self, tokens: int, kind: str) -> GraphedLayout:
        """The bucket's buffers as the layout of a graph of `kind` (what it captures); empty until `fill`ed: no
        decode, no prompt. OWN_KEYS: no key rows, the key bounds are the query bounds."""
        rows, slots, programs, keys = self.sizes(tokens)
        meta = self._bucket_meta(tokens)
        bounds = slots + 1 + (-(slots + 1) % 4)
        gathered = kind == GATHERED_KEYS
        return GraphedLayout(
            self.tables[:rows],
            self.lens[:rows],
            self.key_rows[:keys] if gathered else None,
            meta[: slots + 1],
            meta[bounds : bounds + slots + 1] if gathered else meta[: slots + 1],
            meta[2 * bounds :].view(2, programs),
        )

    def _bucket_meta(self, tokens: int) -> torch.Tensor:
        """The bucket's prompt metadata buffer, made on first use holding no prompt."""
        meta = self._meta.get(tokens)
        if meta is None:
            _, slots, programs, _ = self.sizes(tokens)
            empty = layout_meta(Batch(), slots, programs, self.block_m)
            meta = self._meta[tokens] = torch.tensor(empty, dtype=torch.int32, device=self.device)
        return meta

    def fill(self, batch: Batch, tokens: int, kind: str, kv_cache: PagedLatentCache | None = None) -> None:
        """Write a prepared step of `kind` (not PAUSED) into the bucket's buffers: device copies and one or two
        host->device copies, no sync. `kv_cache`: where GATHERED_KEYS read the prompts' key rows."""
        rows, slots, programs, _ = self.sizes(tokens)
        no_decode = batch.decode_tables is None
        tables = self.tables[:0, :0] if no_decode else batch.decode_tables
        lens = self.lens[:0] if no_decode else batch.decode_lens
        fill_decode_tables(self.tables[:rows], self.lens[:rows], tables, lens, NULL_BLOCK)
        _copy(self._bucket_meta(tokens), layout_meta(batch, slots, programs, self.block_m), torch.int32)
        if kind == GATHERED_KEYS:
            first = len(batch.decode_seqs)
            prompts = zip(batch.slots[first:], batch.query_lens[first:], batch.context_lens[first:], strict=True)
            key_rows = [r for slot, n, ctx in prompts for r in kv_cache.rows(slot, ctx + n)]
            if key_rows:
                _copy(self.key_rows[: len(key_rows)], key_rows, torch.long)


def _copy(into: torch.Tensor, values: list[int], dtype: torch.dtype) -> None:
    """`values` into a device tensor: one pinned, asynchronous host->device copy on CUDA."""
    host = torch.tensor(values, dtype=dtype)
    into.copy_(host.pin_memory() if into.is_cuda else host, non_blocking=True)
