"""The layout buffers a prefill graph's attention cores read (afd.engine.graphs.layout): which steps fit them, and
the prompt metadata a step writes (pure, host-side)."""

from __future__ import annotations

import pytest
import torch

from afd.engine.graphs.layout import LayoutBuffers, fits_graphed_layout, layout_meta
from afd.model.batch import Batch


def _batch(layout: list[tuple[int, int]], width: int = 4) -> Batch:
    batch = Batch(
        slots=list(range(len(layout))), query_lens=[n for n, _ in layout], context_lens=[c for _, c in layout]
    )
    if batch.decode_seqs:
        batch.decode_tables = torch.zeros(len(batch.decode_seqs), width, dtype=torch.long)
    return batch


@pytest.mark.parametrize(
    ("layout", "fits"),
    [
        ([(1, 9), (1, 3), (60, 0), (2, 0)], True),  # the engine's order, fresh prompts
        ([(1, 9), (1, 3)], True),  # decodes only
        ([(70, 0)], True),  # one fresh prompt
        ([(60, 0), (1, 9), (1, 3)], False),  # decodes after a prompt
        ([(1, 9), (1, 3), (60, 12)], False),  # a chunk after cached context
        ([(1, 9), (60, 0)], False),  # a lone single-token sequence is not batched: it would need its own rows
    ],
)
def test_which_steps_fit(layout, fits) -> None:
    assert fits_graphed_layout(_batch(layout), table_width=4) is fits


def test_a_decode_wider_than_the_tables_does_not_fit() -> None:
    assert not fits_graphed_layout(_batch([(1, 90), (1, 3), (5, 0)], width=8), table_width=4)


def test_meta_holds_the_prompts_bounds_then_an_aligned_tile_table() -> None:
    """Prompts of 40, 2 and 17 tokens after 3 decodes, tiles of 16 rows, 6 slots and 9 programs: bounds from row 3,
    empty slots at the end, the table 16-byte aligned, heaviest tiles first, idle programs last."""
    meta = layout_meta(_batch([(1, 9), (1, 3), (1, 5), (40, 0), (2, 0), (17, 0)]), slots=6, programs=9, block_m=16)
    bounds, gap, tiles = meta[:7], meta[7:8], meta[8:]
    assert bounds == [3, 43, 45, 62, 62, 62, 62] and gap == [0]
    seqs, m = tiles[:9], tiles[9:]
    assert list(zip(seqs, m, strict=True)) == [
        (0, 2),
        (0, 1),
        (2, 1),
        (0, 0),
        (1, 0),
        (2, 0),
        (-1, 0),
        (-1, 0),
        (-1, 0),
    ]


def test_meta_of_no_step_is_idle_and_too_small_a_layout_is_refused() -> None:
    assert layout_meta(Batch(), slots=3, programs=2, block_m=16) == [0, 0, 0, 0, -1, -1, 0, 0]
    with pytest.raises(ValueError, match="2 prompts do not fit a layout of 1 prompt slots"):
        layout_meta(_batch([(5, 0), (6, 0)]), slots=1, programs=4, block_m=16)
    with pytest.raises(ValueError, match="3 query tiles do not fit a layout of 2 programs"):
        layout_meta(_batch([(40, 0)]), slots=1, programs=2, block_m=16)


def test_buffers_fill_the_bucket_and_pad_the_decode_rows() -> None:
    """A bucket of 128 tokens with at most 8 sequences: 8 decode rows (2 real, the rest the null block with length
    1), 8 prompt slots and 128 / 64 + 8 = 10 programs (fp32 tiles of 64 rows); the step's metadata lands in the
    bucket's buffer as `layout_meta` wrote it."""
    buffers = LayoutBuffers(max_tokens=256, max_seqs=8, table_width=4, dtype=torch.float32, device=torch.device("cpu"))
    assert buffers.sizes(128) == (8, 8, 10)
    batch = _batch([(1, 9), (1, 3), (70, 0)])
    batch.decode_tables = torch.tensor([[5, 6, 7, 0], [8, 0, 0, 0]])
    batch.decode_lens = torch.tensor([10, 4], dtype=torch.int32)
    layout = buffers.fill(batch, 128)
    assert layout.decode_tables.shape == (8, 4) and layout.decode_tables[:2].tolist() == batch.decode_tables.tolist()
    assert (layout.decode_tables[2:, 0] == 0).all() and layout.decode_lens.tolist() == [10, 4] + [1] * 6
    assert layout.cu_seqlens.tolist() == [2, 72] + [72] * 7
    assert layout.tiles.shape == (2, 10) and layout.tiles[:, :2].tolist() == [[0, 0], [1, 0]]
    assert (layout.tiles[0, 2:] == -1).all()
