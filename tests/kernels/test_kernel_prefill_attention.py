"""The varlen MLA prefill attention kernel (afd.kernels.prefill_attention) against per-sequence SDPA.

CPU: Triton's interpreter, fp32, tiny shapes, within 1e-5 — the kernel alone (fresh prompts, chunks after
cached context, lone decodes, tiles not multiples of the block, padding rows, empty inputs) and
`MLAttention`'s kernel path against its SDPA loop over a real paged cache (mixed with batched decodes).
The GPU half (bf16 at DeepSeek-V2-Lite shapes, fp32 exactness, CUDA-graph capture, the model path) is
tests/e2e/test_kernel_prefill_attention_gpu.py.
"""

from __future__ import annotations

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

from afd.kernels import prefill_attention as kernel_module  # noqa: E402
from afd.kernels.prefill_attention import prefill_attention  # noqa: E402
from afd.model.weights import load_model_config  # noqa: E402

TOL_CPU = 1e-5


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


@pytest.mark.parametrize("mix", [MIXES["prompts-3-17-1"], MIXES["chunks-ctx-9-0-3"], MIXES["chunk-40-ctx-3"]])
def test_tiled_grid_equals_the_per_sequence_grid(mix) -> None:
    """A fixed grid told each program's (sequence, tile) by a table (what a CUDA graph launches), with idle
    programs (-1) and more sequence slots than real sequences (empty ones at the end), writes the same rows,
    bit for bit, and leaves rows no sequence owns alone."""
    query_lens, context_lens = mix
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(11)
    key_lens, q, k_nope, k_rope, v = random_inputs(query_lens, context_lens, 2, 16, 8, 16, torch.float32, device, gen)
    kw = dict(block_m=16, block_n=16, num_warps=4, num_stages=1)
    want = prefill_attention(
        q, k_nope, k_rope, v, cu_seqlens(query_lens, device), cu_seqlens(key_lens, device), max(query_lens), 0.3, **kw
    )
    table = kernel_module.query_tiles(query_lens, 16)
    assert sorted(table) == sorted((s, m) for s, n in enumerate(query_lens) for m in range(-(-n // 16)))
    table += [(-1, 0)] * 3  # idle programs
    tiles = torch.tensor(table, dtype=torch.int32).T.contiguous().to(device)
    spare = [*query_lens, 0, 0]  # two empty sequence slots, as a graph's table has past the step's sequences
    pad = torch.full((4, *q.shape[1:]), 5.0, device=device)
    out = torch.full((q.shape[0] + 4, 2, 16), 7.0, device=device)
    got = prefill_attention(
        torch.cat([q, pad]), k_nope, k_rope, v, cu_seqlens(spare, device),
        cu_seqlens([*key_lens, 0, 0], device), 0, 0.3, out=out, tiles=tiles, **kw,
    )  # fmt: skip
    assert got is out and torch.equal(out[: q.shape[0]], want)
    assert (out[q.shape[0] :] == 7.0).all()


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
    tables, query_bases = [], []
    real_kernel = kernel_module.prefill_attention

    def spy(q, k_nope, k_rope, v, cu_q, cu_k, *rest, **kw):
        tables.append((cu_q.data_ptr() - meta_base(cu_q), cu_k.data_ptr() - meta_base(cu_k)))
        query_bases.append(meta_base(q))
        return real_kernel(q, k_nope, k_rope, v, cu_q, cu_k, *rest, **kw)

    monkeypatch.setattr(kernel_module, "prefill_attention", spy)
    attn._prefill_attention_varlen(got, q, kv_c, k_pe, batch, cache, seqs)
    # both length tables start 16-byte aligned in the step's one metadata tensor, whatever the sequence count:
    # Triton would compile the kernel once more for a misaligned pointer
    ((q_at, k_at),) = tables
    assert q_at == 0 and k_at % 16 == 0 and k_at >= 4 * (len(seqs) + 1), (len(seqs), k_at)
    # sequences on consecutive rows (decodes first, as the engine orders a step) are read in place, not gathered
    assert (query_bases == [meta_base(q)]) == (seqs == list(range(seqs[0], seqs[-1] + 1))), (seqs, step)
    torch.testing.assert_close(got, want, atol=TOL_CPU, rtol=0)
    for i in batch.decode_seqs:
        assert (got[batch.starts[i]] == 7.0).all()


GRAPHED_STEPS = {  # the engine's order: decodes first, then prompts (fresh, or chunks after cached context)
    "decodes-then-prompts": ([1, 1, 1, 5, 7], [4, 6, 2, 0, 0]),
    "decodes-then-a-chunk-after-context": ([1, 1, 20, 3], [9, 21, 13, 0]),
    "a-chunk-past-a-tile": ([1, 1, 40], [5, 7, 30]),
}


@pytest.mark.parametrize("step", GRAPHED_STEPS.values(), ids=GRAPHED_STEPS.keys())
def test_graphed_core_with_the_kernels_equals_the_eager_core(step, monkeypatch: pytest.MonkeyPatch) -> None:
    """`MLAttention._attend_graphed` as a captured step runs it (the MLA decode kernel over the layout's padded
    decode rows, the prompts' keys gathered from the cache, the tiled varlen kernel) writes every real row as the
    eager core over the step's own batch does (fp32, interpreter), padding rows included in the layout."""
    from afd import kernels
    from afd.engine.graphs.layout import LayoutBuffers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = load_model_config("tiny")
    attn, cache, batch, q, kv_c, k_pe = _attention_and_step(config, torch.float32, device, *step)
    T = q.shape[0]
    with torch.inference_mode(), kernels.eager_ops():
        want = attn.attend(q, kv_c, k_pe, batch, cache)
    buffers = LayoutBuffers(64, 8, cache.block_tables.shape[1], torch.float32, torch.device(device))
    kind = buffers.kind(batch, 64)
    assert kind != "paused"
    buffers.fill(batch, 64, kind, cache)
    layout = buffers.layout(64, kind)
    pad = 64 - T  # the bucket's padding rows: their queries are whatever the pieces left there
    qp, cp, pp = (torch.cat([t, t.new_ones(pad, *t.shape[1:])]) for t in (q, kv_c, k_pe))
    monkeypatch.setattr(kernels, "enabled", lambda device: True)  # the interpreter runs them on CPU
    with torch.inference_mode():
        got = attn._attend_graphed(qp, cp, pp, layout, cache, None)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got[:T], want, atol=TOL_CPU, rtol=0)
