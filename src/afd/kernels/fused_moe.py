"""Routed experts in Triton: four launches a MoE layer, each touched expert's weights streamed once.

At decode sizes (1..256 tokens, top-6 of 64 experts: 0..~40 rows per expert) the routed experts are bound by
reading the weights, not by the matmuls, and `torch._grouped_mm` streams them at about half the copy rate with
~10 small kernels around it. Here a MoE layer is four launches, none of which reads anything back to the host
(so a CUDA graph captures them) and none of which uses atomics (so every run gives the same bits):

1. `moe_sort.sort_pairs`: a stable counting sort of the T*K (token, k) pairs by local expert in one kernel.
2. `moe_gate_up.expert_gate_up`: grid (expert, tile of I), SwiGLU of the grouped rows kept in registers.
3. `moe_down.expert_down`: grid (expert, tile of H), weighted and stored in (t, k) pair order.
4. `moe_combine.combine_pairs`: `out[t] = sum_k y[t, k]` over the local pairs only, k in order.

The eager PyTorch code in `afd.model.moe` stays the CPU path and the oracle of the tests (`test_kernel_moe.py`).
Tile shapes come from the fixed table in `moe_tiles`.

Block-scaled FP8 experts (DeepSeek-V3's format: `w13`/`w2` float8_e4m3fn, one fp32 scale per `(b0, b1)` block,
passed as `ExpertScales`) take the same four launches with fp8 rows: x, and each pair's SwiGLU output before the
down projection, quantized per row in groups of `b1` (`fp8_quant.quantize_rows`, DeepSeek-V3's 1 x 128
activations), so both GEMMs are fp8 x fp8 MMAs with both scales applied in registers: half the weight bytes of
bf16, no weight tile converted, nothing dequantized in memory. On one H200 that beats converting each weight tile
to bf16 rows at every batch size measured (1 to 4096 tokens; docs/fp8.md), so it is the only FP8 form. Past
`PREFILL_ROWS_PER_EXPERT` rows per expert (prefill) FP8 experts take `moe_prefill`'s kernels instead, tiles of rows
on the MMA's M side over every expert's rows at once (the matmuls, not the weights, bound them there), with the
SwiGLU output quantized in gate/up's epilogue, and the pairs sorted by `torch.argsort` (`moe_sort.sort_pairs`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from afd.buckets import path_rows
from afd.kernels import int_kind
from afd.kernels.fp8_quant import quantize_rows
from afd.kernels.moe_combine import combine_pairs
from afd.kernels.moe_down import expert_down
from afd.kernels.moe_gate_up import check_gate_up, expert_gate_up
from afd.kernels.moe_prefill import DOWN_TILE, GATE_UP_TILE, RowTileConfig, down_rows, gate_up_rows
from afd.kernels.moe_sort import PAIR_BLOCK, pair_tile, sort_pairs
from afd.kernels.moe_tiles import DTYPES, TileConfig, rows_per_expert_hint, tile_bucket

# Rows per expert (`rows_per_expert_hint`) from which FP8 experts take `moe_prefill`'s row tiles.
PREFILL_ROWS_PER_EXPERT = 128


Configs = tuple[TileConfig, TileConfig] | tuple[RowTileConfig, RowTileConfig]


def takes_row_tiles(
    num_rows: int, top_k: int, num_experts: int, scales: ExpertScales | None, configs: Configs | None = None
) -> bool:
    """Whether `num_rows` tokens (or grouped rows, top_k 1) take `moe_prefill`'s kernels: FP8 experts with
    `PREFILL_ROWS_PER_EXPERT` rows per expert or more for `path_rows(num_rows)` (padding never changes the path),
    or `configs` of theirs given."""
    if scales is None or configs is not None:
        return scales is not None and isinstance(configs[0], RowTileConfig)
    return rows_per_expert_hint(path_rows(num_rows), top_k, num_experts) >= PREFILL_ROWS_PER_EXPERT


def routed_compile_key(num_tokens: int, top_k: int, num_local_experts: int) -> tuple:
    """What decides which compiled variants `fused_routed_experts` launches for `num_tokens` rows (the model's
    sizes fixed): the pair count and its block count (kinds of integer), the sort's pair tile, the tile row
    of the expert GEMMs, and whether FP8 experts take the row tiles."""
    num_pairs = num_tokens * top_k
    hint = rows_per_expert_hint(num_tokens, top_k, num_local_experts)
    sort = (int_kind(num_pairs), int_kind(triton.cdiv(num_pairs, PAIR_BLOCK)), pair_tile(num_pairs))
    row_tiles = rows_per_expert_hint(path_rows(num_tokens), top_k, num_local_experts) >= PREFILL_ROWS_PER_EXPERT
    return (*sort, tile_bucket(hint), row_tiles)


def warm_up_token_counts(top_k: int, num_local_experts: int, max_tokens: int) -> list[int]:
    """The fewest token counts up to `max_tokens` whose launches between them compile every variant a step of
    up to `max_tokens` rows can need (the first count of each `routed_compile_key`)."""
    first: dict[tuple, int] = {}
    for num_tokens in range(1, max_tokens + 1):
        first.setdefault(routed_compile_key(num_tokens, top_k, num_local_experts), num_tokens)
    return sorted(first.values())


@dataclass(frozen=True)
class ExpertScales:
    """fp32 block scales of FP8 experts: `w13 [E, 2 * ceil(I/b0), ceil(H/b1)]` (gate's rows, then up's), `w2 [E,
    ceil(H/b0), ceil(I/b1)]`, `block = (b0, b1)` (b1 a multiple of 32, an fp8 MMA's smallest K step:
    `moe_tiles.FP8_MIN_BLOCK_K`)."""

    w13: torch.Tensor
    w2: torch.Tensor
    block: tuple[int, int]


def _fp8_rows(x: torch.Tensor, scales: ExpertScales | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What a GEMM reads of rows `x [N, K]` (x, or the SwiGLU output before the down projection): x itself for
    16/32-bit experts (no scales); with FP8 experts' `scales`, x quantized per row in groups of the block's width
    and its scales [N, ceil(K/b1)]."""
    if x.dtype not in DTYPES:
        raise ValueError(f"rows {x.dtype}: need one dtype of {DTYPES}")
    if scales is None:
        return x, None
    return quantize_rows(x, scales.block[1])


