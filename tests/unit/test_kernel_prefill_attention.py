"""The varlen MLA prefill attention kernel (afd.kernels.prefill_attention) against per-sequence SDPA.

CPU: Triton's interpreter, fp32, tiny shapes, within 1e-5 — the kernel alone (fresh prompts, chunks after
cached context, lone decodes, tiles not multiples of the block, padding rows, empty inputs) and
`MLAttention`'s kernel path against its SDPA loop over a real paged cache (mixed with batched decodes).
GPU (`-m gpu`): bf16 at DeepSeek-V2-Lite shapes, fp32 exactness, CUDA-graph capture, the model path.

`python tests/test_kernel_prefill_attention.py [--sweep]` on the GPU prints one JSON line of timings;
`TRITON_INTERPRET=0 python tests/test_kernel_prefill_attention.py --compile-sm90` (any machine) compiles the
kernel for Hopper and prints its shared memory.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

pytest.importorskip("triton")


from afd.kernels import prefill_attention as kernel_module  # noqa: E402
from afd.kernels.prefill_attention import prefill_attention  # noqa: E402
from afd.model.attention_side import MLAttention, rope_parameters  # noqa: E402
from afd.model.batch import Batch
from afd.model.kv_cache import PagedLatentCache, blocks_needed  # noqa: E402
from afd.model.weights import load_model_config  # noqa: E402

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
TOL_CPU = 1e-5
# bf16 on the GPU, against fp32 SDPA on the same (bf16-rounded) inputs: the kernel rounds the probabilities
# to bf16 before P @ V and its output to bf16 (half an ulp is 2^-9 of the value). Both bounds hold the
# kernel to no worse than eager bf16 SDPA's own error on the same inputs (times 2, plus an ulp's slack).
BF16_ULP = 2.0**-8


def cu_seqlens(lens: list[int], device: torch.device | str) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)


def sdpa_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_lens: list[int], key_lens: list[int], scale: float
) -> torch.Tensor:
    """Per sequence, the model's eager SDPA with its masks: none for one query, causal for a fresh prompt,
    `tril(ctx)` for a chunk after ctx cached tokens. q [Tq, nh, D], k [Tk, nh, D], v [Tk, nh, Dv]."""
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    a = b = 0
    for n, L in zip(query_lens, key_lens, strict=True):
        ctx = L - n
        mask = None if n <= 1 or ctx == 0 else torch.ones(n, L, dtype=torch.bool, device=q.device).tril(ctx)
        if n:
            o = F.scaled_dot_product_attention(
                q[a : a + n].transpose(0, 1),
                k[b : b + L].transpose(0, 1),
                v[b : b + L].transpose(0, 1),
                attn_mask=mask,
                is_causal=n > 1 and ctx == 0,
                scale=scale,
            )
            out[a : a + n] = o.transpose(0, 1)
        a, b = a + n, b + L
    return out


def random_inputs(query_lens, context_lens, nh, dn, dr, dv, dtype, device, gen):
    """q [Tq, nh, dn + dr], k_nope [Tk, nh, dn], k_rope [Tk, dr] (shared by heads), v [Tk, nh, dv]."""
    key_lens = [n + c for n, c in zip(query_lens, context_lens, strict=True)]
    Tq, Tk = sum(query_lens), sum(key_lens)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    return key_lens, randn(Tq, nh, dn + dr), randn(Tk, nh, dn), randn(Tk, dr), randn(Tk, nh, dv)


def expand_k(k_nope: torch.Tensor, k_rope: torch.Tensor) -> torch.Tensor:
    Tk, nh, _ = k_nope.shape
    return torch.cat([k_nope, k_rope.unsqueeze(1).expand(Tk, nh, k_rope.shape[-1])], dim=-1)


# --- CPU (interpreter, fp32) ------------------------------------------------------------------------

MIXES = {  # (query_lens, context_lens)
    "one-token": ([1], [0]),
    "prompt-5": ([5], [0]),
    "prompts-3-17-1": ([3, 17, 1], [0, 0, 0]),
    "chunks-ctx-3-9-0": ([3, 17, 1], [3, 9, 0]),
    "chunks-ctx-9-0-3": ([3, 17, 1], [9, 0, 3]),
    "lone-decode-ctx-9": ([1], [9]),
    "chunk-40-ctx-3": ([40], [3]),
    # ctx = BLOCK_N - 2 (and 2 * 16 - 2): the first row of a tile sees one key less than the key tile holds
    "chunks-ctx-14-30": ([20, 19], [14, 30]),
    "empty-sequence-between": ([3, 0, 5], [0, 0, 9]),
}


@pytest.mark.parametrize("blocks", [(16, 16), (16, 32), (32, 16)], ids=lambda b: f"m{b[0]}n{b[1]}")
@pytest.mark.parametrize("mix", MIXES.values(), ids=MIXES.keys())
def test_kernel_matches_sdpa_per_sequence(mix, blocks) -> None:
    """nh 2, Dqk 24 = 16 + 8, Dv 16: every row equals per-sequence SDPA with the model's masks, for fresh
    prompts, chunks after 3 or 9 cached tokens and lone decodes, with tiles that cut sequences at odd
    places (BLOCK_M != BLOCK_N exercises the unmasked/diagonal split of the key loop)."""
    query_lens, context_lens = mix
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(sum(query_lens) * 31 + sum(context_lens))
    key_lens, q, k_nope, k_rope, v = random_inputs(query_lens, context_lens, 2, 16, 8, 16, torch.float32, device, gen)
    out = prefill_attention(
        q,
        k_nope,
        k_rope,
        v,
        cu_seqlens(query_lens, device),
        cu_seqlens(key_lens, device),
        max(query_lens),
        0.3,
        block_m=blocks[0],
        block_n=blocks[1],
        num_warps=4,
        num_stages=1,
    )
    want = sdpa_reference(q, expand_k(k_nope, k_rope), v, query_lens, key_lens, 0.3)
    torch.testing.assert_close(out, want, atol=TOL_CPU, rtol=0)


def test_kernel_per_head_rope_strided_views_odd_dims() -> None:
    """A per-head key given as views into one [Tk, nh, Dqk] tensor and v as a view into a wider projection
    output (the model's layout), head dims that are not powers of two (Dn 12, Dr 6, Dv 10: masked
    columns), and a caller-given `out`."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(7)
    query_lens, context_lens = [6, 1, 19], [0, 4, 5]
    key_lens = [n + c for n, c in zip(query_lens, context_lens, strict=True)]
    nh, dn, dr, dv = 3, 12, 6, 10
    q = torch.randn(sum(query_lens), nh, dn + dr, generator=gen).to(device)
    k = torch.randn(sum(key_lens), nh, dn + dr, generator=gen).to(device)
    kv = torch.randn(sum(key_lens), nh, dn + dv, generator=gen).to(device)
    v = kv[..., dn:]  # [Tk, nh, Dv], row stride nh * (dn + dv)
    out = torch.full((sum(query_lens), nh, dv), float("nan"), device=device)
    got = prefill_attention(
        q,
        k[..., :dn],
        k[..., dn:],
        v,
        cu_seqlens(query_lens, device),
        cu_seqlens(key_lens, device),
        max(query_lens),
        0.25,
        out=out,
        block_m=16,
        block_n=16,
        num_warps=4,
        num_stages=1,
    )
    assert got is out
    torch.testing.assert_close(out, sdpa_reference(q, k, v, query_lens, key_lens, 0.25), atol=TOL_CPU, rtol=0)


