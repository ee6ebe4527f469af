"""The layout buffers a prefill graph's attention cores read (afd.engine.graphs.layout): which steps fit them, and
the prompt metadata a step writes (pure, host-side)."""

from __future__ import annotations

import pytest
import torch

from afd.engine.graphs.layout import GATHERED_KEYS, OWN_KEYS, PAUSED, LayoutBuffers, graphed_kind, layout_meta
from afd.model.batch import Batch
from afd.model.kv_cache import PagedLatentCache
from afd.model.weights import load_model_config


def _batch(layout: list[tuple[int, int]], width: int = 4) -> Batch:
    batch = Batch(
        slots=list(range(len(layout))), query_lens=[n for n, _ in layout], context_lens=[c for _, c in layout]
    )
    if batch.decode_seqs:
        batch.decode_tables = torch.zeros(len(batch.decode_seqs), width, dtype=torch.long)
    return batch


@pytest.mark.parametrize(
    ("layout", "kind"),
    [
        ([(1, 9), (1, 3), (60, 0), (2, 0)], OWN_KEYS),  # the engine's order, fresh prompts
        ([(1, 9), (1, 3)], OWN_KEYS),  # decodes only
        ([(70, 0)], OWN_KEYS),  # one fresh prompt
        ([(60, 0), (1, 9), (1, 3)], PAUSED),  # decodes after a prompt
        ([(1, 9), (1, 3), (60, 12), (5, 0)], GATHERED_KEYS),  # a chunk after cached context, keys within the rows
        ([(1, 9), (1, 3), (60, 70)], PAUSED),  # more keys than the rows hold
        ([(1, 9), (60, 0)], PAUSED),  # a lone single-token sequence is not batched: it would need its own rows
    ],
)
def test_how_each_step_runs_its_cores(layout, kind) -> None:
    assert graphed_kind(_batch(layout), table_width=4, key_rows=100) == kind


def test_a_decode_wider_than_the_tables_pauses() -> None:
    assert graphed_kind(_batch([(1, 90), (1, 3), (5, 0)], width=8), table_width=4, key_rows=100) == PAUSED


def test_meta_holds_the_prompts_bounds_then_an_aligned_tile_table() -> None:
    """Prompts of 40 (after 10 cached tokens), 2 and 17 tokens after 3 decodes, tiles of 16 rows, 6 slots and 9
    programs: query bounds from row 3, key bounds packed from 0 (context included), empty slots at the end, each
    table 16-byte aligned, heaviest tiles first, idle programs last."""
    batch = _batch([(1, 9), (1, 3), (1, 5), (40, 10), (2, 0), (17, 0)])
    meta = layout_meta(batch, slots=6, programs=9, block_m=16)
    assert meta[:8] == [3, 43, 45, 62, 62, 62, 62, 0]
    assert meta[8:16] == [0, 50, 52, 69, 69, 69, 69, 0]
    seqs, m = meta[16:25], meta[25:]
    heaviest_first = [(0, 2), (0, 1), (2, 1), (0, 0), (1, 0), (2, 0)]
    assert list(zip(seqs, m, strict=True)) == heaviest_first + [(-1, 0)] * 3


def test_meta_of_no_step_is_idle_and_too_small_a_layout_is_refused() -> None:
    assert layout_meta(Batch(), slots=3, programs=2, block_m=16) == [0] * 8 + [-1, -1, 0, 0]
    with pytest.raises(ValueError, match="2 prompts do not fit a layout of 1 prompt slots"):
        layout_meta(_batch([(5, 0), (6, 0)]), slots=1, programs=4, block_m=16)
    with pytest.raises(ValueError, match="3 query tiles do not fit a layout of 2 programs"):
        layout_meta(_batch([(40, 0)]), slots=1, programs=2, block_m=16)


def test_buffers_fill_the_bucket_and_pad_the_decode_rows() -> None:
    """A bucket of 128 tokens with at most 8 sequences: 8 decode rows (2 real, the rest the null block with length
    1), 8 prompt slots, 128 / 64 + 8 = 10 programs (fp32 tiles of 64 rows) and 2 x 128 key rows; the step's
    metadata lands in the bucket's buffer as `layout_meta` wrote it, and the key rows are the prompts' cache rows,
    context first. Its own-keys layout reads the query bounds as key bounds and has no key rows."""
    cache = PagedLatentCache(
        load_model_config("tiny"), num_blocks=64, block_size=4, max_num_seqs=8, dtype=torch.float32, device="cpu"
    )
    buffers = LayoutBuffers(max_tokens=256, max_seqs=8, table_width=4, dtype=torch.float32, device=torch.device("cpu"))
    assert buffers.sizes(128) == (8, 8, 10, 256)
    slots = [cache.allocate(n) for n in (10, 4, 9, 70)]
    batch = Batch(slots=slots, query_lens=[1, 1, 3, 70], context_lens=[9, 3, 6, 0])
    batch.decode_tables = torch.tensor([[5, 6, 7, 0], [8, 0, 0, 0]])
    batch.decode_lens = torch.tensor([10, 4], dtype=torch.int32)
    assert buffers.kind(batch, 128) == GATHERED_KEYS
    buffers.fill(batch, 128, GATHERED_KEYS, cache)
    layout = buffers.layout(128, GATHERED_KEYS)
    assert layout.decode_tables.shape == (8, 4) and layout.decode_tables[:2].tolist() == batch.decode_tables.tolist()
    assert (layout.decode_tables[2:, 0] == 0).all() and layout.decode_lens.tolist() == [10, 4] + [1] * 6
    assert layout.cu_seqlens_q.tolist() == [2, 5, 75] + [75] * 6
    assert layout.cu_seqlens_k.tolist() == [0, 9, 79] + [79] * 6
    assert layout.key_rows.shape == (256,)
    assert layout.key_rows[:79].tolist() == cache.rows(slots[2], 9) + cache.rows(slots[3], 70)
    assert layout.tiles.shape == (2, 10) and layout.tiles[:, :3].tolist() == [[1, 0, 1], [1, 0, 0]]
    assert (layout.tiles[0, 3:] == -1).all()
    own = buffers.layout(128, OWN_KEYS)
    assert own.key_rows is None and own.cu_seqlens_k.data_ptr() == own.cu_seqlens_q.data_ptr()