def _check_experts(
    rows: torch.Tensor, x_scale: torch.Tensor | None, w13: torch.Tensor, w2: torch.Tensor, scales: ExpertScales | None
) -> tuple[int, int, int]:
    """(E, H, I) of stacked experts `w13 [E, 2I, H]`, `w2 [E, H, I]`, checked against the rows `_fp8_rows` gave: both
    in the rows' dtype, or both float8_e4m3fn with `scales`."""
    scale, block = (scales.w13, scales.block) if scales is not None else (None, None)
    num_experts, hidden, inter = check_gate_up(rows, w13, scale, block, x_scale)
    if w2.dtype != w13.dtype or tuple(w2.shape) != (num_experts, hidden, inter):
        raise ValueError(f"w2 {tuple(w2.shape)} {w2.dtype} does not fit w13 {tuple(w13.shape)} {w13.dtype}")
    return num_experts, hidden, inter


def _scale_args(scales: ExpertScales | None) -> tuple[dict, dict]:
    """Keyword arguments of `expert_gate_up` and `expert_down` for the experts' scales (none for 16/32-bit)."""
    if scales is None:
        return {}, {}
    return {"scale": scales.w13, "block": scales.block}, {"scale": scales.w2, "block": scales.block}


def _gate_up_row_tiles(
    rows: torch.Tensor,
    x_scale: torch.Tensor,
    offs: torch.Tensor,
    w13: torch.Tensor,
    scales: ExpertScales,
    token_idx: torch.Tensor | None,
    dtype: torch.dtype,
    config: RowTileConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe_prefill.gate_up_rows` and the down projection's fp8 rows: quantized in its epilogue where a tile is one
    scale group wide on a GPU, else by `quantize_rows` after it."""
    group = scales.block[1]
    fused = rows.is_cuda and group == config.block_n
    act, act_scale = gate_up_rows(
        rows, x_scale, offs, w13, scales.w13, scales.block,
        token_idx=token_idx, quantize_group=group if fused else None, out_dtype=dtype, config=config,
    )  # fmt: skip
    return (act, act_scale) if fused else quantize_rows(act, group)


def fused_grouped_expert_mlp(
    x: torch.Tensor,
    offs: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    configs: Configs | None = None,
    scales: ExpertScales | None = None,
) -> torch.Tensor:
    """`afd.model.moe.grouped_expert_mlp_offsets` in two launches: x [N, H] grouped by `offs` [E] int32 (device
    cumulative ends), w13 [E, 2I, H], w2 [E, H, I] (x's dtype, or FP8 with `scales`: fp8 rows, as in
    `fused_routed_experts`, with its `configs`) -> [N, H] in x.dtype, unweighted; rows at and past `offs[-1]` are
    not written (undefined), as there."""
    rows, x_scale = _fp8_rows(x, scales)  # [N, H], [N, ceil(H/b1)] (FP8 only)
    num_experts, _, _ = _check_experts(rows, x_scale, w13, w2, scales)
    if takes_row_tiles(x.shape[0], 1, num_experts, scales, configs):
        up_cfg, down_cfg = configs or (GATE_UP_TILE, DOWN_TILE)
        act, act_scale = _gate_up_row_tiles(rows, x_scale, offs, w13, scales, None, x.dtype, up_cfg)
        out = torch.empty_like(x)
        return down_rows(act, act_scale, offs, w2, scales.w2, scales.block, out, config=down_cfg)
    hint = rows_per_expert_hint(x.shape[0], 1, num_experts)
    up_cfg, down_cfg = configs or (None, None)
    up_scale, down_scale = _scale_args(scales)
    act = expert_gate_up(  # [N, I]
        rows, offs, w13, rows_hint=hint, config=up_cfg, x_scale=x_scale, out_dtype=x.dtype, **up_scale
    )
    act, act_scale = _fp8_rows(act, scales)  # the down GEMM's rows: fp8 for FP8 experts
    out = torch.empty_like(x)  # [N, H]
    return expert_down(act, offs, w2, out=out, rows_hint=hint, config=down_cfg, act_scale=act_scale, **down_scale)


def fused_routed_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    expert_start: int = 0,
    *,
    configs: Configs | None = None,
    scales: ExpertScales | None = None,
) -> torch.Tensor:
    """`afd.model.moe.routed_experts` in four launches: x [T, H] -> fp32 [T, H], the sum over the (t, k) pairs whose
    expert is one of the stacked `[expert_start, expert_start + E)` of `topk_weights[t, k] * expert(x[t])`.

    topk_ids: [T, K] int; topk_weights: [T, K] fp32; w13: [E, 2I, H]; w2: [E, H, I] (x's dtype, or FP8 with
    `scales`). No host sync and shapes that depend only on (T, K): capturable in a CUDA graph; no atomics: the same
    bits every run. FP8 experts take fp8 rows: x and each pair's SwiGLU output quantized per row in groups of the
    block's width `b1` (`fp8_quant.quantize_rows`), both GEMMs fp8 x fp8, on the row tiles at prefill sizes
    (`takes_row_tiles`). `configs`: both GEMMs' tiles, `TileConfig`s for the decode kernels or `RowTileConfig`s
    for the row tiles (which then run at any size); by default the size picks.
    """
    rows, x_scale = _fp8_rows(x, scales)  # [T, H], [T, ceil(H/b1)] (FP8 only)
    num_experts, hidden, _ = _check_experts(rows, x_scale, w13, w2, scales)
    num_tokens, top_k = topk_ids.shape
    out = torch.empty(num_tokens, hidden, dtype=torch.float32, device=x.device)  # [T, H]
    if num_tokens == 0:
        return out
    if num_experts == 0:
        return out.zero_()
    pair_idx, token_idx, offs = sort_pairs(topk_ids, expert_start, num_experts)  # [P], [P], [E]
    by_pair = torch.empty(num_tokens * top_k, hidden, dtype=torch.float32, device=x.device)  # [P, H]
    weights = topk_weights.reshape(-1).float().contiguous()  # [P]
    if takes_row_tiles(num_tokens, top_k, num_experts, scales, configs):
        up_cfg, down_cfg = configs or (GATE_UP_TILE, DOWN_TILE)
        act, act_scale = _gate_up_row_tiles(rows, x_scale, offs, w13, scales, token_idx, x.dtype, up_cfg)
        down_rows(
            act,
            act_scale,
            offs,
            w2,
            scales.w2,
            scales.block,
            by_pair,
            dest_idx=pair_idx,
            weights=weights,
            config=down_cfg,
        )
        return combine_pairs(by_pair, topk_ids, out, expert_start, num_experts)
    hint = rows_per_expert_hint(num_tokens, top_k, num_experts)
    up_cfg, down_cfg = configs or (None, None)
    up_scale, down_scale = _scale_args(scales)
    act = expert_gate_up(  # [P, I]
        rows,
        offs,
        w13,
        token_idx=token_idx,
        rows_hint=hint,
        config=up_cfg,
        x_scale=x_scale,
        out_dtype=x.dtype,
        **up_scale,
    )
    act, act_scale = _fp8_rows(act, scales)  # [P, I]: the down GEMM's rows, fp8 for FP8 experts
    expert_down(
        act,
        offs,
        w2,
        out=by_pair,
        dest_idx=pair_idx,
        weights=weights,
        rows_hint=hint,
        config=down_cfg,
        act_scale=act_scale,
        **down_scale,
    )
    return combine_pairs(by_pair, topk_ids, out, expert_start, num_experts)
