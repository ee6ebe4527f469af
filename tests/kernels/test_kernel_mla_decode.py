"""The Triton MLA decode kernel (`afd.kernels.mla_decode`) against the eager absorbed attention it replaces.

CPU (Triton's interpreter, fp32, tiny shapes): the kernel equals the einsum math of
`MLAttention._decode_attention` within 1e-5, for every split count, with padded rows pointing at the zero
row (the CUDA-graph layout), ragged batches read through block tables of several block sizes, and contexts
spanning several blocks of a real `PagedLatentCache`; NaN in cache slots past a sequence's length never
reaches its output; the split arithmetic (`split_tiles`) on its own; the model's decode path takes the kernel
without gathering the context. GPU (`-m gpu`, bf16, DeepSeek-V2-Lite shapes):
against an fp32 reference, bit-identical across runs, and the same bits from a CUDA-graph replay
(tests/e2e/test_kernel_mla_decode_gpu.py).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")


from helpers.kernels_mla_decode import eager_o_latent, lengths, make_case, make_ragged_case

from afd import kernels  # noqa: E402
from afd.engine.graphs.decode import StaticInputs, fill_static_inputs  # noqa: E402
from afd.kernels import mla_decode as mla_decode_module  # noqa: E402
from afd.kernels.mla_decode import (  # noqa: E402
    BALANCE_ROWS,
    MAX_PROGRAMS,
    MAX_SPLITS,
    MIN_SPLIT_ROWS,
    compile_key,
    mla_decode,
    num_splits_for,
    split_tiles,
    warm_up_splits,
)
from afd.model.attention_side import MLAttention, rope_parameters  # noqa: E402
from afd.model.batch import Batch
from afd.model.kv_cache import PagedLatentCache  # noqa: E402
from afd.model.weights import load_model_config  # noqa: E402

# --- CPU: the interpreter, fp32, tiny shapes ---------------------------------------------------------------


@pytest.mark.parametrize("L", [1, 5, 37])
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("nh", [2, 4])
def test_kernel_equals_eager_math(nh: int, B: int, L: int) -> None:
    """Kernel == the einsum path within 1e-5 for every split count (one program per sequence, several
    splits merged by the combine kernel, splits with no valid row), with a graph-padded row when B > 1."""
    q, q_pe, cache_layer, rows, valid = make_case(B, L, nh, 32, 16, padded=1 if B > 1 else 0, seed=L * 10 + B)
    want = eager_o_latent(q, q_pe, cache_layer, rows, valid, 0.3)
    for block_n, splits in [(32, None), (16, 1), (16, 2), (16, 3)]:
        got = mla_decode(
            q, q_pe, cache_layer, rows, lengths(valid), 0.3, num_splits=splits, block_n=block_n, min_split_rows=1
        )
        assert got.shape == (B, nh, 32) and got.dtype == q.dtype
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=f"block_n={block_n}, splits={splits}")


def test_split_counts_agree() -> None:
    """A longer context with short neighbours: 1 to 7 splits of 16 rows give the same output within 1e-5
    (the short sequences' later splits hold no valid row: max -inf, sum 0, weight 0 in the combine)."""
    q, q_pe, cache_layer, rows, valid = make_case(3, 100, 4, 32, 16, block_size=4, seed=7)
    lens = lengths(valid)
    one = mla_decode(q, q_pe, cache_layer, rows, lens, 0.25, num_splits=1, block_n=16)
    torch.testing.assert_close(one, eager_o_latent(q, q_pe, cache_layer, rows, valid, 0.25), atol=1e-5, rtol=1e-5)
    for splits in range(2, 8):
        got = mla_decode(q, q_pe, cache_layer, rows, lens, 0.25, num_splits=splits, block_n=16, min_split_rows=1)
        torch.testing.assert_close(got, one, atol=1e-5, rtol=1e-5, msg=f"splits={splits}")


RAGGED = [1, 17, 130, 500]


@pytest.mark.parametrize("block_size", [1, 4, 16, 48])
def test_ragged_batch_through_block_tables(block_size: int) -> None:
    """One batch of contexts 1, 17, 130 and 500 read through its block table (pages of `block_size` rows, 48 not a
    power of two): the kernel equals the per-position reference within 1e-5 for one split, several splits (the
    short sequences leave most of theirs empty) and the default count."""
    q, q_pe, cache_layer, table, lens, rows, valid = make_ragged_case(RAGGED, 4, 32, 16, block_size=block_size, seed=5)
    want = eager_o_latent(q, q_pe, cache_layer, rows, valid, 0.3)
    for splits, min_rows in [(1, MIN_SPLIT_ROWS), (3, 1), (8, 1), (4, MIN_SPLIT_ROWS), (None, MIN_SPLIT_ROWS)]:
        got = mla_decode(
            q, q_pe, cache_layer, table, lens, 0.3, page=block_size, num_splits=splits, min_split_rows=min_rows
        )
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=f"splits={splits}, min rows={min_rows}")


