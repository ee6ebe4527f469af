"""Variable-length causal prefill attention (flash-attention forward) for MLA, in Triton.

Why: the eager prefill expands keys and values and calls SDPA once per sequence, so a step of many prompts
is a loop of small launches. Here every non-decode sequence of a step is attended in one launch over
packed queries and keys.

Layout (MLA): a query head is `[q_nope | q_rope]` (Dn + Dr, 128 + 64 in DeepSeek); its key is
`[k_nope | k_rope]` where k_rope is one vector per token shared by every head, and values have Dv (128)
columns. The kernel keeps the two parts of the head dimension apart (two dot products per tile), so
neither a 192-wide key nor a per-head copy of k_rope is ever built, and Dqk != Dv costs nothing.

Masking: the queries of a sequence are aligned to the END of its keys: query j of a sequence with n
queries and L keys sees keys 0 .. L - n + j. That is plain causal attention for a fresh prompt (L = n), a
chunk after cached context (L = ctx + n), and a lone decode token (n = 1) sees all L keys.

One program per (head, sequence, tile of BLOCK_M queries). A program loads its query tile once, then
streams the key/value tiles it may see: first those every row of the tile sees (no mask), then the
diagonal tiles (causal mask). Softmax runs online in fp32 (exp2, scale folded in), accumulation is
fp32, nothing is atomic, so the result is deterministic. Tiles are ordered heaviest (last query tiles,
the most keys) first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _load(ptr, is_row, is_col, MASK_ROWS: tl.constexpr, MASK_COLS: tl.constexpr):
    """A 2-D tile load, masked only along the axes that need it (an unneeded column mask could cost the
    vectorized loads along the contiguous axis); masked-out elements read 0."""
    if MASK_ROWS:
        if MASK_COLS:
            x = tl.load(ptr, mask=is_row & is_col, other=0.0)
        else:
            x = tl.load(ptr, mask=is_row, other=0.0)
    else:
        if MASK_COLS:
            x = tl.load(ptr, mask=is_col, other=0.0)
        else:
            x = tl.load(ptr)
    return x


@triton.jit
def _attend_tile(
    acc,
    l_i,
    m_i,
    q1,
    q2,
    k_start,
    k_len,
    n0,
    offs_m,
    diag,
    K1,
    K2,
    V,
    stride_k1t,
    stride_k2t,
    stride_vt,
    qk_scale,
    D1: tl.constexpr,
    D2: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D1: tl.constexpr,
    BLOCK_D2: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PAD_D1: tl.constexpr,
    PAD_D2: tl.constexpr,
    PAD_DV: tl.constexpr,
    MASKED: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One key/value tile [n0, n0 + BLOCK_N) into the running (acc, l_i, m_i); K1/K2/V already point at the
    head. MASKED: the tile may hold keys past the sequence's end or keys some query rows must not see."""
    offs_n = n0 + tl.arange(0, BLOCK_N)  # [BN] key index within the sequence
    rows = (k_start + offs_n).to(tl.int64)  # [BN] packed key rows
    is_key = offs_n < k_len
    d1 = tl.arange(0, BLOCK_D1)
    d2 = tl.arange(0, BLOCK_D2)
    dv = tl.arange(0, BLOCK_DV)
    # keys loaded transposed: [BD, BN]
    k1 = _load(K1 + rows[None, :] * stride_k1t + d1[:, None], is_key[None, :], (d1 < D1)[:, None], MASKED, PAD_D1)
    qk = tl.dot(q1, k1, input_precision=PRECISION)  # [BM, BN] fp32
    k2 = _load(K2 + rows[None, :] * stride_k2t + d2[:, None], is_key[None, :], (d2 < D2)[:, None], MASKED, PAD_D2)
    qk = tl.dot(q2, k2, qk, input_precision=PRECISION)
    qk = qk * qk_scale  # log2 units
    if MASKED:  # query j sees keys <= diag + j, and only real keys
        is_visible = (offs_n[None, :] <= diag + offs_m[:, None]) & is_key[None, :]
        qk = tl.where(is_visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))  # finite: key 0 is visible to every row and comes first
    p = tl.math.exp2(qk - m_new[:, None])  # [BM, BN]
    alpha = tl.math.exp2(m_i - m_new)  # [BM]
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load(V + rows[:, None] * stride_vt + dv[None, :], is_key[:, None], (dv < DV)[None, :], MASKED, PAD_DV)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)  # [BM, BDV]
    return acc, l_i, m_new


