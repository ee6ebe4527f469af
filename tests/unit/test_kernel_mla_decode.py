"""The Triton MLA decode kernel (`afd.kernels.mla_decode`) against the eager absorbed attention it replaces.

CPU (Triton's interpreter, fp32, tiny shapes): the kernel equals the einsum math of
`MLAttention._decode_attention` within 1e-5, for every split count, with padded rows pointing at the zero
row (the CUDA-graph layout) and contexts spanning several blocks of a real `PagedLatentCache`; the model's
decode path takes the kernel without gathering the context. GPU (`-m gpu`, bf16, DeepSeek-V2-Lite shapes):
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


from helpers.kernels_mla_decode import eager_o_latent, make_case

from afd import kernels  # noqa: E402
from afd.engine.graphs.decode import StaticInputs, fill_static_inputs  # noqa: E402
from afd.kernels import mla_decode as mla_decode_module  # noqa: E402
from afd.kernels.mla_decode import (  # noqa: E402
    MAX_SPLITS,
    MIN_SPLIT_ROWS,
    compile_key,
    mla_decode,
    num_splits_for,
    split_rows,
    warm_up_shapes,
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
        got = mla_decode(q, q_pe, cache_layer, rows, valid, 0.3, num_splits=splits, block_n=block_n)
        assert got.shape == (B, nh, 32) and got.dtype == q.dtype
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=f"block_n={block_n}, splits={splits}")


def test_split_counts_agree() -> None:
    """A longer context with short neighbours: 1 to 7 splits of 16 rows give the same output within 1e-5
    (the short sequences' later splits hold no valid row: max -inf, sum 0, weight 0 in the combine)."""
    q, q_pe, cache_layer, rows, valid = make_case(3, 100, 4, 32, 16, block_size=4, seed=7)
    one = mla_decode(q, q_pe, cache_layer, rows, valid, 0.25, num_splits=1, block_n=16)
    torch.testing.assert_close(one, eager_o_latent(q, q_pe, cache_layer, rows, valid, 0.25), atol=1e-5, rtol=1e-5)
    for splits in range(2, 8):
        got = mla_decode(q, q_pe, cache_layer, rows, valid, 0.25, num_splits=splits, block_n=16)
        torch.testing.assert_close(got, one, atol=1e-5, rtol=1e-5, msg=f"splits={splits}")


@pytest.mark.parametrize(("C", "R"), [(24, 8), (16, 16), (64, 32)])
def test_sizes_padded_to_a_power_of_two(C: int, R: int) -> None:
    """C and R that are not powers of two >= 16 (the `tiny` preset has R = 8) are padded in registers only."""
    q, q_pe, cache_layer, rows, valid = make_case(2, 9, 3, C, R, block_size=4, seed=C + R)
    got = mla_decode(q, q_pe, cache_layer, rows, valid, 0.2, num_splits=2, block_n=16)
    torch.testing.assert_close(got, eager_o_latent(q, q_pe, cache_layer, rows, valid, 0.2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_h", [16, 32])
def test_more_heads_than_one_tile(block_h: int) -> None:
    """nh = 40: three head tiles of 16 (or two of 32, the V3 configuration), the last one partly masked."""
    q, q_pe, cache_layer, rows, valid = make_case(2, 7, 40, 16, 16, seed=3)
    want = eager_o_latent(q, q_pe, cache_layer, rows, valid, 0.2)
    for splits in (1, 2):
        got = mla_decode(q, q_pe, cache_layer, rows, valid, 0.2, num_splits=splits, block_n=16, block_h=block_h)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_fp16_takes_the_16_bit_configuration() -> None:
    """fp16 (the interpreter is exact for it, unlike bf16): 32-row tiles, the default dot precision, fp16
    probabilities in the second product; within fp16 rounding of the fp32 reference, as the eager fp16 path."""
    q, q_pe, cache_layer, rows, valid = make_case(3, 45, 4, 32, 16, dtype=torch.float16, padded=1, seed=11)
    ref = eager_o_latent(q, q_pe, cache_layer, rows, valid, 0.3, upcast=True)
    eager_err = (eager_o_latent(q, q_pe, cache_layer, rows, valid, 0.3).float() - ref).abs().max().item()
    for splits in (None, 2):
        got = mla_decode(q, q_pe, cache_layer, rows, valid, 0.3, num_splits=splits)
        assert got.dtype == torch.float16
        err = (got.float() - ref).abs().max().item()
        assert err <= 2e-3 and err <= 2 * eager_err + 5e-4, (err, eager_err)


def test_empty_batch_and_empty_context() -> None:
    q, q_pe, cache_layer, rows, valid = make_case(2, 3, 2, 32, 16)
    got = mla_decode(q[:0], q_pe[:0], cache_layer, rows[:0], valid[:0], 0.3)
    assert got.shape == (0, 2, 32)
    got = mla_decode(q, q_pe, cache_layer, rows[:, :0], valid[:, :0], 0.3)
    torch.testing.assert_close(got, eager_o_latent(q, q_pe, cache_layer, rows[:, :0], valid[:, :0], 0.3))


@pytest.mark.parametrize("block_n", [16, 32])
def test_the_warm_up_shapes_reach_every_variant_a_launch_can_compile(block_n: int) -> None:
    """Every (context, asked splits) a server can launch with falls on a compiled variant the warm-up made, and
    each warm-up shape gives the split count it stands for."""
    shapes = warm_up_shapes(block_n)
    assert all(split_rows(context, s, block_n)[1] == s for context, s in shapes)
    made = {compile_key(context, s) for context, s in shapes}
    needed = {compile_key(L, split_rows(L, s, block_n)[1]) for L in range(1, 4200) for s in range(1, MAX_SPLITS + 1)}
    assert needed <= made and len(needed) == 21  # 3 direct, and 2 context kinds x 9 split classes


def test_the_warm_up_launches_each_shape_and_reads_only(monkeypatch: pytest.MonkeyPatch) -> None:
    q, q_pe, cache_layer, _, _ = make_case(1, 2, 2, 32, 16)
    before = cache_layer.clone()
    launched = []

    def spy(q_latent, q_pe, cache_layer, rows, valid, scale, *, num_splits):
        launched.append((rows.shape[1], num_splits))
        out = mla_decode(q_latent, q_pe, cache_layer, rows, valid, scale, num_splits=num_splits)
        assert torch.isfinite(out).all()
        return out

    monkeypatch.setattr(mla_decode_module, "mla_decode", spy)
    mla_decode_module.warm_up(q, q_pe, cache_layer, 0.3)
    assert launched == warm_up_shapes(16)  # fp32: 16-row tiles
    assert torch.equal(cache_layer, before)


def test_num_splits_depend_on_shapes_only() -> None:
    """Enough programs to fill the SMs once, each split >= MIN_SPLIT_ROWS rows, at most MAX_SPLITS."""
    assert num_splits_for(256, 1, 4096, 132) == 1  # the batch fills the GPU alone
    assert num_splits_for(132, 1, 4096, 132) == 1
    assert num_splits_for(64, 1, 512, 132) == 4  # 3 to fill 132 SMs, rounded up to a power of two
    assert num_splits_for(8, 1, 512, 132) == 512 // MIN_SPLIT_ROWS
    assert num_splits_for(1, 1, 4096, 132) == MAX_SPLITS
    assert num_splits_for(1, 4, 4096, 132) == MAX_SPLITS  # 33 -> 64
    assert num_splits_for(4, 1, 1, 132) == 1
    assert num_splits_for(0, 1, 100, 132) == 1


def _tiny_attention(seed: int = 0) -> tuple[MLAttention, PagedLatentCache, Batch, torch.Tensor]:
    """The `tiny` preset's attention (4 heads, C 32, R 8) over a real paged cache of 4-token blocks, three
    decodes whose contexts (9, 2, 13 tokens) span 1 to 4 blocks."""
    torch.manual_seed(seed)
    config = load_model_config("tiny")
    attn = MLAttention(config, 1, rope_parameters(config)[2])
    cache = PagedLatentCache(config, num_blocks=24, block_size=4, max_num_seqs=4, dtype=torch.float32, device="cpu")
    cache.cache[:, cache.block_size :].normal_()  # every row but the null block's: old context
    contexts = [9, 2, 13]
    batch = Batch(slots=[cache.allocate(n + 1) for n in contexts], query_lens=[1] * 3, context_lens=contexts)
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


def test_graph_padded_step_takes_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA-graph runner's layout (`fill_static_inputs`: batch padded 3 -> 4, context 14 -> 20 rows,
    the padding row valid only at column 0 on the zero row): real rows equal the unpadded einsum step."""
    attn, cache, batch, positions = _tiny_attention(seed=1)
    x = torch.randn(3, attn.config.hidden_size)
    cos, sin = _rope(attn, positions)
    n, L = 4, 20
    static = StaticInputs(
        input_ids=torch.zeros(n, dtype=torch.long),
        positions=torch.zeros(n, dtype=torch.long),
        slot_mapping=torch.zeros(n, dtype=torch.long),
        token_rows=torch.arange(n),
        rows=torch.zeros(n, L, dtype=torch.long),
        valid=torch.zeros(n, L, dtype=torch.bool),
    )
    fill_static_inputs(
        static,
        torch.zeros(3, dtype=torch.long),
        positions,
        batch.slot_mapping,
        batch.decode_rows,
        batch.decode_valid,
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
