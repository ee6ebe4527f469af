"""The static buffers of a `GraphedLayout` for each token bucket of the prefill graphs, and which steps fit one.

Why: a step holding prompt tokens replays its row-wise pieces from graphs (afd.engine.graphs.prefill), but the
attention core between them reads the step's layout on the host, so it launched eagerly in every layer: on an H200
host some 0.5-1 ms a layer, as long as the device takes for a mixed step of a few decodes beside a short prompt.
The engine orders a step decodes first, then prompt chunks, then new prompts. The core then needs only fixed-shape
device buffers: the decodes' block tables and lengths (as a decode graph holds them), the cache rows of the
prompts' keys (a chunk's cached context and its new tokens, all in the cache once the step's latents are written),
and the prompts' row bounds with a table of query tiles for a fixed launch grid. Such a step runs its cores inside
the graphs, one set per token bucket.

Sizes per bucket of Tp tokens: D = min(Tp, max_seqs) decode rows, S = min(Tp, max_seqs) prompt slots,
G = ceil(Tp / BLOCK_M) + S tile programs and K = Tp + max_tokens key rows: every step the bucket holds fits the
first three; K holds any step whose prompts' cached context is at most the token budget (a prompt split once
across two steps always is). A step past K (a long prompt's later chunks) pauses at the cores instead.
"""

from __future__ import annotations

import itertools

import torch

from afd.engine.graphs.decode import fill_decode_tables
from afd.kernels.prefill_attention import query_tiles, tile_rows
from afd.model.batch import Batch, GraphedLayout
from afd.model.kv_cache import NULL_BLOCK, PagedLatentCache


def fits_graphed_layout(batch: Batch, table_width: int, key_rows: int) -> bool:
    """Whether a prepared step's cores can run from a `GraphedLayout` of `key_rows` key rows: its batched
    single-token sequences on the first rows (the engine's order), every other sequence a prompt (chunk) of two or
    more tokens, their keys (cached context and new tokens) within `key_rows`, and no decode context wider than
    the static tables."""
    decodes = batch.decode_seqs
    if decodes and decodes[-1] != len(decodes) - 1:
        return False
    if batch.decode_tables is not None and batch.decode_tables.shape[1] > table_width:
        return False
    lens, contexts = batch.query_lens, batch.context_lens
    prompts = range(len(decodes), len(lens))
    return all(lens[i] > 1 for i in prompts) and sum(lens[i] + contexts[i] for i in prompts) <= key_rows


def layout_meta(batch: Batch, slots: int, programs: int, block_m: int) -> list[int]:
    """The int32 words of one bucket's prompt metadata for a step that `fits_graphed_layout`: the prompts' query
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
        self.max_tokens, self.max_seqs, self.device = max_tokens, max_seqs, device
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
        return min(tokens, self.tables.shape[0]), slots, -(-tokens // self.block_m) + slots, tokens + self.max_tokens

    def fits(self, batch: Batch, tokens: int) -> bool:
        return fits_graphed_layout(batch, self.table_width, self.sizes(tokens)[3])

    def layout(self, tokens: int) -> GraphedLayout:
        """The bucket's buffers as a layout (what its graphs capture); empty until `fill`ed: no decode, no prompt."""
        rows, slots, programs, keys = self.sizes(tokens)
        meta = self._meta.get(tokens)
        if meta is None:
            empty = layout_meta(Batch(), slots, programs, self.block_m)
            meta = self._meta[tokens] = torch.tensor(empty, dtype=torch.int32, device=self.device)
        bounds = slots + 1 + (-(slots + 1) % 4)
        return GraphedLayout(
            self.tables[:rows],
            self.lens[:rows],
            self.key_rows[:keys],
            meta[: slots + 1],
            meta[bounds : bounds + slots + 1],
            meta[2 * bounds :].view(2, programs),
        )

    def fill(self, batch: Batch, tokens: int, kv_cache: PagedLatentCache | None = None) -> GraphedLayout:
        """Write a prepared step that `fits` into the bucket's buffers (device copies and two host->device copies,
        no sync) and return its layout. `kv_cache`: where the prompts' key rows are read (None: the step has none)."""
        layout = self.layout(tokens)
        _, slots, programs, _ = self.sizes(tokens)
        no_decode = batch.decode_tables is None
        tables = self.tables[:0, :0] if no_decode else batch.decode_tables
        lens = self.lens[:0] if no_decode else batch.decode_lens
        fill_decode_tables(layout.decode_tables, layout.decode_lens, tables, lens, NULL_BLOCK)
        first = len(batch.decode_seqs)
        prompts = zip(batch.slots[first:], batch.query_lens[first:], batch.context_lens[first:], strict=True)
        key_rows = [r for slot, n, ctx in prompts for r in kv_cache.rows(slot, ctx + n)] if kv_cache else []
        _copy(self._meta[tokens], layout_meta(batch, slots, programs, self.block_m), torch.int32)
        if key_rows:
            _copy(self.key_rows[: len(key_rows)], key_rows, torch.long)
        return layout


def _copy(into: torch.Tensor, values: list[int], dtype: torch.dtype) -> None:
    """`values` into a device tensor: one pinned, asynchronous host->device copy on CUDA."""
    host = torch.tensor(values, dtype=dtype)
    into.copy_(host.pin_memory() if into.is_cuda else host, non_blocking=True)