@triton.jit(do_not_specialize=["num_m_tiles"])  # one compiled kernel whatever the longest query
def _prefill_attention_kernel(
    Q,
    K1,
    K2,
    V,
    Out,
    CuQ,
    CuK,
    Tiles,  # TILED: [2, G] int32, program g's sequence (-1: none) and query tile
    stride_qt,
    stride_qh,
    stride_k1t,
    stride_k1h,
    stride_k2t,
    stride_k2h,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    qk_scale,
    num_m_tiles,
    D1: tl.constexpr,
    D2: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D1: tl.constexpr,
    BLOCK_D2: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PAD_D1: tl.constexpr,
    PAD_D2: tl.constexpr,
    PAD_DV: tl.constexpr,
    PRECISION: tl.constexpr,
    TILED: tl.constexpr,
):
    head = tl.program_id(0)
    if TILED:  # a fixed grid of G programs (a CUDA graph's), each told its (sequence, tile) by the table
        seq = tl.load(Tiles + tl.program_id(1))
        tile = tl.load(Tiles + tl.num_programs(1) + tl.program_id(1))
        if seq < 0:
            return
    else:
        seq = tl.program_id(1)
        tile = num_m_tiles - 1 - tl.program_id(2)  # heaviest tiles (most keys) launch first
    q_start = tl.load(CuQ + seq)
    q_len = tl.load(CuQ + seq + 1) - q_start
    m0 = tile * BLOCK_M
    if m0 >= q_len:  # this sequence is shorter than the longest one
        return
    k_start = tl.load(CuK + seq)
    k_len = tl.load(CuK + seq + 1) - k_start
    diag = k_len - q_len  # query j sees keys 0 .. diag + j

    offs_m = m0 + tl.arange(0, BLOCK_M)  # [BM] query index within the sequence
    q_rows = (q_start + offs_m).to(tl.int64)
    is_row = offs_m < q_len
    d1 = tl.arange(0, BLOCK_D1)
    d2 = tl.arange(0, BLOCK_D2)
    dv = tl.arange(0, BLOCK_DV)
    q_ptr = Q + q_rows[:, None] * stride_qt + head * stride_qh
    q1 = tl.load(q_ptr + d1[None, :], mask=is_row[:, None] & (d1 < D1)[None, :], other=0.0)  # [BM, BD1]
    q2 = tl.load(q_ptr + D1 + d2[None, :], mask=is_row[:, None] & (d2 < D2)[None, :], other=0.0)  # [BM, BD2]
    K1 = K1 + head * stride_k1h
    K2 = K2 + head * stride_k2h
    V = V + head * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    # Keys below `full_end` are seen by every row of the tile (the first row sees up to diag + m0) and all
    # exist (diag + m0 < k_len): no mask. The rest, up to what the tile's last real row sees, is masked.
    full_end = ((diag + m0 + 1) // BLOCK_N) * BLOCK_N
    hi = diag + tl.minimum(m0 + BLOCK_M, q_len)
    for n0 in range(0, full_end, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q1, q2, k_start, k_len, n0, offs_m, diag, K1, K2, V,
            stride_k1t, stride_k2t, stride_vt, qk_scale,
            D1, D2, DV, BLOCK_N, BLOCK_D1, BLOCK_D2, BLOCK_DV, PAD_D1, PAD_D2, PAD_DV, False, PRECISION,
        )  # fmt: skip
    for n0 in range(full_end, hi, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q1, q2, k_start, k_len, n0, offs_m, diag, K1, K2, V,
            stride_k1t, stride_k2t, stride_vt, qk_scale,
            D1, D2, DV, BLOCK_N, BLOCK_D1, BLOCK_D2, BLOCK_DV, PAD_D1, PAD_D2, PAD_DV, True, PRECISION,
        )  # fmt: skip
    o = acc / l_i[:, None]
    o_ptr = Out + q_rows[:, None] * stride_ot + head * stride_oh + dv[None, :]
    tl.store(o_ptr, o.to(Out.dtype.element_ty), mask=is_row[:, None] & (dv < DV)[None, :])


# (BLOCK_M, BLOCK_N, num_warps, num_stages) for 16-bit inputs (False) and fp32 (True). 16-bit: a 128-query
# tile over two warpgroups (wgmma), keys 64 at a time, two stages; compiled for sm_90 at DeepSeek's 128 + 64
# / 128 head dims it takes 120 KB of shared memory and 190 registers, no spills. fp32 (IEEE dots, no tensor
# cores, a correctness path): half the tile each way, 96 KB.
_TILES = {False: (128, 64, 8, 2), True: (64, 32, 8, 2)}


def _block(d: int) -> int:
    """A power-of-two tile width >= 16 (tl.dot's least) that covers d columns; the rest is masked."""
    return max(16, triton.next_power_of_2(d))


def prefill_attention(
    q: torch.Tensor,
    k_nope: torch.Tensor,
    k_rope: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    softmax_scale: float,
    *,
    out: torch.Tensor | None = None,
    tiles: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Causal attention of packed variable-length sequences, queries aligned to the end of their keys.

    q: [Tq, nh, Dn + Dr]; k_nope: [Tk, nh, Dn]; k_rope: [Tk, nh, Dr] or [Tk, Dr] (one rope key per token,
    shared by every head, as MLA has it); v: [Tk, nh, Dv]. All in one dtype (bf16, fp16 or fp32), on one
    device; any strides (views into a projection's output are read in place; a last dimension that is
    not contiguous is copied first).
    cu_seqlens_q / cu_seqlens_k: [S + 1] int32 on the device, sequence s owns query rows
    cu_seqlens_q[s] .. cu_seqlens_q[s + 1] and key rows cu_seqlens_k[s] .. cu_seqlens_k[s + 1], with at
    least as many keys as queries. max_seqlen_q: the longest query length, a host int (it sizes the grid;
    nothing is read back from the device). -> out [Tq, nh, Dv] in q's dtype.
    tiles: [2, G] int32 on the device (`query_tiles`): the grid is then G programs per head whatever the lengths,
    program g taking query tile tiles[1, g] of sequence tiles[0, g] (-1: nothing), so a CUDA graph can hold the
    launch and each replay read its step's layout; `max_seqlen_q` is then not read.
    block_m, block_n, num_warps, num_stages: the tiling; by default the one of `_TILES` for q's dtype.
    """
    Tq, nh, Dqk = q.shape
    Tk, _, Dn = k_nope.shape
    Dv = v.shape[-1]
    Dr = Dqk - Dn
    if k_rope.dim() == 2:  # shared by every head: a head stride of 0
        k_rope = k_rope.unsqueeze(1).expand(Tk, nh, Dr)
    if k_nope.shape[:2] != (Tk, nh) or k_rope.shape != (Tk, nh, Dr) or v.shape[:2] != (Tk, nh):
        raise ValueError(
            f"shapes do not agree: q {tuple(q.shape)}, k_nope {tuple(k_nope.shape)}, "
            f"k_rope {tuple(k_rope.shape)}, v {tuple(v.shape)}"
        )
    if len({t.dtype for t in (q, k_nope, k_rope, v)}) != 1:
        raise ValueError("q, k_nope, k_rope and v must share one dtype")
    q, k_nope, k_rope, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k_nope, k_rope, v))
    if cu_seqlens_q.dtype != torch.int32 or cu_seqlens_k.dtype != torch.int32:
        raise ValueError("cu_seqlens_q and cu_seqlens_k must be int32")
    num_seqs = cu_seqlens_q.numel() - 1
    if cu_seqlens_k.numel() != num_seqs + 1:
        raise ValueError(f"cu_seqlens_q has {cu_seqlens_q.numel()} entries but cu_seqlens_k {cu_seqlens_k.numel()}")
    if out is None:
        out = q.new_empty(Tq, nh, Dv)
    elif out.shape != (Tq, nh, Dv) or out.stride(-1) != 1 or out.dtype != q.dtype:
        raise ValueError(f"out must be [{Tq}, {nh}, {Dv}] {q.dtype} with a contiguous last dimension")
    if Tq == 0 or num_seqs == 0 or (max_seqlen_q == 0 if tiles is None else tiles.shape[1] == 0):
        return out
    default_m, default_n, default_warps, default_stages = _TILES[q.dtype == torch.float32]
    block_m, block_n = block_m or default_m, block_n or default_n
    num_warps, num_stages = num_warps or default_warps, num_stages or default_stages
    num_m_tiles = triton.cdiv(max_seqlen_q, block_m)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # fp32 stays exact; ignored for 16-bit inputs
    if tiles is not None and (tiles.dtype != torch.int32 or tiles.shape[:1] != (2,) or not tiles.is_contiguous()):
        raise ValueError(f"tiles must be a contiguous [2, G] int32 tensor, got {tuple(tiles.shape)} {tiles.dtype}")
    grid = (nh, num_seqs, num_m_tiles) if tiles is None else (nh, tiles.shape[1], 1)
    _prefill_attention_kernel[grid](
        q, k_nope, k_rope, v, out, cu_seqlens_q, cu_seqlens_k, cu_seqlens_q if tiles is None else tiles,
        q.stride(0), q.stride(1),
        k_nope.stride(0), k_nope.stride(1),
        k_rope.stride(0), k_rope.stride(1),
        v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        softmax_scale * LOG2E,
        num_m_tiles,
        D1=Dn, D2=Dr, DV=Dv,
        BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D1=_block(Dn), BLOCK_D2=_block(Dr), BLOCK_DV=_block(Dv),
        PAD_D1=_block(Dn) != Dn, PAD_D2=_block(Dr) != Dr, PAD_DV=_block(Dv) != Dv,
        PRECISION=precision, TILED=tiles is not None,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


def tile_rows(dtype: torch.dtype) -> int:
    """Query rows per program (BLOCK_M) of the default tiling for `dtype`: what `query_tiles` cuts by."""
    return _TILES[dtype == torch.float32][0]


def query_tiles(query_lens: list[int], block_m: int) -> list[tuple[int, int]]:
    """The (sequence, query tile) of every program a tiled launch runs, heaviest tiles (most keys) first, as the
    untiled grid orders them: sequence s has ceil(query_lens[s] / block_m) tiles."""
    counts = [-(-n // block_m) for n in query_lens]
    return [(s, m) for m in range(max(counts, default=0) - 1, -1, -1) for s, c in enumerate(counts) if m < c]
