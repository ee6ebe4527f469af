"""Absorbed MLA decode attention that reads the latents in place from the paged cache (flash-decoding), each
sequence over its own context length.

Why: the eager path gathers every decode token's context latents out of the paged pool into a
`[B, L, C + R]` tensor before its einsums (at batch 256 a 2.9 ms copy per step that the memory floor does
not have). Here each program gathers the cache rows it needs tile by tile, straight from the pool, and
keeps the online softmax in registers, so each latent row is read once per sequence and head tile. A
program walks only the tiles of its own sequence's length (read from a device tensor), so a batch mixing
short and long contexts costs the sum of its contexts, not batch x longest.

Math (per sequence b, head h; `kv_c = latent[:C]`, `k_pe = latent[C:]`, l < lens[b]):
    s_l = (q_latent[h] . kv_c[l] + q_pe[h] . k_pe[l]) * softmax_scale
    o[h] = sum_l softmax(s)_l kv_c[l]                                       -> o_latent [B, nh, C]
Scores, softmax (base 2) and accumulation are fp32; the probabilities enter the second product in the
input dtype, as the eager path's `probs.to(kv_c.dtype)` does.

Where rows live: `table[b, p]` is the cache block of page p of sequence b, `page` rows a block, so
position l sits at row `table[b, l // page] * page + l % page` (`page` = 1: the table holds the rows
themselves; the engine passes its block size, eager steps and CUDA graphs alike). Positions past `lens[b]`
are never read, so whatever their slots hold (stale or uninitialised rows, NaN) cannot reach the output.

Grid: `(head tiles, B, splits)`, fixed by the shapes (batch, heads, the table's capacity) and the SM
count, never by the lengths: a launch is capturable in a CUDA graph and a replay only sees new lengths.
A sequence's tiles are shared among the splits (`split_tiles`: equal shares of whole tiles, at least
`min_split_rows` rows each), so a short sequence uses fewer splits and its other programs exit without a
load. With one split a program normalises and writes the output itself; with several it writes a partial
(acc, max, sum) and `_combine_kernel` merges that sequence's live splits in a fixed order (the same bits
every run). Head tiles of the same (sequence, split) are neighbours in launch order, so with several head
tiles (V3: 128 heads) the repeated reads of a row hit L2. Splits are the slowest dimension: every sequence's
first split is launched before any second one, so the programs that read land evenly on the SMs and the empty
splits of short contexts come last. Why: a CUDA graph's table is as wide as the longest context it may meet, so
a batch of 256 at 512 tokens in a table of 4,096 has three empty programs for each reading one; interleaved,
they dealt the reading ones unevenly over the SMs (one H200: 107 us a layer, 77 with splits slowest).

Each tile's cache block ids are loaded one tile ahead, so the latent rows' addresses are known when the
software pipeline issues their loads, and a third pipeline stage pays (loaded in the same iteration, three
stages ran 3-25% slower than two; ahead, 8-19% faster at batch 64-256: `scripts/gpu_mla_sweep.py`).
"""

from __future__ import annotations

import math
from functools import cache

import torch
import triton
import triton.language as tl

