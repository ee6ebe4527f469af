"""The GPU half of tests/kernels/test_kernel_mla_decode.py: bf16, real model shapes, graphs and host syncs."""

from __future__ import annotations

import json
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")


from helpers.kernels_mla_decode import eager_o_latent, lengths, make_case, make_ragged_case

from afd import kernels  # noqa: E402
from afd.kernels.mla_decode import (  # noqa: E402
    mla_decode,
)
from afd.model.attention_side import MLAttention, rope_parameters  # noqa: E402
from afd.model.batch import Batch
from afd.model.kv_cache import PagedLatentCache, decode_context  # noqa: E402
from afd.model.weights import load_model_config  # noqa: E402

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# DeepSeek-V2-Lite: 16 heads, kv_lora_rank 512, qk_rope_head_dim 64, softmax scale 1/sqrt(128 + 64).
LITE_HEADS, LITE_C, LITE_R, LITE_SCALE = 16, 512, 64, 192**-0.5


# --- GPU: bf16, DeepSeek-V2-Lite shapes ---------------------------------------------------------------------

# bf16 kernel vs the fp32 reference computed from the same bf16 inputs: the probabilities enter the second
# product in bf16 (as in the eager path) and the output is rounded to bf16 (|o| <~ 1): 1e-2 covers both.
BF16_TOL = 1e-2


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("L", [512, 4096])
@pytest.mark.parametrize("B", [1, 8, 64, 256])
def test_gpu_lite_bf16_against_fp32_reference(B: int, L: int) -> None:
    """V2-Lite shapes, bf16, paged blocks of 16, varied lengths and graph-padded rows: the kernel is within
    1e-2 of the fp32 reference (and no worse than twice the eager bf16 path's own error + 2e-3), and two runs
    give the same bits."""
    case = make_case(B, L, LITE_HEADS, LITE_C, LITE_R, dtype=torch.bfloat16, device="cuda", padded=B // 8, seed=B + L)
    q, q_pe, cache_layer, rows, valid = case
    got = mla_decode(q, q_pe, cache_layer, rows, lengths(valid), LITE_SCALE)
    again = mla_decode(q, q_pe, cache_layer, rows, lengths(valid), LITE_SCALE)
    ref = eager_o_latent(*case, LITE_SCALE, upcast=True)
    eager = eager_o_latent(*case, LITE_SCALE)
    err = (got.float() - ref).abs().max().item()
    eager_err = (eager.float() - ref).abs().max().item()
    print(json.dumps({"B": B, "L": L, "kernel_max_abs_err": err, "eager_bf16_max_abs_err": eager_err}))
    assert got.dtype == torch.bfloat16 and got.shape == (B, LITE_HEADS, LITE_C)
    torch.testing.assert_close(got.float(), ref, atol=BF16_TOL, rtol=BF16_TOL)
    assert err <= 2 * eager_err + 2e-3, (err, eager_err)
    assert torch.equal(got, again), "two runs of the same shapes must give the same bits"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(("B", "L"), [(1, 4096), (8, 512), (64, 4096), (256, 512)])
def test_gpu_cuda_graph_replay_equals_eager(B: int, L: int) -> None:
    """Captured once, replayed on new inputs (new lengths included) copied into the static buffers: the same bits
    as an eager call (split + combine for B < #SMs, one direct kernel at 256)."""
    q, q_pe, cache_layer, rows, valid = make_case(
        B, L, LITE_HEADS, LITE_C, LITE_R, dtype=torch.bfloat16, device="cuda", padded=B // 8, seed=1
    )
    static = [t.clone() for t in (q, q_pe, rows, lengths(valid))]
    mla_decode(static[0], static[1], cache_layer, static[2], static[3], LITE_SCALE)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mla_decode(static[0], static[1], cache_layer, static[2], static[3], LITE_SCALE)
    q2, q_pe2, _, rows2, valid2 = make_case(
        B, L, LITE_HEADS, LITE_C, LITE_R, dtype=torch.bfloat16, device="cuda", padded=B // 8, seed=2
    )
    for buf, new in zip(static, (q2, q_pe2, rows2, lengths(valid2)), strict=True):
        buf.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, mla_decode(q2, q_pe2, cache_layer, rows2, lengths(valid2), LITE_SCALE))
    torch.testing.assert_close(
        out.float(),
        eager_o_latent(q2, q_pe2, cache_layer, rows2, valid2, LITE_SCALE, upcast=True),
        atol=BF16_TOL,
        rtol=BF16_TOL,
    )


