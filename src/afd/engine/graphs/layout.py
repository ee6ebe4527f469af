"""The static buffers of a `GraphedLayout` for each token bucket of the prefill graphs, and which steps fit one.

Why: a step holding prompt tokens replays its row-wise pieces from graphs (afd.engine.graphs.prefill), but the
attention core between them reads the step's layout on the host, so it launched eagerly in every layer: on an H200
host some 0.5-1 ms a layer, as long as the device takes for a mixed step of a few decodes beside a short prompt.
The engine orders a step decodes first, then prompt chunks, then new prompts; when every prompt of the step is
fresh (no cached context), the core needs only fixed-shape device buffers: the decodes' block tables and lengths
(as a decode graph holds them) and the prompts' row bounds with a table of query tiles for a fixed launch grid.
Such a step then runs its cores inside the graphs, one per token bucket. Chunks after cached context (whose keys
are gathered from the cache, a length the bucket does not bound) keep the eager core.

Sizes per bucket of Tp tokens: D = min(Tp, max_seqs) decode rows, S = min(Tp, max_seqs) prompt slots and
G = ceil(Tp / BLOCK_M) + S tile programs: every step the bucket holds fits them.
"""

from __future__ import annotations

import torch

from afd.engine.graphs.decode import fill_decode_tables
from afd.kernels.prefill_attention import query_tiles, tile_rows
from afd.model.batch import Batch, GraphedLayout
from afd.model.kv_cache import NULL_BLOCK


def fits_graphed_layout(batch: Batch, table_width: int) -> bool:
    """Whether a prepared step's cores can run from a `GraphedLayout`: its batched single-token sequences on the
    first rows (the engine's order), every other sequence a fresh prompt of two or more tokens, and no decode
    context wider than the static tables."""
    decodes = batch.decode_seqs
    if decodes and decodes[-1] != len(decodes) - 1:
        return False
    if batch.decode_tables is not None and batch.decode_tables.shape[1] > table_width:
        return False
    lens, contexts = batch.query_lens, batch.context_lens
    return all(lens[i] > 1 and contexts[i] == 0 for i in range(len(decodes), len(lens)))


def layout_meta(batch: Batch, slots: int, programs: int, block_m: int) -> list[int]:
    """The int32 words of one bucket's prompt metadata for a step that `fits_graphed_layout`: the prompts' row
    bounds [slots + 1] (absolute rows; slots past the step's prompts are empty), padding to a multiple of four (the
    tile table starts 16-byte aligned, as Triton compiles per pointer alignment), then the tile table [2, programs]:
    each program's prompt (-1: none) and query tile. Pure, so the layout is checked on CPU."""
    first = len(batch.decode_seqs)
    starts = batch.starts
    prompt_lens = batch.query_lens[first:]
    if len(prompt_lens) > slots:
        raise ValueError(f"{len(prompt_lens)} prompts do not fit a layout of {slots} prompt slots")
    end = starts[first] if prompt_lens else 0
    bounds = [starts[i] for i in range(first, len(starts))] + [end + sum(prompt_lens)] * (slots + 1 - len(prompt_lens))
    tiles = query_tiles(prompt_lens, block_m)
    if len(tiles) > programs:
        raise ValueError(f"{len(tiles)} query tiles do not fit a layout of {programs} programs")
    tiles += [(-1, 0)] * (programs - len(tiles))
    gap = [0] * (-(slots + 1) % 4)
    return bounds + gap + [s for s, _ in tiles] + [m for _, m in tiles]


class LayoutBuffers:
    """One runner's `GraphedLayout` buffers: the decode tables and lengths shared by every bucket (bucket Tp reads
    the first D rows), and per bucket its prompt metadata (row bounds, tile table), refilled by `fill`."""

    def __init__(
        self, max_tokens: int, max_seqs: int, table_width: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.max_seqs, self.device = max_seqs, device
        self.block_m = tile_rows(dtype)
        rows = min(max_tokens, max_seqs)
        self.tables = torch.full((rows, table_width), NULL_BLOCK, dtype=torch.long, device=device)
        self.lens = torch.ones(rows, dtype=torch.int32, device=device)
        self._meta: dict[int, torch.Tensor] = {}

    @property
    def table_width(self) -> int:
        return self.tables.shape[1]

    def sizes(self, tokens: int) -> tuple[int, int, int]:
        """(decode rows, prompt slots, tile programs) of the bucket of `tokens`."""
        slots = min(tokens, self.max_seqs)
        return min(tokens, self.tables.shape[0]), slots, -(-tokens // self.block_m) + slots

    def layout(self, tokens: int) -> GraphedLayout:
        """The bucket's buffers as a layout (what its graphs capture); empty until `fill`ed: no decode, no prompt."""
        rows, slots, programs = self.sizes(tokens)
        meta = self._meta.get(tokens)
        if meta is None:
            empty = layout_meta(Batch(), slots, programs, self.block_m)
            meta = self._meta[tokens] = torch.tensor(empty, dtype=torch.int32, device=self.device)
        at = len(meta) - 2 * programs
        return GraphedLayout(self.tables[:rows], self.lens[:rows], meta[: slots + 1], meta[at:].view(2, programs))

    def fill(self, batch: Batch, tokens: int) -> GraphedLayout:
        """Write a prepared step that `fits_graphed_layout` into the bucket's buffers (device copies and one
        host->device copy, no sync) and return its layout."""
        layout = self.layout(tokens)
        rows, slots, programs = self.sizes(tokens)
        no_decode = batch.decode_tables is None
        tables = self.tables[:0, :0] if no_decode else batch.decode_tables
        lens = self.lens[:0] if no_decode else batch.decode_lens
        fill_decode_tables(layout.decode_tables, layout.decode_lens, tables, lens, NULL_BLOCK)
        meta = self._meta[tokens]
        host = torch.tensor(layout_meta(batch, slots, programs, self.block_m), dtype=torch.int32)
        if meta.is_cuda:
            host = host.pin_memory()
        meta.copy_(host, non_blocking=True)
        return layout
