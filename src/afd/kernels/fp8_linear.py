"""`fp8_linear`: a block-scaled FP8 GEMM, `y = x @ (W_fp8 * scale).T (+ bias)`, and its reference.

The weight is DeepSeek-V3's format: `W_fp8 [N, K] float8_e4m3fn` with one fp32 scale per `(b0, b1)` block,
`scale [ceil(N/b0), ceil(K/b1)]`. The rows are quantized the way DeepSeek-V3 quantizes activations, per row in
groups of `b1` columns (`fp8_quant.quantize_rows`, one launch), so each MMA is fp8 x fp8 and no tile is converted
in registers; each K step stays inside one scale block (`moe_tiles.scaled_block_k`) and its fp32 partial is
multiplied by the weight rows' and the x rows' scales of that block. Only the fp8 bytes (and the small scales)
leave memory; no dequantized weight is written.

Layout: the weight tile is the MMA's M side and the rows of x its N side ("swap AB"), so 1..16 rows still fill a
tensor-core tile. Tiles come from a fixed table by row count (no autotuning at run time: deterministic, capturable).
These sizes are bound by reading the weight: the N dimension is split into narrow tiles and, where N alone gives
fewer programs than the GPU has SMs, K too (`split_k`). The last program of a tile to finish sums its fp32 partials
in split order (deterministic), so a split costs no second launch: on one H200 that took V2-Lite's decode step in
FP8 from 5.96 to 5.51 ms at batch 8 (a sum launch and a cast launch per linear before). Elsewhere
(`takes_kernel`: past `NARROW_MAX_ROWS` for weights narrower than `WIDE_MIN_N`, past `KERNEL_MAX_ROWS` for any) the
weight is dequantized into a scratch copy (`dequantize_weight`, one pass over the fp8 bytes, five bytes moved per
weight) and cuBLAS multiplies the rows as they are. Both bounds are powers of two and `NARROW_MAX_ROWS` is the
smallest prefill bucket (`afd.buckets.SMALLEST_BUCKET`), so padding a step to any graph bucket (the engine's or an
FFN rank's) never changes the path. Why these bounds (one H200, `scripts/gpu_fp8_linear.py --sweep`, every V2-Lite
and V3 linear): at 1-64 rows fp8 rows beat bf16 rows converted from fp8 tiles at V3's shapes (`o_proj` at one row
39 against 61 us, cuBLAS bf16 63); at 65-128 rows the kernel ties or beats the dense path (V2-Lite's `q_proj` 12.5
against 12.1 us, V3's `o_proj` 95 against 171); at 256 rows its 128 x 64 tiles beat the dense path for every weight
of 4,096 rows or more (V3 `o_proj` 142 against 181 us) and lost or tied below. A configuration depends only on M's
bucket, so `warm_up` compiles every variant a weight meets. Nothing reads device values on the host: CUDA-graph
capturable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from afd.buckets import SMALLEST_BUCKET
from afd.kernels.fp8_quant import quantize_rows
from afd.kernels.moe_tiles import (
    DTYPES,
    FP8_DTYPE,
    FP8_MIN_BLOCK_K,
    check_fp8_weight,
    load_2d,
    quantize_row_groups,
    scaled_block_k,
)

# M buckets of the tile table; past the last one, the dense path
ROW_BUCKETS = (16, 32, 64, 128, 256)
KERNEL_MAX_ROWS = ROW_BUCKETS[-1]
NARROW_MAX_ROWS = SMALLEST_BUCKET  # past this, only weights of at least WIDE_MIN_N rows take the kernel
WIDE_MIN_N = 4096
MIN_K_STEPS_PER_SPLIT = 4  # a K split keeps at least this many steps, so its pipeline fills
MAX_SPLIT_K = 4  # more splits cost the reduction more than they gain (H200 sweep)
DEFAULT_SM_COUNT = 132  # where there is no CUDA device to ask (Triton's interpreter): an H100/H200's


@dataclass(frozen=True)
class LinearConfig:
    """Launch shape: rows of x per program (block_m), weight rows per program (block_n), reduction step (block_k,
    cut to divide the scale block's width), K splits, warps, pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4


# Per M bucket: (block_m, block_n candidates, largest first, stages); `choose_config` picks the width and the K
# splits (`scripts/gpu_fp8_linear.py --sweep` times alternatives). A stage holds a 64 x 128 fp8 weight tile (8 KiB).
# At 64 rows, four 16-row tiles beat one 64-row tile with K splits (H200, V2-Lite's q_proj 10.2 against 12.5 us);
# at 128 rows, 32-row tiles beat one 128-row tile on weights narrower than WIDE_MIN_N (V2-Lite's q_proj 12.5
# against 16.6 us, V3's q_a_proj 19.4 against 23.4) and lose on wide ones (V3's o_proj 112 against 95: `_WIDE`).
_TABLE = {
    16: (16, (64, 32, 16), 4),
    32: (32, (64, 32, 16), 4),
    64: (16, (64, 32, 16), 4),
    128: (32, (64, 32, 16), 4),
    256: (128, (64,), 3),
}
_WIDE = {128: (128, (64,), 3)}  # weights of at least WIDE_MIN_N rows, where they differ from `_TABLE`


def takes_kernel(num_rows: int, out_features: int) -> bool:
    """Whether `fp8_linear` runs the kernel for M rows and N outputs rather than the dense path."""
    return num_rows <= NARROW_MAX_ROWS or (num_rows <= KERNEL_MAX_ROWS and out_features >= WIDE_MIN_N)


def row_bucket(num_rows: int) -> int:
    """The tile table's bucket of M: the smallest of `ROW_BUCKETS` that covers it, 0 (dense path) past them."""
    return next((b for b in ROW_BUCKETS if num_rows <= b), 0)


def choose_config(
    num_rows: int, out_features: int, in_features: int, block: tuple[int, int], sm_count: int
) -> LinearConfig:
    """The tile configuration for `x [num_rows, K] @ W [N, K].T` with scales in `block`s, from M's bucket only (the
    bucket's upper bound stands for M, so every M of a bucket compiles the same kernel; M at most
    `KERNEL_MAX_ROWS`): the widest weight tile whose programs, with up to `MAX_SPLIT_K` K splits, cover half the
    SMs, then no split where the tiles alone cover every SM, else that many splits (the H200 sweep's best at
    V2-Lite's shapes)."""
    bucket = row_bucket(num_rows)
    if not bucket:
        raise ValueError(f"{num_rows} rows: the kernel takes at most {KERNEL_MAX_ROWS} (past that, the dense path)")
    block_m, widths, stages = (_WIDE if out_features >= WIDE_MIN_N else _TABLE).get(bucket, _TABLE[bucket])
    block_k = scaled_block_k(128, block[1], FP8_MIN_BLOCK_K)
    m_tiles = triton.cdiv(bucket, block_m)
    k_steps = triton.cdiv(in_features, block_k)
    max_split = min(MAX_SPLIT_K, max(1, k_steps // MIN_K_STEPS_PER_SPLIT))
    block_n = next(
        (w for w in widths if triton.cdiv(out_features, w) * m_tiles * max_split >= sm_count // 2), widths[-1]
    )
    split = 1 if triton.cdiv(out_features, block_n) * m_tiles >= sm_count else max_split
    return LinearConfig(block_m, block_n, block_k, split, num_stages=stages)


@triton.jit(do_not_specialize=["num_rows"])  # one compiled kernel for every M of a bucket
def _fp8_linear_kernel(
    x_ptr,  # [M, K] float8_e4m3fn
    w_ptr,  # [N, K] float8_e4m3fn
    scale_ptr,  # [ceil(N/SCALE_N), ceil(K/SCALE_K)] fp32
    x_scale_ptr,  # [M, ceil(K/SCALE_K)] fp32: one scale per row of x and K block
    bias_ptr,  # [N] (HAS_BIAS)
    out_ptr,  # [M, N] the output dtype
    part_ptr,  # [SPLIT, M, N] fp32 partials (SPLIT > 1)
    count_ptr,  # [tiles] int32 zeros: how many of a tile's K splits are done; left at zero again (SPLIT > 1)
    num_rows,
    out_features,
    in_features,
    k_per_split,  # a multiple of BLOCK_K
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_sn,
    stride_sk,
    stride_xsm,
    stride_xsk,
    stride_om,
    stride_on,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALE_N: tl.constexpr,
    SCALE_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,  # K splits; the last of a tile's programs to finish sums the partials in split order
):
    pid_m = tl.program_id(0)  # fastest: the programs of one weight tile run side by side (its bytes hit L2)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    r_mask = rows < num_rows
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] weight rows = output columns
    n_mask = n < out_features
    k = tl.arange(0, BLOCK_K)  # [BK]
    x_tile = x_ptr + rows[:, None].to(tl.int64) * stride_xm + k[None, :] * stride_xk  # [BM, BK] pointers
    w_tile = w_ptr + n[:, None].to(tl.int64) * stride_wn + k[None, :] * stride_wk  # [BN, BK] pointers
    s_rows = scale_ptr + (n // SCALE_N) * stride_sn  # [BN] each weight row's scale row
    xs_rows = x_scale_ptr + rows * stride_xsm  # [BM] each x row's scale row
    k_start = pid_s * k_per_split
    k_end = tl.minimum(in_features, k_start + k_per_split)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k_mask = k0 + k < in_features
        xt = load_2d(x_tile + k0 * stride_xk, r_mask, k_mask, False, EVEN_K)  # [BM, BK] fp8
        wt = load_2d(w_tile + k0 * stride_wk, n_mask, k_mask, EVEN_N, EVEN_K)  # [BN, BK] fp8
        s = tl.load(s_rows + (k0 // SCALE_K) * stride_sk, mask=n_mask, other=0.0)  # [BN] fp32, one K block
        sx = tl.load(xs_rows + (k0 // SCALE_K) * stride_xsk, mask=r_mask, other=0.0)  # [BM] fp32
        acc += tl.dot(wt, tl.trans(xt)) * s[:, None] * sx[None, :]  # [BN, BM] fp8 x fp8 -> fp32
    mask = r_mask[None, :] & n_mask[:, None]
    out = out_ptr + rows[None, :].to(tl.int64) * stride_om + n[:, None] * stride_on
    if SPLIT > 1:
        tile = rows[None, :].to(tl.int64) * out_features + n[:, None]  # [BN, BM] in a contiguous [M, N]
        tl.store(part_ptr + pid_s * num_rows * out_features + tile, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial stored before the count says so
        counter = count_ptr + pid_m * tl.num_programs(1) + pid_n
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:  # the others are done
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for split in tl.static_range(SPLIT):  # fixed order: every run gives the same bits
                part = part_ptr + split * num_rows * out_features + tile
                acc += tl.load(part, mask=mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                acc += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(counter, 0)  # ready for the next call
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


def check_fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None = None,
) -> tuple[int, int]:
    """(N, K) of an fp8 weight `[N, K]` checked against rows `x [..., K]`, its fp32 scales and a bias `[N]`;
    ValueError in one sentence for what the kernel does not take."""
    if x.dtype not in DTYPES:
        raise ValueError(f"fp8_linear takes rows in one of {DTYPES}, not {x.dtype}")
    if weight.dtype != FP8_DTYPE or weight.dim() != 2:
        raise ValueError(f"fp8_linear needs a 2-d {FP8_DTYPE} weight, got {tuple(weight.shape)} {weight.dtype}")
    out_features, in_features = weight.shape
    if x.shape[-1] != in_features:
        raise ValueError(f"rows {tuple(x.shape)} do not fit weight {tuple(weight.shape)} (in_features differ)")
    check_fp8_weight(weight[None], scale[None], block, -(-out_features // block[0]), FP8_MIN_BLOCK_K)
    if bias is not None and tuple(bias.shape) != (out_features,):
        raise ValueError(f"bias {tuple(bias.shape)} does not fit weight {tuple(weight.shape)}")
    return out_features, in_features


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (a host-side property, no sync); `DEFAULT_SM_COUNT` off CUDA."""
    if device.type != "cuda":
        return DEFAULT_SM_COUNT
    return torch.cuda.get_device_properties(device).multi_processor_count


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None = None,
    *,
    config: LinearConfig | None = None,
) -> torch.Tensor:
    """`x [..., K] @ (weight * scale).T + bias -> [..., N]` in x's dtype: `weight [N, K] float8_e4m3fn`,
    `scale [ceil(N/b0), ceil(K/b1)] fp32` with `block = (b0, b1)` (b1 a multiple of 32, any b0), `bias [N]`.
    Where the kernel runs (`takes_kernel`), x is quantized per row and b1 group (`fp8_linear_reference` says what
    that computes); the dense path multiplies x as it is. `config`: a tile configuration other than
    the table's (tests, sweeps; the kernel at any M). Allocations depend on shapes only."""
    out_features, in_features = check_fp8_linear(x, weight, scale, block, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, in_features)  # [M, K]
    num_rows = x2.shape[0]
    if num_rows == 0 or out_features == 0:
        return x.new_zeros(*lead, out_features)
    if config is None and not takes_kernel(num_rows, out_features):
        w = dequantize_weight(weight, scale, block, x.dtype)
        return F.linear(x, w, None if bias is None else bias.to(x.dtype))
    cfg = config or choose_config(num_rows, out_features, in_features, block, sm_count(x.device))
    block_k = scaled_block_k(cfg.block_k, block[1], FP8_MIN_BLOCK_K)
    k_steps = triton.cdiv(in_features, block_k)
    split = max(1, min(cfg.split_k, k_steps))
    k_per_split = triton.cdiv(k_steps, split) * block_k
    split = triton.cdiv(in_features, k_per_split)  # no empty split
    rows, x_scale = quantize_rows(x2, block[1])  # [M, K] fp8, [M, ceil(K/b1)] fp32
    y = x.new_empty(num_rows, out_features)  # [M, N]
    grid = (triton.cdiv(num_rows, cfg.block_m), triton.cdiv(out_features, cfg.block_n), split)
    parts, counts = y, y  # unused without a K split
    if split > 1:
        parts = torch.empty(split, num_rows, out_features, dtype=torch.float32, device=x.device)
        counts = split_counters(x.device, grid[0] * grid[1])
    _fp8_linear_kernel[grid](
        rows, weight, scale, x_scale, bias if bias is not None else scale, y, parts, counts,
        num_rows, out_features, in_features, k_per_split,
        rows.stride(0), rows.stride(1), weight.stride(0), weight.stride(1), scale.stride(0), scale.stride(1),
        x_scale.stride(0), x_scale.stride(1), y.stride(0), y.stride(1),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k, SCALE_N=block[0], SCALE_K=block[1],
        EVEN_N=out_features % cfg.block_n == 0, EVEN_K=in_features % block_k == 0, HAS_BIAS=bias is not None,
        SPLIT=split, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return y.view(*lead, out_features)


_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []  # counters a CUDA graph may still point at, never freed


def split_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed int32 counters for `tiles` output tiles of a K-split launch on `device`'s current stream, kept and
    reused (each launch leaves them at zero), so a split costs no memset launch. Launches on one stream run one
    after another, so they never share a counter at the same time; a stream (a CUDA graph's capture stream too) gets
    its own. A launch needing more gets a larger set; the smaller one stays allocated for the graphs that use it."""
    stream = torch.cuda.current_stream(device).stream_id if device.type == "cuda" else 0
    key = (device, stream)
    counters = _COUNTERS.get(key)
    if counters is None or counters.numel() < tiles:
        if counters is not None:
            _OUTGROWN.append(counters)
        counters = torch.zeros(max(tiles, 1024), dtype=torch.int32, device=device)
        _COUNTERS[key] = counters
    return counters


DEQUANT_TILE = (32, 128)  # (rows, columns) of the weight per program of `dequantize_weight`


@triton.jit
def _dequantize_kernel(
    w_ptr,  # [B, N, K] float8_e4m3fn
    scale_ptr,  # [B, ceil(N/SCALE_N), ceil(K/SCALE_K)] fp32
    out_ptr,  # [B, N, K] contiguous
    out_features,
    in_features,
    stride_wb,
    stride_wn,
    stride_wk,
    stride_sb,
    stride_sn,
    stride_sk,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALE_N: tl.constexpr,
    SCALE_K: tl.constexpr,
    ONE_SCALE: tl.constexpr,  # the tile lies inside one scale block: one scalar load instead of one per element
):
    b = tl.program_id(2).to(tl.int64)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (n < out_features)[:, None] & (k < in_features)[None, :]
    w = tl.load(w_ptr + b * stride_wb + n[:, None] * stride_wn + k[None, :] * stride_wk, mask=mask, other=0.0)
    if ONE_SCALE:
        block_n = tl.program_id(0) * BLOCK_N // SCALE_N
        s = tl.load(scale_ptr + b * stride_sb + block_n * stride_sn + tl.program_id(1) * BLOCK_K // SCALE_K * stride_sk)
    else:
        s_ptr = scale_ptr + b * stride_sb + (n // SCALE_N)[:, None] * stride_sn + (k // SCALE_K)[None, :] * stride_sk
        s = tl.load(s_ptr, mask=mask)
    out = out_ptr + (b * out_features + n[:, None]) * in_features + k[None, :]
    tl.store(out, (w.to(tl.float32) * s).to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_weight(
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    dtype: torch.dtype,
    *,
    tile: tuple[int, int] = DEQUANT_TILE,
    num_warps: int = 4,
) -> torch.Tensor:
    """`weight [..., N, K] float8_e4m3fn * scale [..., ceil(N/b0), ceil(K/b1)]` (one fp32 scale per `block`) -> a
    new contiguous `[..., N, K]` tensor of `dtype`, the product in fp32 rounded once (as `afd.model.fp8.dequantize`),
    in one launch: fp8 bytes read, `dtype` written. Views (a stack's half, a slice of experts) are read in place.
    `tile` and `num_warps` exist for tests and tuning sweeps (`scripts/gpu_moe_fp8.py --sweep-dequant`)."""
    *lead, out_features, in_features = weight.shape
    w3, s3 = weight.reshape(-1, out_features, in_features), scale.reshape(-1, *scale.shape[-2:])
    out = torch.empty(*lead, out_features, in_features, dtype=dtype, device=weight.device)
    grid = (triton.cdiv(out_features, tile[0]), triton.cdiv(in_features, tile[1]), w3.shape[0])
    if out.numel() == 0:
        return out
    _dequantize_kernel[grid](
        w3,
        s3,
        out,
        out_features,
        in_features,
        w3.stride(0),
        w3.stride(1),
        w3.stride(2),
        s3.stride(0),
        s3.stride(1),
        s3.stride(2),
        BLOCK_N=tile[0],
        BLOCK_K=tile[1],
        SCALE_N=block[0],
        SCALE_K=block[1],
        ONE_SCALE=block[0] % tile[0] == 0 and block[1] % tile[1] == 0,
        num_warps=num_warps,
    )
    return out


def warm_up_rows(max_rows: int) -> list[int]:
    """One row count per tile bucket up to `max_rows` (the bucket's upper bound, so its configuration), plus
    `max_rows` itself when it lies past the kernel's buckets (the dense path's dequantization)."""
    counts = [b for b in ROW_BUCKETS if b <= max_rows]
    if max_rows > KERNEL_MAX_ROWS:
        counts.append(max_rows)
    elif not counts or counts[-1] < max_rows:
        counts.append(row_bucket(max_rows))
    return counts


def warm_up(
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    dtype: torch.dtype,
    max_rows: int,
    bias: torch.Tensor | None = None,
) -> None:
    """Compile every kernel variant this weight meets with rows of `dtype`, up to `max_rows` rows: one call per
    tile bucket (`warm_up_rows`), on zero rows."""
    for rows in warm_up_rows(max_rows):
        fp8_linear(torch.zeros(rows, weight.shape[1], dtype=dtype, device=weight.device), weight, scale, block, bias)


def fp8_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The kernel's oracle in plain PyTorch: x quantized per row and b1 group and dequantized again
    (`moe_tiles.quantize_row_groups`), the weight dequantized in fp32 (`W[i, j] * scale[i // b0, j // b1]`, ragged
    edges cut), the product and bias in fp32, one rounding to x's dtype."""
    out_features, in_features = weight.shape
    x2 = x.reshape(-1, in_features)
    q, q_scale = quantize_row_groups(x2, block[1])
    xs = (q.float() * q_scale.repeat_interleave(block[1], dim=1)[:, :in_features]).reshape(x.shape)
    s = scale.float().repeat_interleave(block[0], dim=0)[:out_features]
    s = s.repeat_interleave(block[1], dim=1)[:, :in_features]  # [N, K]
    y = xs @ (weight.float() * s).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