def test_kernel_empty_and_deterministic() -> None:
    """No queries: an empty output and no launch. The same inputs twice: bit-identical outputs."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    empty = prefill_attention(
        torch.empty(0, 2, 24, device=device),
        torch.empty(0, 2, 16, device=device),
        torch.empty(0, 8, device=device),
        torch.empty(0, 2, 16, device=device),
        cu_seqlens([], device),
        cu_seqlens([], device),
        0,
        0.3,
    )
    assert empty.shape == (0, 2, 16)
    gen = torch.Generator().manual_seed(3)
    key_lens, q, k_nope, k_rope, v = random_inputs([9, 4], [0, 6], 2, 16, 8, 16, torch.float32, device, gen)
    args = (q, k_nope, k_rope, v, cu_seqlens([9, 4], device), cu_seqlens(key_lens, device), 9, 0.3)
    first = prefill_attention(*args, block_m=16, block_n=16, num_warps=4, num_stages=1)
    second = prefill_attention(*args, block_m=16, block_n=16, num_warps=4, num_stages=1)
    assert torch.equal(first, second)


def meta_base(view: torch.Tensor) -> int:
    """Where the tensor a view was cut from begins."""
    return view.data_ptr() - view.storage_offset() * view.element_size()


def _attention_and_step(config, dtype, device, query_lens, context_lens, seed: int = 0):
    """One MLAttention layer with random weights, a paged cache whose context rows hold random latents,
    the step's batch prepared on it, and this step's q, kv_c, k_pe (written to the cache as forward does)."""
    torch.manual_seed(seed)
    _, _, scale = rope_parameters(config)
    attn = MLAttention(config, 0, scale)
    for p in attn.parameters():
        p.data.normal_(0.0, 0.5 / p.shape[-1] ** 0.5)
    attn = attn.to(device=device, dtype=dtype)
    num_blocks = sum(blocks_needed(n + ctx, 4) for n, ctx in zip(query_lens, context_lens, strict=True))
    cache = PagedLatentCache(config, num_blocks=num_blocks, block_size=4, max_num_seqs=8, dtype=dtype, device=device)
    slots = [cache.allocate(n + ctx) for n, ctx in zip(query_lens, context_lens, strict=True)]
    cache.cache[:, 4:-1].normal_()  # cached contexts: random latents (the null block stays zero)
    batch = Batch(slots=slots, query_lens=list(query_lens), context_lens=list(context_lens))
    cache.prepare(batch)
    T, nh = sum(query_lens), config.num_attention_heads
    q = torch.randn(T, nh, config.qk_head_dim, device=device, dtype=dtype)
    kv_c = torch.randn(T, config.kv_lora_rank, device=device, dtype=dtype)
    k_pe = torch.randn(T, config.qk_rope_head_dim, device=device, dtype=dtype)
    cache.write(0, batch.slot_mapping, torch.cat([kv_c, k_pe], dim=-1))
    return attn, cache, batch, q, kv_c, k_pe


STEPS = {  # (query_lens, context_lens) of one engine step
    "fresh-prompts": ([3, 17, 1], [0, 0, 0]),
    "lone-decode-and-chunk": ([1, 3], [9, 3]),
    "decodes-between-chunks": ([5, 4, 1, 1, 17], [0, 9, 7, 3, 0]),
    "three-prompts": ([3, 8, 2], [0, 0, 0]),
    "chunks-around-a-decode": ([4, 1, 6, 2, 3], [5, 2, 0, 0, 1]),
}


@pytest.mark.parametrize("step", STEPS.values(), ids=STEPS.keys())
def test_model_kernel_path_matches_sdpa_loop(step, monkeypatch: pytest.MonkeyPatch) -> None:
    """`MLAttention._prefill_attention_varlen` (one kv_b_proj over all key latents, one launch, gather and
    scatter around batched decodes) writes the same rows as the eager SDPA loop, tiny preset, fp32; the
    batched decodes' rows are left alone."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = load_model_config("tiny")
    attn, cache, batch, q, kv_c, k_pe = _attention_and_step(config, torch.float32, device, *step)
    seqs = [i for i in range(len(batch.query_lens)) if i not in set(batch.decode_seqs)]
    shape = (q.shape[0], config.num_attention_heads, config.v_head_dim)
    want = torch.full(shape, 7.0, device=device)
    got = want.clone()
    attn._prefill_attention_sdpa(want, q, kv_c, k_pe, batch, cache, seqs)
    tables = []
    real_kernel = kernel_module.prefill_attention

    def spy(q, k_nope, k_rope, v, cu_q, cu_k, *rest, **kw):
        tables.append((cu_q.data_ptr() - meta_base(cu_q), cu_k.data_ptr() - meta_base(cu_k)))
        return real_kernel(q, k_nope, k_rope, v, cu_q, cu_k, *rest, **kw)

    monkeypatch.setattr(kernel_module, "prefill_attention", spy)
    attn._prefill_attention_varlen(got, q, kv_c, k_pe, batch, cache, seqs)
    # both length tables start 16-byte aligned in the step's one metadata tensor, whatever the sequence count:
    # Triton would compile the kernel once more for a misaligned pointer
    ((q_at, k_at),) = tables
    assert q_at == 0 and k_at % 16 == 0 and k_at >= 4 * (len(seqs) + 1), (len(seqs), k_at)
    torch.testing.assert_close(got, want, atol=TOL_CPU, rtol=0)
    for i in batch.decode_seqs:
        assert (got[batch.starts[i]] == 7.0).all()


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


