"""Tile shapes of the decode MoE GEMMs (`moe_gate_up`, `moe_down`) and the Triton helper both share.

Block sizes come from a small fixed table by rows per expert: no autotuning at run time, so every run is
deterministic and capturable. Block-scaled FP8 weights (float8_e4m3fn, one fp32 scale per `(b0, b1)` block) take
the same table with the reduction step cut to divide `b1` (`scaled_block_k`), so a weight tile never straddles
two scale blocks along K and its scales are one per weight row; their rows are fp8 too, one scale per row and
`b1`-wide group (`quantize_row_groups`), so a K step has one scale per row as well.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP8_DTYPE = torch.float8_e4m3fn
MIN_BLOCK_K = 16  # tl.dot's smallest reduction step
FP8_MIN_BLOCK_K = 32  # an fp8 x fp8 tl.dot's (the MoE kernels' fp8 rows): Triton refuses less on the GPU


@dataclass(frozen=True)
class TileConfig:
    """Launch shape of `expert_gate_up` / `expert_down`: rows per chunk (block_m), weight rows per program
    (block_n), reduction step (block_k), warps and software-pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4


# By rows per expert (upper bound of the usual count, see `rows_per_expert_hint`). Chosen on one H200
# (2026-11-30, bf16, V2-Lite shapes, 26 layers of distinct weights in a CUDA graph, the device-to-device copy
# at 4.27 TB/s in the same run; `python test_kernel_moe.py --sweep`): the best of 9 tile shapes per row,
# within ~3% of each other except where noted. Alone, gate/up streamed 3.39 / 4.35 / 4.29 / 3.98 TB/s and down
# 2.85 / 4.06 / 3.95 / 3.51 TB/s at T = 1 / 8 / 64 / 256. A gate/up stage holds two 64x128 weight tiles (gate
# and up, 32 KiB) plus the rows. At block_m 64 the down projection wants 128x64 tiles (3.51 TB/s; 64x128 with
# 4 stages: 2.64).
_GATE_UP_CONFIGS = {
    16: TileConfig(16, 64, 128, num_warps=4, num_stages=3),
    32: TileConfig(32, 64, 128, num_warps=4, num_stages=4),
    64: TileConfig(64, 64, 128, num_warps=4, num_stages=4),
}
_DOWN_CONFIGS = {
    16: TileConfig(16, 64, 128, num_warps=4, num_stages=3),
    32: TileConfig(32, 64, 128, num_warps=4, num_stages=4),
    64: TileConfig(64, 128, 64, num_warps=4, num_stages=4),
}


def tile_bucket(rows: int) -> int:
    """Smallest block_m of the tables (16, 32, 64) that covers `rows` (64 above: larger groups loop)."""
    return 16 if rows <= 16 else 32 if rows <= 32 else 64


