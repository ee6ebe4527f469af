"""Absorbed MLA decode attention that reads the latents in place from the paged cache (flash-decoding).

Why: the eager path gathers every decode token's context latents out of the paged pool into a
`[B, L, C + R]` tensor before its einsums (at batch 256 a 2.9 ms copy per step that the memory floor does
not have). Here each program gathers the cache rows it needs tile by tile, straight from the pool, and
keeps the online softmax in registers, so each latent row is read once per sequence and head tile.

Math (per sequence b, head h; `kv_c = latent[:C]`, `k_pe = latent[C:]`):
    s_l = (q_latent[h] . kv_c[l] + q_pe[h] . k_pe[l]) * softmax_scale     (invalid l: -inf)
    o[h] = sum_l softmax(s)_l kv_c[l]                                       -> o_latent [B, nh, C]
Scores, softmax (base 2) and accumulation are fp32; the probabilities enter the second product in the
input dtype, as the eager path's `probs.to(kv_c.dtype)` does.

Grid: `(head tiles, splits, B)`. A program owns `BLOCK_H` heads of one sequence and one contiguous split
of its context; head tiles of the same (sequence, split) are neighbours in launch order, so with several
head tiles (V3: 128 heads) the repeated reads of a row hit L2. With one split a program normalises and
writes the output itself; with several it writes a partial (acc, max, sum) and `_combine_kernel` merges
the splits in a fixed order. The split count is a function of the shapes and the SM count only (no
device data), so a launch is capturable in a CUDA graph and gives the same bits every run.
"""

from __future__ import annotations

import math
from functools import cache

import torch
import triton
import triton.language as tl

from afd.kernels import int_kind

