"""The GPU half of tests/kernels/test_kernel_prefill_attention.py: bf16 and real model shapes on CUDA, graphs."""

from __future__ import annotations

import copy
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")


from helpers.kernels_prefill_attention import (
    STEPS,
    _attention_and_step,
    cu_seqlens,
    expand_k,
    random_inputs,
    sdpa_reference,
)

from afd.kernels.prefill_attention import prefill_attention  # noqa: E402
from afd.model.weights import load_model_config  # noqa: E402

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# bf16 on the GPU, against fp32 SDPA on the same (bf16-rounded) inputs: the kernel rounds the probabilities
# to bf16 before P @ V and its output to bf16 (half an ulp is 2^-9 of the value). Both bounds hold the
# kernel to no worse than eager bf16 SDPA's own error on the same inputs (times 2, plus an ulp's slack).
BF16_ULP = 2.0**-8


# --- GPU -----------------------------------------------------------------------------------------------

LITE = {"nh": 16, "dn": 128, "dr": 64, "dv": 128, "scale": 192**-0.5}
GPU_CASES = {"8x1024": ([1024] * 8, [0] * 8), "mixed": ([3000, 17, 512], [0, 0, 1024])}


def _errors(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    diff = (got.float() - want.float()).abs()
    return diff.max().item(), diff.mean().item()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", GPU_CASES.values(), ids=GPU_CASES.keys())
def test_gpu_bf16_lite_shapes(case) -> None:
    """bf16, nh 16, Dqk 192 = 128 + 64, Dv 128: the kernel's error against fp32 SDPA (same bf16 inputs,
    upcast) is at most twice eager bf16 SDPA's own error, plus one bf16 ulp of the largest output (max) or a
    quarter ulp of the mean output (mean)."""
    query_lens, context_lens = case
    gen = torch.Generator().manual_seed(0)
    key_lens, q, k_nope, k_rope, v = random_inputs(
        query_lens, context_lens, LITE["nh"], LITE["dn"], LITE["dr"], LITE["dv"], torch.bfloat16, "cuda", gen
    )
    k = expand_k(k_nope, k_rope)
    exact = sdpa_reference(q.float(), k.float(), v.float(), query_lens, key_lens, LITE["scale"])
    eager = sdpa_reference(q, k, v, query_lens, key_lens, LITE["scale"])
    got = prefill_attention(
        q,
        k_nope,
        k_rope,
        v,
        cu_seqlens(query_lens, "cuda"),
        cu_seqlens(key_lens, "cuda"),
        max(query_lens),
        LITE["scale"],
    )
    got_max, got_mean = _errors(got, exact)
    eager_max, eager_mean = _errors(eager, exact)
    print(f"bf16 {case}: kernel max {got_max:.3g} mean {got_mean:.3g}; eager max {eager_max:.3g} mean {eager_mean:.3g}")
    assert got_max <= 2 * eager_max + BF16_ULP * exact.abs().max().item()
    assert got_mean <= 2 * eager_mean + BF16_ULP / 4 * exact.abs().mean().item()


@pytest.mark.gpu
@gpu
def test_gpu_fp32_is_exact() -> None:
    """fp32 inputs take IEEE dots (no TF32, whose error would be ~1e-3): within 2e-5 of fp32 SDPA at V2-Lite
    head shapes."""
    query_lens, context_lens = [300, 1, 77], [0, 200, 50]
    gen = torch.Generator().manual_seed(1)
    key_lens, q, k_nope, k_rope, v = random_inputs(
        query_lens, context_lens, 16, 128, 64, 128, torch.float32, "cuda", gen
    )
    got = prefill_attention(
        q, k_nope, k_rope, v, cu_seqlens(query_lens, "cuda"), cu_seqlens(key_lens, "cuda"), 300, LITE["scale"]
    )
    want = sdpa_reference(q, expand_k(k_nope, k_rope), v, query_lens, key_lens, LITE["scale"])
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


@pytest.mark.gpu
@gpu
def test_gpu_cuda_graph_capture_and_replay() -> None:
    """The launch is capturable (no host reads): a captured call replayed on new inputs equals an eager call."""
    query_lens, context_lens = [100, 37, 1], [0, 64, 20]
    gen = torch.Generator().manual_seed(2)
    key_lens, q, k_nope, k_rope, v = random_inputs(
        query_lens, context_lens, 16, 128, 64, 128, torch.bfloat16, "cuda", gen
    )
    cu_q, cu_k = cu_seqlens(query_lens, "cuda"), cu_seqlens(key_lens, "cuda")
    out = torch.empty(q.shape[0], 16, 128, dtype=torch.bfloat16, device="cuda")

    def run() -> torch.Tensor:
        return prefill_attention(q, k_nope, k_rope, v, cu_q, cu_k, 100, LITE["scale"], out=out)

    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for t in (q, k_nope, k_rope, v):
        t.copy_(torch.randn(t.shape, generator=gen).to(t))
    graph.replay()
    replayed = out.clone()
    eager = prefill_attention(q, k_nope, k_rope, v, cu_q, cu_k, 100, LITE["scale"])
    assert torch.equal(replayed, eager)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("step", STEPS.values(), ids=STEPS.keys())
def test_gpu_model_kernel_path_lite(step) -> None:
    """The model's kernel path at DeepSeek-V2-Lite attention shapes (steps 40x longer, contexts 50x), bf16:
    against the SDPA loop run in fp32 on the same bf16 values, its error is at most twice the bf16 SDPA
    loop's own, plus one bf16 ulp of the largest output (max) or a quarter ulp of the mean output (mean)."""
    config = load_model_config("deepseek-v2-lite")
    query_lens = [n * 40 if n > 1 else 1 for n in step[0]]
    context_lens = [ctx * 50 for ctx in step[1]]
    attn, cache, batch, q, kv_c, k_pe = _attention_and_step(config, torch.bfloat16, "cuda", query_lens, context_lens)
    seqs = [i for i in range(len(batch.query_lens)) if i not in set(batch.decode_seqs)]
    attn32, cache32 = copy.deepcopy(attn).float(), copy.copy(cache)
    cache32.cache = cache.cache.float()
    shape = (q.shape[0], config.num_attention_heads, config.v_head_dim)
    exact = torch.zeros(shape, device="cuda")
    attn32._prefill_attention_sdpa(exact, q.float(), kv_c.float(), k_pe.float(), batch, cache32, seqs)
    eager = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
    got = eager.clone()
    attn._prefill_attention_sdpa(eager, q, kv_c, k_pe, batch, cache, seqs)
    attn._prefill_attention_varlen(got, q, kv_c, k_pe, batch, cache, seqs)
    got_max, got_mean = _errors(got, exact)
    eager_max, eager_mean = _errors(eager, exact)
    print(
        f"model {step}: kernel max {got_max:.3g} mean {got_mean:.3g}; eager max {eager_max:.3g} mean {eager_mean:.3g}"
    )
    assert got_max <= 2 * eager_max + BF16_ULP * exact.abs().max().item()
    assert got_mean <= 2 * eager_mean + BF16_ULP / 4 * exact.abs().mean().item()