@pytest.mark.gpu
@gpu
def test_gpu_v3_heads_and_fp32() -> None:
    """128 heads (DeepSeek-V3: four head tiles of 32) in bf16, and fp32 inputs (exact fp32 products, no tf32)
    within 1e-4 of the fp32 einsum path."""
    case = make_case(4, 1000, 128, LITE_C, LITE_R, dtype=torch.bfloat16, device="cuda", q_std=0.5, seed=5)
    got = mla_decode(*case[:4], lengths(case[4]), LITE_SCALE)
    torch.testing.assert_close(
        got.float(), eager_o_latent(*case, LITE_SCALE, upcast=True), atol=BF16_TOL, rtol=BF16_TOL
    )
    case = make_case(8, 700, LITE_HEADS, LITE_C, LITE_R, device="cuda", q_std=0.5, seed=6)
    got = mla_decode(*case[:4], lengths(case[4]), LITE_SCALE)
    torch.testing.assert_close(got, eager_o_latent(*case, LITE_SCALE), atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("B", [1, 8, 64])
def test_gpu_decode_attention_kernel_vs_eager(monkeypatch: pytest.MonkeyPatch, B: int) -> None:
    """`MLAttention._decode_attention` with V2-Lite weights shapes in bf16 over a real paged cache: the kernel
    path and the einsum path (`kernels.enabled` forced off) agree, and the kernel is no further from the
    fp32 module than the einsum path is (2x its error + 2e-3)."""
    torch.manual_seed(B)
    config = load_model_config("deepseek-v2-lite")
    scale = rope_parameters(config)[2]
    attn = MLAttention(config, 0, scale).to("cuda", torch.bfloat16)
    contexts = torch.randint(1, 600, (B,)).tolist()
    cache = PagedLatentCache(
        config, num_blocks=B * 40, block_size=16, max_num_seqs=B, dtype=torch.bfloat16, device="cuda"
    )
    cache.cache[0, cache.block_size :].normal_()
    slots = [cache.allocate(n + 1) for n in contexts]
    batch = Batch(slots=slots, query_lens=[1] * B, context_lens=contexts, batch_decodes=True)  # B = 1 batched too
    cache.prepare(batch)
    q_nope = torch.randn(B, config.num_attention_heads, config.qk_nope_head_dim, device="cuda", dtype=torch.bfloat16)
    q_pe = torch.randn(B, config.num_attention_heads, config.qk_rope_head_dim, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        assert kernels.enabled(q_nope.device)
        context = decode_context(batch, cache.block_size)
        got = attn._decode_attention(q_nope, q_pe, cache, context)
        monkeypatch.setattr(kernels, "enabled", lambda device: False)
        eager = attn._decode_attention(q_nope, q_pe, cache, context)
        attn32 = attn.float()
        cache.cache = cache.cache.float()
        ref = attn32._decode_attention(q_nope.float(), q_pe.float(), cache, context)
    err = (got.float() - ref).abs().max().item()
    eager_err = (eager.float() - ref).abs().max().item()
    print(json.dumps({"B": B, "kernel_max_abs_err": err, "eager_bf16_max_abs_err": eager_err}))
    assert err <= 2 * eager_err + 2e-3, (err, eager_err)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("block_size", [16, 64])
def test_gpu_ragged_bf16_through_block_tables(block_size: int) -> None:
    """V2-Lite shapes, bf16, a batch alternating contexts of 512 and 3584 (plus 1 and 17) read through block
    tables, NaN past every length: within 1e-2 of the fp32 reference, finite, the same bits twice, and a
    CUDA-graph replay with new lengths equals an eager call."""
    lens = [512, 3584] * 6 + [1, 17]
    case = make_ragged_case(lens, LITE_HEADS, LITE_C, LITE_R, block_size=block_size, dtype=torch.bfloat16,
                            device="cuda", poison=True, seed=block_size)  # fmt: skip
    q, q_pe, cache_layer, table, lens_t, rows, valid = case
    got = mla_decode(q, q_pe, cache_layer, table, lens_t, LITE_SCALE, page=block_size)
    ref = eager_o_latent(q, q_pe, cache_layer, rows, valid, LITE_SCALE, upcast=True)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), ref, atol=BF16_TOL, rtol=BF16_TOL)
    assert torch.equal(got, mla_decode(q, q_pe, cache_layer, table, lens_t, LITE_SCALE, page=block_size))
    static_lens = lens_t.clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mla_decode(q, q_pe, cache_layer, table, static_lens, LITE_SCALE, page=block_size)
    static_lens.copy_((lens_t // 3).clamp(min=1))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, mla_decode(q, q_pe, cache_layer, table, static_lens, LITE_SCALE, page=block_size))