@pytest.mark.parametrize("block_size", [4, 16])
def test_nan_past_a_length_never_reaches_the_output(block_size: int) -> None:
    """NaN in every cache row no sequence owns within its length (tails of last blocks, the block the table's
    unused entries name, blocks nobody owns): every output is finite and equals the reference, whether the
    kernel reads the block table or per-position rows, with one split or several."""
    case = make_ragged_case(RAGGED, 4, 32, 16, block_size=block_size, poison=True, seed=9)
    q, q_pe, cache_layer, table, lens, rows, valid = case
    assert cache_layer.isnan().any()
    want = eager_o_latent(q, q_pe, cache_layer, rows, valid, 0.3)
    assert torch.isfinite(want).all()
    for t, page in ((table, block_size), (rows, 1)):
        for splits in (1, 4):
            got = mla_decode(q, q_pe, cache_layer, t, lens, 0.3, page=page, num_splits=splits, min_split_rows=1)
            assert torch.isfinite(got).all(), (page, splits)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_n", [16, 32])
def test_split_tiles_cover_each_sequence_once(block_n: int) -> None:
    """For every length and split count: the splits' tile ranges, in order, are exactly the sequence's tiles;
    the live ones come first and, but for the last, hold at least `min_split_rows` rows; none reaches past the
    sequence (so a short sequence leaves its later splits empty)."""
    for min_rows in (1, MIN_SPLIT_ROWS):
        for length in [0, 1, 15, 16, 17, 63, 64, 65, 130, 500, 3584]:
            for splits in (1, 2, 3, 4, 8, 64):
                shares = split_tiles(length, splits, block_n, min_rows)
                tiles = -(-length // block_n)
                assert len(shares) == splits
                assert [t for r in shares for t in r] == list(range(tiles))
                live = [r for r in shares if len(r)]
                assert shares[: len(live)] == live
                assert all(len(r) * block_n >= min(min_rows, length) for r in live[:-1])
    assert split_tiles(500, 4, 32) == [range(0, 4), range(4, 8), range(8, 12), range(12, 16)]
    assert split_tiles(100, 8, 32) == [range(0, 2), range(2, 4)] + [range(4, 4)] * 6  # two tiles at least
    assert split_tiles(1, 4, 32) == [range(0, 1)] + [range(1, 1)] * 3
    assert split_tiles(0, 2, 32) == [range(0, 0)] * 2


@pytest.mark.parametrize(("C", "R"), [(24, 8), (16, 16), (64, 32)])
def test_sizes_padded_to_a_power_of_two(C: int, R: int) -> None:
    """C and R that are not powers of two >= 16 (the `tiny` preset has R = 8) are padded in registers only."""
    q, q_pe, cache_layer, rows, valid = make_case(2, 9, 3, C, R, block_size=4, seed=C + R)
    got = mla_decode(q, q_pe, cache_layer, rows, lengths(valid), 0.2, num_splits=2, block_n=16, min_split_rows=1)
    torch.testing.assert_close(got, eager_o_latent(q, q_pe, cache_layer, rows, valid, 0.2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_h", [16, 32])
def test_more_heads_than_one_tile(block_h: int) -> None:
    """nh = 40: three head tiles of 16 (or two of 32, the V3 configuration), the last one partly masked."""
    q, q_pe, cache_layer, rows, valid = make_case(2, 7, 40, 16, 16, seed=3)
    want = eager_o_latent(q, q_pe, cache_layer, rows, valid, 0.2)
    for splits in (1, 2):
        got = mla_decode(
            q, q_pe, cache_layer, rows, lengths(valid), 0.2, num_splits=splits, block_n=16, block_h=block_h
        )
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_fp16_takes_the_16_bit_configuration() -> None:
    """fp16 (the interpreter is exact for it, unlike bf16): 32-row tiles, the default dot precision, fp16
    probabilities in the second product; within fp16 rounding of the fp32 reference, as the eager fp16 path."""
    q, q_pe, cache_layer, rows, valid = make_case(3, 45, 4, 32, 16, dtype=torch.float16, padded=1, seed=11)
    ref = eager_o_latent(q, q_pe, cache_layer, rows, valid, 0.3, upcast=True)
    eager_err = (eager_o_latent(q, q_pe, cache_layer, rows, valid, 0.3).float() - ref).abs().max().item()
    for splits in (None, 2):
        got = mla_decode(q, q_pe, cache_layer, rows, lengths(valid), 0.3, num_splits=splits, min_split_rows=1)
        assert got.dtype == torch.float16
        err = (got.float() - ref).abs().max().item()
        assert err <= 2e-3 and err <= 2 * eager_err + 5e-4, (err, eager_err)


def test_empty_batch_and_empty_context() -> None:
    q, q_pe, cache_layer, rows, valid = make_case(2, 3, 2, 32, 16)
    lens = lengths(valid)
    got = mla_decode(q[:0], q_pe[:0], cache_layer, rows[:0], lens[:0], 0.3)
    assert got.shape == (0, 2, 32)
    got = mla_decode(q, q_pe, cache_layer, rows[:, :0], lens * 0, 0.3)
    torch.testing.assert_close(got, eager_o_latent(q, q_pe, cache_layer, rows[:, :0], valid[:, :0], 0.3))
    for splits in (1, 2):  # a zero length inside a table: zeros, not NaN
        got = mla_decode(q, q_pe, cache_layer, rows, lens * 0, 0.3, num_splits=splits)
        assert torch.equal(got, torch.zeros_like(got))


def test_the_warm_up_splits_reach_every_variant_a_launch_can_compile() -> None:
    """Every split count a launch can have falls on a compiled variant the warm-up made (the table's width, the
    page size and the lengths are not specialized on)."""
    made = {compile_key(s) for s in warm_up_splits()}
    needed = {compile_key(s) for s in range(1, MAX_SPLITS + 1)}
    assert needed == made and len(made) == len(warm_up_splits()) == 7  # direct, and 2, 4, ..., 64 padded


def test_the_warm_up_launches_each_variant_and_reads_only(monkeypatch: pytest.MonkeyPatch) -> None:
    q, q_pe, cache_layer, _, _ = make_case(1, 2, 2, 32, 16)
    before = cache_layer.clone()
    launched = []

    def spy(q_latent, q_pe, cache_layer, table, lens, scale, *, num_splits):
        launched.append(num_splits)
        out = mla_decode(q_latent, q_pe, cache_layer, table, lens, scale, num_splits=num_splits)
        assert torch.isfinite(out).all()
        return out

    monkeypatch.setattr(mla_decode_module, "mla_decode", spy)
    mla_decode_module.warm_up(q, q_pe, cache_layer, 0.3)
    assert launched == warm_up_splits()
    assert torch.equal(cache_layer, before)


def test_num_splits_depend_on_shapes_only() -> None:
    """Until the batch fills the SMs: enough splits to fill them once, each >= MIN_SPLIT_ROWS rows, at most
    MAX_SPLITS. Once it does: chunks of BALANCE_ROWS rows, within MAX_PROGRAMS programs."""
    assert num_splits_for(64, 1, 512, 132) == (4, MIN_SPLIT_ROWS)  # 3 to fill 132 SMs, rounded up to a power of two
    assert num_splits_for(8, 1, 512, 132) == (512 // MIN_SPLIT_ROWS, MIN_SPLIT_ROWS)
    assert num_splits_for(1, 1, 4096, 132) == (MAX_SPLITS, MIN_SPLIT_ROWS)
    assert num_splits_for(1, 4, 4096, 132) == (MAX_SPLITS, MIN_SPLIT_ROWS)  # 33 -> 64
    assert num_splits_for(4, 1, 1, 132) == (1, MIN_SPLIT_ROWS)
    assert num_splits_for(0, 1, 100, 132) == (1, MIN_SPLIT_ROWS)
    assert num_splits_for(256, 1, 512, 132) == (1, BALANCE_ROWS)  # one chunk holds every context: one split
    assert num_splits_for(256, 1, 3600, 132) == (4, BALANCE_ROWS)  # a 3,584-token context in four chunks
    assert num_splits_for(132, 1, 4096, 132) == (4, BALANCE_ROWS)
    assert num_splits_for(512, 1, 4096, 132) == (2, BALANCE_ROWS)
    assert num_splits_for(256, 1, 163840, 132) == (MAX_PROGRAMS // 256, BALANCE_ROWS)  # the grid's bound
    assert num_splits_for(4096, 1, 163840, 132) == (1, BALANCE_ROWS)


def test_a_sequence_read_by_one_split_writes_its_output_in_a_split_grid() -> None:
    """With several splits in the grid but a share of two tiles, the short sequences have one live split (it
    normalises and writes the output itself, the combine leaves it), the long ones several (merged by the combine),
    the empty one zeros: every row as the eager path's."""
    q, q_pe, cache_layer, rows, valid = make_case(5, 100, 4, 32, 16, seed=5)
    for b, length in enumerate([0, 5, 16, 33, 100]):
        valid[b] = torch.arange(valid.shape[1]) < length
    lens = lengths(valid)
    assert [len([r for r in split_tiles(n, 4, 16, 32) if r]) for n in lens.tolist()] == [0, 1, 1, 2, 4]
    got = mla_decode(q, q_pe, cache_layer, rows, lens, 0.3, num_splits=4, block_n=16, min_split_rows=32)
    want = eager_o_latent(q, q_pe, cache_layer, rows, valid, 0.3)
    torch.testing.assert_close(got[1:], want[1:], atol=1e-5, rtol=1e-5)
    assert torch.equal(got[0], torch.zeros_like(got[0]))


def _tiny_attention(seed: int = 0, poison: bool = False) -> tuple[MLAttention, PagedLatentCache, Batch, torch.Tensor]:
    """The `tiny` preset's attention (4 heads, C 32, R 8) over a real paged cache of 4-token blocks, three
    decodes whose contexts (9, 2, 13 tokens) span 1 to 4 blocks. `poison`: every row past a sequence's context
    (this step's token included) and every block nobody holds is NaN."""
    torch.manual_seed(seed)
    config = load_model_config("tiny")
    attn = MLAttention(config, 1, rope_parameters(config)[2])
    cache = PagedLatentCache(config, num_blocks=24, block_size=4, max_num_seqs=4, dtype=torch.float32, device="cpu")
    contexts = [9, 2, 13]
    slots = [cache.allocate(n + 3) for n in contexts]  # two spare rows past each context
    cache.cache[:, cache.block_size :].normal_()  # every row but the null block's: old context
    if poison:  # only what each sequence holds up to its length is real
        cache.cache[:, cache.block_size :] = float("nan")
        for slot, n in zip(slots, contexts, strict=True):
            blocks = cache._blocks[slot]
            owned = [blocks[p // 4] * 4 + p % 4 for p in range(n + 1)]
            cache.cache[:, owned] = torch.randn(config.num_hidden_layers, len(owned), cache.cache.shape[-1])
    batch = Batch(slots=slots, query_lens=[1] * 3, context_lens=contexts, batch_decodes=True)
    cache.prepare(batch)
    return attn, cache, batch, torch.tensor(contexts)


def _rope(attn: MLAttention, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq, factor, _ = rope_parameters(attn.config)
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, R/2]
    return freqs.cos() * factor, freqs.sin() * factor


def _no_gather(*args, **kwargs):
    raise AssertionError("the kernel path must not gather the context (PagedLatentCache.read)")


def test_decode_attention_takes_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """`MLAttention.forward` on a batched decode step: with kernels enabled it never gathers the context and
    equals the einsum path within 1e-5 (the paged cache's rows across block boundaries)."""
    attn, cache, batch, positions = _tiny_attention()
    x = torch.randn(3, attn.config.hidden_size)
    cos, sin = _rope(attn, positions)
    with torch.no_grad():
        want = attn(x, cos, sin, batch, cache)  # CPU: kernels.enabled is False
        monkeypatch.setattr(kernels, "enabled", lambda device: True)
        monkeypatch.setattr(cache, "read", _no_gather)
        got = attn(x, cos, sin, batch, cache)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_nan_in_the_paged_cache_past_each_length_stays_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batched decode over a cache whose rows past each sequence's length hold NaN: the kernel path is
    finite and equals the einsum path (which reads the zero row there)."""
    attn, cache, batch, positions = _tiny_attention(seed=2, poison=True)
    assert cache.cache.isnan().any()
    x = torch.randn(3, attn.config.hidden_size)
    cos, sin = _rope(attn, positions)
    with torch.no_grad():
        want = attn(x, cos, sin, batch, cache)
        monkeypatch.setattr(kernels, "enabled", lambda device: True)
        got = attn(x, cos, sin, batch, cache)
    assert torch.isfinite(want).all() and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_graph_padded_step_takes_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA-graph runner's layout (`fill_static_inputs`: batch padded 3 -> 4 into static tables as wide as
    the cache's, the padding row a length-1 context on the null block) through the batch a graph captures (its
    host-side contexts all 0: the kernel reads only the device lengths): real rows equal the unpadded einsum step."""
    attn, cache, batch, positions = _tiny_attention(seed=1)
    x = torch.randn(3, attn.config.hidden_size)
    cos, sin = _rope(attn, positions)
    n, W = 4, cache.block_tables.shape[1]
    static = StaticInputs(
        input_ids=torch.zeros(n, dtype=torch.long),
        positions=torch.zeros(n, dtype=torch.long),
        slot_mapping=torch.zeros(n, dtype=torch.long),
        token_rows=torch.arange(n),
        tables=torch.full((n, W), 7, dtype=torch.long),  # stale entries: never read past a length
        lens=torch.zeros(n, dtype=torch.int32),
    )
    fill_static_inputs(
        static,
        torch.zeros(3, dtype=torch.long),
        positions,
        batch.slot_mapping,
        batch.decode_tables,
        batch.decode_lens,
        scratch_row=cache.scratch_row,
    )
    padded_batch = static.batch()
    x_padded = torch.cat([x, torch.zeros(1, x.shape[1])])
    cos_p, sin_p = _rope(attn, static.positions)
    with torch.no_grad():
        want = attn(x, cos, sin, batch, cache)
        monkeypatch.setattr(kernels, "enabled", lambda device: True)
        monkeypatch.setattr(cache, "read", _no_gather)
        got = attn(x_padded, cos_p, sin_p, padded_batch, cache)
    torch.testing.assert_close(got[:3], want, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(got[3]).all()