# Tile shapes, checked by compiling for sm_90 (ptxas -v, C = 512, R = 64): 16-bit inputs take 32 context rows
# per tile (a 32 KiB latent tile), 16 or 32 heads per program at 4 or 8 warps, no register spills. fp32 inputs
# (exact fp32 products, CUDA-core dots) take 16 rows and 16 heads: at 32 rows they spill.
BLOCK_N = 32
BLOCK_N_FP32 = 16
MIN_SPLIT_ROWS = 64  # a split reads at least this many rows (two tiles), or the combine costs more than it saves
MAX_SPLITS = 64
# Once the batch alone fills the SMs, a sequence is still cut into chunks of this many rows, so that a batch mixing
# short and long contexts spreads as evenly over the SMs as a uniform one (with one program per sequence the long
# ones' programs would run alone at the end), while most sequences keep one chunk and write their output directly.
# MAX_PROGRAMS bounds the grid such chunks need (the programs of splits past a short sequence's end exit at once,
# but not for free); past MAX_PROGRAMS / batch chunks a long context takes longer chunks.
BALANCE_ROWS = 1024
MAX_PROGRAMS = 1024
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _split_share(length, num_splits, BLOCK_N: tl.constexpr, min_tiles):
    """(tiles of the sequence, tiles per split): the device twin of `split_tiles`."""
    tiles = (length + BLOCK_N - 1) // BLOCK_N
    share = tl.maximum((tiles + num_splits - 1) // num_splits, min_tiles)
    return tiles, share


@triton.jit(do_not_specialize=["page", "stride_tb", "min_tiles"])
def _split_kernel(
    q_ptr,  # [B, NH, C]
    qpe_ptr,  # [B, NH, R]
    cache_ptr,  # [rows, C + R]
    table_ptr,  # [B, W] int64, cache block of each page
    lens_ptr,  # [B] int32, context length of each sequence
    out_ptr,  # [B, NH, C] (DIRECT)
    part_o_ptr,  # [B, S, NH, C] fp32 (not DIRECT)
    part_m_ptr,  # [B, S, NH] fp32, running max (base 2)
    part_l_ptr,  # [B, S, NH] fp32, running sum
    qk_scale,  # softmax_scale * log2(e)
    page,  # rows per block of the table
    NH,
    stride_qb,
    stride_qh,
    stride_pb,
    stride_ph,
    stride_cache,
    stride_tb,
    stride_ob,
    stride_oh,
    min_tiles,  # tiles a live split reads at least
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
    b = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    length = tl.load(lens_ptr + b)
    tiles, share = _split_share(length, num_splits, BLOCK_N, min_tiles)
    first = split * share
    end = tl.minimum(first + share, tiles)
    live = first < end  # a split past the sequence's tiles loads nothing and writes nothing

    heads = ht * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH]
    head_ok = heads < NH
    c = tl.arange(0, C_PAD)
    r = tl.arange(0, R_PAD)
    c_ok = c < C
    r_ok = r < R
    q_mask = head_ok[:, None] & c_ok[None, :]
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + c[None, :], mask=q_mask & live, other=0.0)
    pe_mask = head_ok[:, None] & r_ok[None, :] & live
    qpe = tl.load(qpe_ptr + b * stride_pb + heads[:, None] * stride_ph + r[None, :], mask=pe_mask, other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, C_PAD], tl.float32)
    table = table_ptr + b * stride_tb
    ahead = first * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] the next tile's positions
    blk = tl.load(table + ahead // page, mask=(ahead < length) & live, other=0)  # [BN] int64, their cache blocks
    for n0 in range(first * BLOCK_N, end * BLOCK_N, BLOCK_N):  # this split's tiles of this sequence only
        n = n0 + tl.arange(0, BLOCK_N)  # [BN]
        ok = n < length  # the last tile's tail: never read
        row = blk * page + n % page
        ahead = n + BLOCK_N
        blk = tl.load(table + ahead // page, mask=ahead < length, other=0)  # one tile ahead (module docstring)
        base = cache_ptr + row[:, None] * stride_cache
        kv = tl.load(base + c[None, :], mask=ok[:, None] & c_ok[None, :], other=0.0)  # [BN, C]
        kpe = tl.load(base + C + r[None, :], mask=ok[:, None] & r_ok[None, :], other=0.0)  # [BN, R]
        s = tl.dot(q, tl.trans(kv), input_precision=PRECISION)
        s = tl.dot(qpe, tl.trans(kpe), acc=s, input_precision=PRECISION)  # [BH, BN] fp32
        s = tl.where(ok[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite from the first tile on: its first row is in range
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])  # [BH, BN]
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(kv.dtype), kv, acc=acc * alpha[:, None], input_precision=PRECISION)  # [BH, C]
        m_i = m_new

    # a sequence read by this one split: normalised and written here, as with one split in the grid
    whole = DIRECT or (live & (tiles <= share))
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # an empty context gives zeros (written by the combine)
    tl.store(
        out_ptr + b * stride_ob + heads[:, None] * stride_oh + c[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=q_mask & whole,
    )
    if not DIRECT:
        at = (b * num_splits + split) * NH + heads  # [BH]
        partial = live & (tiles > share)
        tl.store(part_o_ptr + at[:, None] * C + c[None, :], acc, mask=q_mask & partial)
        tl.store(part_m_ptr + at, m_i, mask=head_ok & partial)
        tl.store(part_l_ptr + at, l_i, mask=head_ok & partial)


@triton.jit(do_not_specialize=["S", "min_tiles", "heads_per_program"])
def _combine_kernel(
    out_ptr,  # [B, NH, C]
    part_o_ptr,  # [B, S, NH, C] fp32
    part_m_ptr,  # [B, S, NH] fp32
    part_l_ptr,  # [B, S, NH] fp32
    lens_ptr,  # [B] int32
    NH,
    S,
    stride_ob,
    stride_oh,
    min_tiles,
    heads_per_program,  # grid (cdiv(NH, heads_per_program), B)
    C: tl.constexpr,
    C_PAD: tl.constexpr,
    S_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    b = tl.program_id(1).to(tl.int64)
    tiles, share = _split_share(tl.load(lens_ptr + b), S, BLOCK_N, min_tiles)
    live = (tiles + share - 1) // share  # the splits that wrote a partial; the others left theirs unwritten
    # one live split wrote the output itself: nothing to do; none (an empty context): zeros, written here
    first = tl.program_id(0) * heads_per_program
    last = tl.where(live == 1, first, tl.minimum(first + heads_per_program, NH))
    s = tl.arange(0, S_PAD)
    c = tl.arange(0, C_PAD)
    c_ok = c < C
    for h in range(first, last):
        at = (b * S + s) * NH + h  # [S_PAD]
        m_s = tl.load(part_m_ptr + at, mask=s < live, other=float("-inf"))  # [S_PAD]
        l_s = tl.load(part_l_ptr + at, mask=s < live, other=0.0)  # [S_PAD]
        m_max = tl.max(m_s, 0)
        m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # no live split (an empty context)
        denom = tl.sum(tl.math.exp2(m_s - m_max) * l_s, 0)
        denom = tl.where(denom > 0, denom, 1.0)
        acc = tl.zeros([C_PAD], tl.float32)
        for i in range(0, live):  # a fixed order: the same bits every run
            at_i = (b * S + i) * NH + h
            w = tl.math.exp2(tl.load(part_m_ptr + at_i) - m_max)
            acc += w * tl.load(part_o_ptr + at_i * C + c, mask=c_ok, other=0.0)
        out = out_ptr + b * stride_ob + h * stride_oh + c
        tl.store(out, (acc / denom).to(out_ptr.dtype.element_ty), mask=c_ok)


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


def num_splits_for(batch: int, head_tiles: int, context: int, num_sms: int) -> tuple[int, int]:
    """(splits of each sequence in the grid, rows a live split reads at least) for a table of `context` rows. While
    the batch's programs do not fill the SMs: enough splits to fill them once, rounded up to a power of two (on an
    H200 3 splits at batch 64 ran 29% slower than 4: `scripts/gpu_mla_sweep.py`), at least `MIN_SPLIT_ROWS` rows
    each. Once they do: chunks of `BALANCE_ROWS` rows, within `MAX_PROGRAMS`. A function of shapes only
    (capturable, deterministic)."""
    programs = batch * head_tiles
    if programs == 0:
        return 1, MIN_SPLIT_ROWS
    if programs >= num_sms:
        chunks = min(_cdiv(context, BALANCE_ROWS), MAX_PROGRAMS // programs, MAX_SPLITS)
        return max(1, chunks), BALANCE_ROWS
    fill = triton.next_power_of_2(_cdiv(num_sms, programs))
    return max(1, min(fill, _cdiv(context, MIN_SPLIT_ROWS), MAX_SPLITS)), MIN_SPLIT_ROWS


def split_tiles(length: int, num_splits: int, block_n: int, min_split_rows: int = MIN_SPLIT_ROWS) -> list[range]:
    """The tiles (of `block_n` rows) each of `num_splits` splits reads of a sequence of `length` rows: equal shares
    of whole tiles, at least `min_split_rows` rows a share, in order; the splits past the last tile get an empty
    range (they read nothing, and the combine skips them). The host twin of the kernels' `_split_share`."""
    tiles = _cdiv(length, block_n)
    share = max(_cdiv(tiles, max(1, num_splits)), _cdiv(min_split_rows, block_n), 1)
    return [range(min(s * share, tiles), min((s + 1) * share, tiles)) for s in range(num_splits)]


def compile_key(splits: int) -> tuple:
    """What decides which compiled variant of the two kernels a launch uses (heads, strides, dtypes and tile
    sizes are fixed for a model; the table's width, the page size and the split count are not specialized on):
    whether the output is written directly, else the split count's power-of-two padding in the combine."""
    return ("direct",) if splits == 1 else ("combine", triton.next_power_of_2(splits))


def warm_up_splits() -> list[int]:
    """Split counts that between them reach every `compile_key` a launch can have (1, then each padding up to
    `MAX_SPLITS`)."""
    pads = [1 << k for k in range(1, MAX_SPLITS.bit_length())]  # 2, 4, ..., MAX_SPLITS
    return [1] + [p // 2 + 1 for p in pads]


def warm_up(q_latent: torch.Tensor, q_pe: torch.Tensor, cache_layer: torch.Tensor, softmax_scale: float) -> None:
    """Compile every variant the decode kernels can need for these heads and this dtype (`warm_up_splits`), on
    one sequence that reads the cache's first row. Why: the split count follows the batch and the table's width,
    so a server meets new ones long after its first steps (a fresh machine compiled four mid-run without this)."""
    q_latent, q_pe = q_latent[:1], q_pe[:1]
    lens = torch.ones(1, dtype=torch.int32, device=q_latent.device)
    for splits in warm_up_splits():
        table = torch.zeros(1, splits, dtype=torch.int64, device=q_latent.device)
        mla_decode(q_latent, q_pe, cache_layer, table, lens, softmax_scale, num_splits=splits)


def mla_decode(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    cache_layer: torch.Tensor,
    table: torch.Tensor,
    lens: torch.Tensor,
    softmax_scale: float,
    *,
    page: int = 1,
    num_splits: int | None = None,
    min_split_rows: int | None = None,
    block_n: int | None = None,
    block_h: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Absorbed MLA decode attention over paged latents, read in place, each sequence over its own length.

    q_latent: [B, nh, C] (q_nope through W_uk), q_pe: [B, nh, R] (roped), cache_layer: [rows, C + R] (one
    layer of the pool, a view), table: [B, W] int64 the cache block of each `page`-row page of a sequence
    (`page` = 1: the cache row of each position), lens: [B] int32 each sequence's context length on the device
    (at most W * page; a length of 0 gives zeros) -> o_latent [B, nh, C] in q's dtype. Nothing past a
    sequence's length is read. `num_splits` and `min_split_rows` (default: `num_splits_for` the shapes and the SM
    count; `MIN_SPLIT_ROWS` for a `num_splits` given),
    `block_n`, `block_h`, `num_warps` and `num_stages` exist for tests and tuning sweeps
    (`scripts/gpu_mla_sweep.py`).
    """
    B, nh, C = q_latent.shape
    R = q_pe.shape[-1]
    W = table.shape[1]
    assert q_pe.shape == (B, nh, R) and cache_layer.shape[1] == C + R, (q_pe.shape, cache_layer.shape)
    assert table.shape[0] == B and table.dtype == torch.int64, (table.shape, table.dtype)
    assert lens.shape == (B,) and lens.dtype == torch.int32, (lens.shape, lens.dtype)
    assert page >= 1, f"page={page}"
    dtype = q_latent.dtype
    assert q_pe.dtype == cache_layer.dtype == dtype and dtype in _DTYPES, "one dtype of fp16/bf16/fp32"
    fp32 = dtype == torch.float32
    block_n = block_n or (BLOCK_N_FP32 if fp32 else BLOCK_N)
    assert block_n >= 16 and block_n & (block_n - 1) == 0, f"block_n={block_n}: a power of two >= 16"
    out = q_latent.new_empty(B, nh, C)  # [B, nh, C]
    if B == 0 or nh == 0:
        return out
    if W == 0:  # as the eager einsum over an empty context
        return out.zero_()
    q_latent = q_latent if q_latent.stride(-1) == 1 else q_latent.contiguous()
    q_pe = q_pe if q_pe.stride(-1) == 1 else q_pe.contiguous()
    assert cache_layer.stride(1) == 1, "cache rows must be contiguous"
    table, lens = table.contiguous(), lens.contiguous()

    block_h = block_h or (16 if nh <= 16 or fp32 else 32)  # tl.dot needs >= 16 rows; [32, C] fp32 acc at most
    assert block_h in (16, 32), f"block_h={block_h}: 16 or 32"
    head_tiles = _cdiv(nh, block_h)
    if num_splits is None:
        num_splits, planned_rows = num_splits_for(B, head_tiles, W * page, _num_sms(q_latent.device))
        min_split_rows = planned_rows if min_split_rows is None else min_split_rows
    splits = max(1, min(num_splits, MAX_SPLITS))
    min_split_rows = MIN_SPLIT_ROWS if min_split_rows is None else min_split_rows
    min_tiles = max(1, _cdiv(min_split_rows, block_n))
    direct = splits == 1
    if direct:
        part_o = part_m = part_l = out  # unused
    else:
        part_o = torch.empty(B, splits, nh, C, dtype=torch.float32, device=out.device)
        part_m = torch.empty(B, splits, nh, dtype=torch.float32, device=out.device)
        part_l = torch.empty(B, splits, nh, dtype=torch.float32, device=out.device)
    precision = "ieee" if fp32 else None  # fp32 products stay fp32 (no tf32)
    c_pad = max(16, triton.next_power_of_2(C))
    _split_kernel[(head_tiles, B, splits)](
        q_latent,
        q_pe,
        cache_layer,
        table,
        lens,
        out,
        part_o,
        part_m,
        part_l,
        softmax_scale * math.log2(math.e),
        page,
        nh,
        q_latent.stride(0),
        q_latent.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        cache_layer.stride(0),
        table.stride(0),
        out.stride(0),
        out.stride(1),
        min_tiles,
        C=C,
        R=R,
        C_PAD=c_pad,
        R_PAD=max(16, triton.next_power_of_2(R)),
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        DIRECT=direct,
        PRECISION=precision,
        num_warps=num_warps or (4 if block_h == 16 else 8),
        num_stages=num_stages or 3,  # the block ids a tile ahead make a third stage pay (module docstring)
    )
    if not direct:
        # a program per head while the batch is small (few long merges); per sequence once it fills the SMs, where
        # most sequences have one split and their programs would do nothing
        per_program = nh if B * head_tiles >= _num_sms(q_latent.device) else 1
        _combine_kernel[(_cdiv(nh, per_program), B)](
            out,
            part_o,
            part_m,
            part_l,
            lens,
            nh,
            splits,
            out.stride(0),
            out.stride(1),
            min_tiles,
            per_program,
            C=C,
            C_PAD=c_pad,
            S_PAD=triton.next_power_of_2(splits),
            BLOCK_N=block_n,
            num_warps=4,
        )
    return out