def rows_per_expert_hint(num_tokens: int, top_k: int, num_local_experts: int) -> int:
    """A host-side guess of the largest group, from shapes only: a token picks an expert at most once, so never
    more than `num_tokens`; under even routing the mean is `T*K/E` (E counts local experts only, so a shard
    overestimates it, the safe side), and twice the mean plus 8 covers the usual maximum."""
    mean = -(-num_tokens * top_k // max(num_local_experts, 1))
    return max(1, min(num_tokens, 2 * mean + 8))


def gate_up_config(rows_hint: int) -> TileConfig:
    return _GATE_UP_CONFIGS[tile_bucket(rows_hint)]


def down_config(rows_hint: int) -> TileConfig:
    return _DOWN_CONFIGS[tile_bucket(rows_hint)]


def fit_dtype(cfg: TileConfig, dtype: torch.dtype) -> TileConfig:
    """The table is sized for 2-byte weights; fp32 tiles take half the reduction step, so the stages keep the
    same bytes of shared memory (the bf16 gate/up rows would not fit an SM's shared memory in fp32)."""
    if dtype.itemsize <= 2:
        return cfg
    return TileConfig(cfg.block_m, cfg.block_n, max(16, cfg.block_k // 2), cfg.num_warps, cfg.num_stages)


def fp8_block_supported(block: tuple[int, int], min_k: int = MIN_BLOCK_K) -> bool:
    """Whether the kernels take FP8 weights in `(b0, b1)` blocks: any b0; b1 a multiple of `min_k`, so a
    power-of-two reduction step of at least `min_k` divides it (`MIN_BLOCK_K` for 16/32-bit rows,
    `FP8_MIN_BLOCK_K` for fp8 rows; DeepSeek-V3's 128 x 128 suits both)."""
    return block[0] > 0 and block[1] > 0 and block[1] % min_k == 0


def scaled_block_k(block_k: int, scale_k: int, min_k: int = MIN_BLOCK_K) -> int:
    """The reduction step for weights scaled in blocks `scale_k` wide along K: the largest power of two up to
    `block_k` (at least `min_k`) that divides `scale_k`, so each K step reads one scale per weight row."""
    if scale_k % min_k:
        raise ValueError(f"an fp8 scale block {scale_k} wide along K is not a multiple of {min_k}")
    step = max(block_k, min_k)
    while scale_k % step:
        step //= 2
    return step


def check_fp8_weight(
    w: torch.Tensor,
    scale: torch.Tensor | None,
    block: tuple[int, int] | None,
    scale_rows: int,
    min_k: int = MIN_BLOCK_K,
) -> None:
    """A float8_e4m3fn weight `[E, N, K]` needs fp32 `scale [E, scale_rows, ceil(K/b1)]` and a block the kernels
    take (`fp8_block_supported(block, min_k)`)."""
    if scale is None or block is None:
        raise ValueError(f"an {w.dtype} weight needs its block scales and block size")
    if not fp8_block_supported(block, min_k):
        raise ValueError(f"fp8 block {block} is not supported by the kernels (b1 must be a multiple of {min_k})")
    want = (w.shape[0], scale_rows, -(-w.shape[2] // block[1]))
    if scale.dtype != torch.float32 or tuple(scale.shape) != want:
        raise ValueError(f"fp8 scales {tuple(scale.shape)} {scale.dtype} do not fit weight {tuple(w.shape)}, {want}")


FP8_MAX = 448.0  # the largest finite e4m3fn value


def quantize_row_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows `x [N, K]` -> `(x_fp8 [N, K] float8_e4m3fn, scale [N, ceil(K/group)] fp32)`, per row and group
    `scale = amax / 448`, `x_fp8 = round(x / scale)` (DeepSeek-V3's 1 x 128 activation groups; the weights'
    recipe); the last group may be partial, like the weights' last block; an all-zero group gets scale 1.
    Shapes only: capturable in a CUDA graph."""
    rows, width = x.shape
    num_groups = -(-width // group)
    padded = x.float()
    if width % group:
        padded = F.pad(padded, (0, num_groups * group - width))  # zeros change no group's amax
    groups = padded.view(rows, num_groups, group)
    amax = groups.abs().amax(dim=-1, keepdim=True)  # [N, G, 1]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (groups / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(rows, num_groups * group)[:, :width]
    return q, scale.squeeze(-1)


def check_rows(x: torch.Tensor, x_scale: torch.Tensor | None, w: torch.Tensor, block: tuple[int, int] | None) -> None:
    """Rows `x [N, K]` against weights `w [E, ., K]`: 16/32-bit rows with weights of their dtype, or fp8 rows with
    fp8 weights of `block` and `x_scale [N, ceil(K/b1)]` fp32 (`quantize_row_groups(x, b1)`), never one fp8 alone."""
    if w.dtype != FP8_DTYPE:
        if x_scale is not None:
            raise ValueError(f"fp8 rows need fp8 weights, got {w.dtype}")
        if x.dtype not in DTYPES or w.dtype != x.dtype:
            raise ValueError(f"rows {x.dtype}, weights {w.dtype}: need one dtype of {DTYPES}, or fp8 rows and weights")
        return
    if x_scale is None or block is None:
        raise ValueError("fp8 weights need fp8 rows with their scales (quantize_row_groups) and the block size")
    want = (x.shape[0], -(-x.shape[1] // block[1]))
    if x.dtype != FP8_DTYPE or x_scale.dtype != torch.float32 or tuple(x_scale.shape) != want:
        raise ValueError(
            f"fp8 rows {tuple(x.shape)} {x.dtype} with scales {tuple(x_scale.shape)} {x_scale.dtype} do not fit "
            f"groups of {block[1]}"
        )


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs: full fp32 products (tl.dot would otherwise round them to tf32); bf16/fp16: the default.
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def load_2d(ptrs, row_mask, col_mask, EVEN_ROWS: tl.constexpr, EVEN_COLS: tl.constexpr):
    """A [R, C] tile, masked only along the dimensions that do not divide evenly (zeros outside)."""
    if EVEN_ROWS:
        if EVEN_COLS:
            return tl.load(ptrs)
        else:
            return tl.load(ptrs, mask=col_mask[None, :], other=0.0)
    else:
        if EVEN_COLS:
            return tl.load(ptrs, mask=row_mask[:, None], other=0.0)
        else:
            return tl.load(ptrs, mask=row_mask[:, None] & col_mask[None, :], other=0.0)