# --- timing (the GPU) ------------------------------------------------------------------------------------


def _time_ms(fn, iters: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def bench(sweep: bool = False) -> dict:
    """8 x 1024 prompts, V2-Lite heads, bf16: the per-sequence SDPA loop vs one kernel launch (attention
    alone), and one MLAttention layer's prefill attention (kv_b_proj included) eager vs kernel path."""
    query_lens, context_lens = [1024] * 8, [0] * 8
    gen = torch.Generator().manual_seed(0)
    key_lens, q, k_nope, k_rope, v = random_inputs(
        query_lens, context_lens, 16, 128, 64, 128, torch.bfloat16, "cuda", gen
    )
    k = expand_k(k_nope, k_rope)
    cu_q, cu_k = cu_seqlens(query_lens, "cuda"), cu_seqlens(key_lens, "cuda")
    flops = sum(2.0 * 16 * (192 + 128) * n * (n + 1) / 2 for n in query_lens)
    sdpa_ms = _time_ms(lambda: sdpa_reference(q, k, v, query_lens, key_lens, LITE["scale"]))
    kernel_ms = _time_ms(lambda: prefill_attention(q, k_nope, k_rope, v, cu_q, cu_k, 1024, LITE["scale"]))
    config = load_model_config("deepseek-v2-lite")
    attn, cache, batch, mq, kv_c, k_pe = _attention_and_step(config, torch.bfloat16, "cuda", query_lens, context_lens)
    seqs = list(range(len(query_lens)))
    out = torch.empty(mq.shape[0], 16, 128, dtype=torch.bfloat16, device="cuda")
    layer_sdpa_ms = _time_ms(lambda: attn._prefill_attention_sdpa(out, mq, kv_c, k_pe, batch, cache, seqs))
    layer_kernel_ms = _time_ms(lambda: attn._prefill_attention_varlen(out, mq, kv_c, k_pe, batch, cache, seqs))
    result = {
        "bench": "prefill_attention",
        "device": torch.cuda.get_device_name(),
        "shape": "8x1024 bf16 nh16 Dqk192 Dv128 causal",
        "sdpa_loop_ms": round(sdpa_ms, 4),
        "kernel_ms": round(kernel_ms, 4),
        "speedup": round(sdpa_ms / kernel_ms, 2),
        "sdpa_TFLOPs": round(flops / sdpa_ms / 1e9, 1),
        "kernel_TFLOPs": round(flops / kernel_ms / 1e9, 1),
        "layer_sdpa_path_ms": round(layer_sdpa_ms, 4),
        "layer_kernel_path_ms": round(layer_kernel_ms, 4),
    }
    if sweep:  # tile shapes, for choosing the defaults
        tiles = {}
        for bm, bn, warps, stages in itertools.product((64, 128), (32, 64, 128), (4, 8), (1, 2, 3)):
            try:
                ms = _time_ms(
                    lambda bm=bm, bn=bn, w=warps, s=stages: prefill_attention(
                        q,
                        k_nope,
                        k_rope,
                        v,
                        cu_q,
                        cu_k,
                        1024,
                        LITE["scale"],
                        block_m=bm,
                        block_n=bn,
                        num_warps=w,
                        num_stages=s,
                    )
                )
                tiles[f"m{bm}n{bn}w{warps}s{stages}"] = round(ms, 4)
            except Exception as e:  # noqa: BLE001 - out of shared memory or registers: not a candidate
                tiles[f"m{bm}n{bn}w{warps}s{stages}"] = type(e).__name__
        result["tiles_ms"] = tiles
    return result


def compile_for_hopper() -> dict:
    """Without a GPU: lower the kernel for sm_90 with its default tiles (bf16 and fp32, V2-Lite head dims) and
    report shared memory per program (an H200 SM has 227 KB) and whether the dots became wgmma. Needs a process
    that does not interpret: `TRITON_INTERPRET=0 python tests/test_kernel_prefill_attention.py --compile-sm90`."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from afd.kernels.prefill_attention import _TILES, _block, _prefill_attention_kernel

    kernel = _prefill_attention_kernel
    pointers, aligned = {"Q", "K1", "K2", "V", "Out", "CuQ", "CuK"}, {"stride_k2h", "qk_scale", "num_m_tiles"}
    result = {}
    for dtype, is_fp32 in (("bf16", False), ("fp32", True)):
        block_m, block_n, num_warps, num_stages = _TILES[is_fp32]
        dn, dr, dv = LITE["dn"], LITE["dr"], LITE["dv"]
        consts = {"D1": dn, "D2": dr, "DV": dv, "BLOCK_M": block_m, "BLOCK_N": block_n}
        consts |= {"BLOCK_D1": _block(dn), "BLOCK_D2": _block(dr), "BLOCK_DV": _block(dv)}
        consts |= {"PAD_D1": _block(dn) != dn, "PAD_D2": _block(dr) != dr, "PAD_DV": _block(dv) != dv}
        consts["PRECISION"] = "ieee" if is_fp32 else "tf32"
        names = kernel.arg_names
        signature = {
            n: "constexpr" if n in consts else ("*i32" if n in ("CuQ", "CuK") else f"*{dtype}") if n in pointers else
            ("fp32" if n == "qk_scale" else "i32")
            for n in names
        }  # fmt: skip
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n not in consts and n not in aligned}
        source = ASTSource(kernel, signature, constexprs={(names.index(n),): v for n, v in consts.items()}, attrs=attrs)
        compiled = triton.compile(
            source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages}
        )
        result[dtype] = {"shared_bytes": compiled.metadata.shared, "wgmma": "wgmma" in compiled.asm["ptx"]}
    return result


if __name__ == "__main__":
    if "--compile-sm90" in sys.argv:
        print(json.dumps(compile_for_hopper()))
    else:
        print(json.dumps(bench(sweep="--sweep" in sys.argv)))