# Tile shapes, checked by compiling for sm_90 (ptxas -v, C = 512, R = 64): 16-bit inputs take 32 context rows
# per tile (a 32 KiB latent tile), 16 or 32 heads per program at 4 or 8 warps, no register spills. fp32 inputs
# (exact fp32 products, CUDA-core dots) take 16 rows and 16 heads: at 32 rows they spill.
BLOCK_N = 32
BLOCK_N_FP32 = 16
MIN_SPLIT_ROWS = 64  # a split reads at least this many rows (two tiles), or the combine costs more than it saves
MAX_SPLITS = 64
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _split_kernel(
    q_ptr,  # [B, NH, C]
    qpe_ptr,  # [B, NH, R]
    cache_ptr,  # [rows, C + R]
    rows_ptr,  # [B, L] int64
    valid_ptr,  # [B, L] uint8
    out_ptr,  # [B, NH, C] (DIRECT)
    part_o_ptr,  # [B, S, NH, C] fp32 (not DIRECT)
    part_m_ptr,  # [B, S, NH] fp32, running max (base 2)
    part_l_ptr,  # [B, S, NH] fp32, running sum
    qk_scale,  # softmax_scale * log2(e)
    L,
    chunk,  # rows per split, a multiple of BLOCK_N
    NH,
    stride_qb,
    stride_qh,
    stride_pb,
    stride_ph,
    stride_cache,
    stride_rb,
    stride_vb,
    stride_ob,
    stride_oh,
    C: tl.constexpr,
    R: tl.constexpr,
    C_PAD: tl.constexpr,  # C, R rounded up to a power of two >= 16 (tl.dot's smallest K); the pad reads nothing
    R_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    ht = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    num_splits = tl.num_programs(1)

    heads = ht * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH]
    head_ok = heads < NH
    c = tl.arange(0, C_PAD)
    r = tl.arange(0, R_PAD)
    c_ok = c < C
    r_ok = r < R
    q_mask = head_ok[:, None] & c_ok[None, :]
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + c[None, :], mask=q_mask, other=0.0)
    pe_mask = head_ok[:, None] & r_ok[None, :]
    qpe = tl.load(qpe_ptr + b * stride_pb + heads[:, None] * stride_ph + r[None, :], mask=pe_mask, other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, C_PAD], tl.float32)
    start = split * chunk
    for n0 in range(start, start + chunk, BLOCK_N):  # the last split's tail past L is masked
        n = n0 + tl.arange(0, BLOCK_N)  # [BN]
        in_range = n < L
        row = tl.load(rows_ptr + b * stride_rb + n, mask=in_range, other=0)  # [BN] int64
        ok = tl.load(valid_ptr + b * stride_vb + n, mask=in_range, other=0) != 0  # [BN]
        base = cache_ptr + row[:, None] * stride_cache
        kv = tl.load(base + c[None, :], mask=ok[:, None] & c_ok[None, :], other=0.0)  # [BN, C]: invalid rows unread
        kpe = tl.load(base + C + r[None, :], mask=ok[:, None] & r_ok[None, :], other=0.0)  # [BN, R]
        s = tl.dot(q, tl.trans(kv), input_precision=PRECISION)
        s = tl.dot(qpe, tl.trans(kpe), acc=s, input_precision=PRECISION)  # [BH, BN] fp32
        s = tl.where(ok[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing valid yet: keep exp2 away from -inf - -inf
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s - m_safe[:, None])  # [BH, BN]
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(kv.dtype), kv, acc=acc * alpha[:, None], input_precision=PRECISION)  # [BH, C]
        m_i = m_new

    if DIRECT:
        o = acc / l_i[:, None]
        tl.store(
            out_ptr + b * stride_ob + heads[:, None] * stride_oh + c[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=q_mask,
        )
    else:
        at = (b * num_splits + split) * NH + heads  # [BH]
        tl.store(part_o_ptr + at[:, None] * C + c[None, :], acc, mask=q_mask)
        tl.store(part_m_ptr + at, m_i, mask=head_ok)
        tl.store(part_l_ptr + at, l_i, mask=head_ok)


@triton.jit
def _combine_kernel(
    out_ptr,  # [B, NH, C]
    part_o_ptr,  # [B, S, NH, C] fp32
    part_m_ptr,  # [B, S, NH] fp32
    part_l_ptr,  # [B, S, NH] fp32
    NH,
    S,
    stride_ob,
    stride_oh,
    C: tl.constexpr,
    C_PAD: tl.constexpr,
    S_PAD: tl.constexpr,
):
    h = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    s = tl.arange(0, S_PAD)
    at = (b * S + s) * NH + h  # [S_PAD]
    m_s = tl.load(part_m_ptr + at, mask=s < S, other=float("-inf"))  # [S_PAD]
    l_s = tl.load(part_l_ptr + at, mask=s < S, other=0.0)  # [S_PAD]
    m_max = tl.max(m_s, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # a split with no valid row has m = -inf, l = 0
    denom = tl.sum(tl.math.exp2(m_s - m_max) * l_s, 0)
    c = tl.arange(0, C_PAD)
    c_ok = c < C
    acc = tl.zeros([C_PAD], tl.float32)
    for i in range(0, S):  # a fixed order: the same bits every run
        at_i = (b * S + i) * NH + h
        w = tl.math.exp2(tl.load(part_m_ptr + at_i) - m_max)
        acc += w * tl.load(part_o_ptr + at_i * C + c, mask=c_ok, other=0.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + c, (acc / denom).to(out_ptr.dtype.element_ty), mask=c_ok)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (a host-side query, cached); 4 for the CPU interpreter."""
    if device.type != "cuda":
        return 4
    return _cuda_sms(torch.cuda.current_device() if device.index is None else device.index)


@cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_splits_for(batch: int, head_tiles: int, context: int, num_sms: int) -> int:
    """How many splits the context of each sequence gets: enough programs to fill the SMs once, rounded up to a
    power of two (on an H200 3 splits at batch 64 ran 29% slower than 4: `scripts/gpu_mla_sweep.py`), each split
    at least `MIN_SPLIT_ROWS` rows. A function of shapes only (capturable, deterministic)."""
    programs = batch * head_tiles
    if programs == 0 or programs >= num_sms:
        return 1
    fill = triton.next_power_of_2(_cdiv(num_sms, programs))
    return max(1, min(fill, _cdiv(context, MIN_SPLIT_ROWS), MAX_SPLITS))


def split_rows(context: int, num_splits: int, block_n: int) -> tuple[int, int]:
    """(rows per split, splits) for a context of `context` rows asked to split `num_splits` ways: whole tiles per
    split, and never an empty split (so there may be fewer than asked)."""
    chunk = _cdiv(_cdiv(context, max(1, num_splits)), block_n) * block_n
    return chunk, _cdiv(context, chunk)


def compile_key(context: int, splits: int) -> tuple:
    """What decides which compiled variant of the two kernels a launch with these sizes uses (the head count,
    strides and dtypes are fixed for a model): the context width (`L`, also the stride of `rows` and
    `valid`), whether the output is written directly, and for the combine the split count and its padding."""
    if splits == 1:
        return (int_kind(context), "direct")
    return (int_kind(context), int_kind(splits), triton.next_power_of_2(splits))


def warm_up_shapes(block_n: int) -> list[tuple[int, int]]:
    """(context width, splits) pairs that between them reach every `compile_key` a launch can have: a direct
    launch with a context of each kind, then every padded split count up to `MAX_SPLITS`, with a split count
    that is a multiple of 16 and one that is not, each with a context of both kinds."""
    shapes = [(1, 1), (block_n - 1, 1), (block_n, 1)]
    for s in (2, 3, 5, 9, 16, 17, 32, 33, 64):
        if s <= MAX_SPLITS:
            shapes += [(s * block_n, s), (s * block_n - 1, s)]  # each gives exactly s splits (`split_rows`)
    return shapes


def warm_up(q_latent: torch.Tensor, q_pe: torch.Tensor, cache_layer: torch.Tensor, softmax_scale: float) -> None:
    """Compile every variant the decode kernels can need for these heads and this dtype (`warm_up_shapes`), on
    one sequence that reads the cache's first row. Why: the split count follows the batch and context, so a
    server meets new ones long after its first steps (a fresh machine compiled four mid-run without this)."""
    block_n = BLOCK_N_FP32 if q_latent.dtype == torch.float32 else BLOCK_N
    q_latent, q_pe = q_latent[:1], q_pe[:1]
    for context, splits in warm_up_shapes(block_n):
        rows = torch.zeros(1, context, dtype=torch.int64, device=q_latent.device)
        valid = torch.ones(1, context, dtype=torch.bool, device=q_latent.device)
        mla_decode(q_latent, q_pe, cache_layer, rows, valid, softmax_scale, num_splits=splits)


def mla_decode(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    cache_layer: torch.Tensor,
    rows: torch.Tensor,
    valid: torch.Tensor,
    softmax_scale: float,
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
    block_h: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Absorbed MLA decode attention over paged latents, read in place.

    q_latent: [B, nh, C] (q_nope through W_uk), q_pe: [B, nh, R] (roped), cache_layer: [rows, C + R] (one
    layer of the pool, a view), rows: [B, L] int64 flat cache rows, valid: [B, L] bool (invalid columns are
    neither read nor weighted; a sequence needs one valid column) -> o_latent [B, nh, C] in q's dtype.
    `num_splits` (default: from the shapes and the SM count), `block_n`, `block_h`, `num_warps` and `num_stages`
    exist for tests and tuning sweeps (`scripts/gpu_mla_sweep.py`).
    """
    B, nh, C = q_latent.shape
    R = q_pe.shape[-1]
    L = rows.shape[1]
    assert q_pe.shape == (B, nh, R) and cache_layer.shape[1] == C + R, (q_pe.shape, cache_layer.shape)
    assert rows.shape == valid.shape == (B, L) and rows.dtype == torch.int64 and valid.dtype == torch.bool
    dtype = q_latent.dtype
    assert q_pe.dtype == cache_layer.dtype == dtype and dtype in _DTYPES, "one dtype of fp16/bf16/fp32"
    fp32 = dtype == torch.float32
    block_n = block_n or (BLOCK_N_FP32 if fp32 else BLOCK_N)
    assert block_n >= 16 and block_n & (block_n - 1) == 0, f"block_n={block_n}: a power of two >= 16"
    out = q_latent.new_empty(B, nh, C)  # [B, nh, C]
    if B == 0 or nh == 0:
        return out
    if L == 0:  # as the eager einsum over an empty context
        return out.zero_()
    q_latent = q_latent if q_latent.stride(-1) == 1 else q_latent.contiguous()
    q_pe = q_pe if q_pe.stride(-1) == 1 else q_pe.contiguous()
    assert cache_layer.stride(1) == 1, "cache rows must be contiguous"
    rows, valid = rows.contiguous(), valid.contiguous().view(torch.uint8)

    block_h = block_h or (16 if nh <= 16 or fp32 else 32)  # tl.dot needs >= 16 rows; [32, C] fp32 acc at most
    assert block_h in (16, 32), f"block_h={block_h}: 16 or 32"
    head_tiles = _cdiv(nh, block_h)
    if num_splits is None:
        sms = _num_sms(q_latent.device)
        num_splits = num_splits_for(B, head_tiles, L, sms)
    chunk, splits = split_rows(L, num_splits, block_n)
    direct = splits == 1
    if direct:
        part_o = part_m = part_l = out  # unused
    else:
        part_o = torch.empty(B, splits, nh, C, dtype=torch.float32, device=out.device)
        part_m = torch.empty(B, splits, nh, dtype=torch.float32, device=out.device)
        part_l = torch.empty(B, splits, nh, dtype=torch.float32, device=out.device)
    precision = "ieee" if fp32 else None  # fp32 products stay fp32 (no tf32)
    _split_kernel[(head_tiles, splits, B)](
        q_latent,
        q_pe,
        cache_layer,
        rows,
        valid,
        out,
        part_o,
        part_m,
        part_l,
        softmax_scale * math.log2(math.e),
        L,
        chunk,
        nh,
        q_latent.stride(0),
        q_latent.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        cache_layer.stride(0),
        rows.stride(0),
        valid.stride(0),
        out.stride(0),
        out.stride(1),
        C=C,
        R=R,
        C_PAD=max(16, triton.next_power_of_2(C)),
        R_PAD=max(16, triton.next_power_of_2(R)),
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        DIRECT=direct,
        PRECISION=precision,
        num_warps=num_warps or (4 if block_h == 16 else 8),
        num_stages=num_stages or 2,  # 3 stages were 3-25% slower at every decode shape swept on an H200
    )
    if not direct:
        _combine_kernel[(nh, B)](
            out,
            part_o,
            part_m,
            part_l,
            nh,
            splits,
            out.stride(0),
            out.stride(1),
            C=C,
            C_PAD=max(16, triton.next_power_of_2(C)),
            S_PAD=triton.next_power_of_2(splits),
            num_warps=4,
        )
    return out
