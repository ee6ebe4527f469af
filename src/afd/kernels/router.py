"""The MoE router in one launch: gate logits, scoring, group limiting and top-k, straight from the hidden rows.

Eagerly a MoE layer's router is a chain of ~8 kernels (fp32 copy of x, sgemm, softmax or sigmoid, group scores,
`topk`'s two passes, gather, normalize, scale) costing ~20 us at decode batch sizes on an H200, for a result of
T*K ids and weights. Here one Triton kernel does all of it, with no host sync (capturable in a CUDA graph):

- Grid `(T-blocks of BLOCK_T rows, S splits of H)`. Program (b, s) computes the partial logits of its rows over
  its slice of H, `x[rows, slice] @ W[:, slice].T` with `tl.dot`: fp32 accumulation; the weight is read in its
  own dtype and widened in registers; products in fp32 ("ieee") unless x and W are both bf16 (or both fp16),
  whose products are exact in fp32 anyway. Splitting H spreads the weight read over S SMs at decode sizes,
  where the grid would otherwise be one program streaming the whole weight.
- Each program stores its `[BLOCK_T, E]` partial, then bumps its T-block's arrival counter (acq_rel atomic).
  The program that arrives last sums the S partials in split order (a fixed order: the same bits every run,
  whichever program is last), resets the counter to zero for the next launch, and selects in registers:
  softmax or sigmoid, `+ e_score_correction_bias` (noaux_tc), group scores (max, or sum of the top two) and the
  `topk_group` kept groups, then K rounds of argmax-and-mask. Ties go to the lower expert (and group) id.
- The counters are one small int32 buffer per device that every launch leaves at zero. So two router launches
  must not run concurrently on one device (on two streams at once); the engine runs them in stream order.

Numerics follow `afd.model.moe.select_experts` over `F.linear(x.float(), W.float())`; only the fp32 summation order of
the logits differs from cuBLAS, so where two experts' scores are within ~1e-6 the kernel may pick the other.
The eager code stays the CPU path and the oracle of `tests/kernels/test_kernel_router.py` (GPU:
`tests/e2e/test_kernel_router_gpu.py`).
"""

from __future__ import annotations

import logging
from functools import cache

import torch
import triton
import triton.language as tl

from afd.routing import Routing

logger = logging.getLogger(__name__)

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP32_MAX_EXPERTS = 64  # fp32 gate weights (an fp32 model's): the kernel pays up to this many experts ...
FP32_MAX_TOKENS = 256  # ... and tokens; beyond, cuBLAS's fp32 GEMM wins (H200: V3 at T=1 90 vs 55 us, V2-Lite at
# T=4096 164 vs 87 us; V2-Lite at T<=256 11 vs 17-26 us). 16-bit weights: the kernel won at every size measured.


def pays(weight: torch.Tensor, num_tokens: int) -> bool:
    """Whether the fused kernel beats the eager router for this gate weight [E, H] and token count."""
    if weight.dtype not in DTYPES:
        return False
    return weight.dtype != torch.float32 or (weight.shape[0] <= FP32_MAX_EXPERTS and num_tokens <= FP32_MAX_TOKENS)


METHODS = {"greedy": 0, "group_limited_greedy": 1, "noaux_tc": 2}
MAX_EXPERTS = 512  # one T-block's [BLOCK_T, E] logits sit in registers
MAX_TOP_K = 16  # K and topk_group rounds are unrolled
MAX_GROUPS = 32
BLOCK_T = 16  # the smallest tl.dot tile: decode batches are the case that matters
MAX_SPLITS = 16
_SPLIT_UNROLL = 4  # partials loaded together in the final sum (their latencies overlap)
_NEG_INF = tl.constexpr(float("-inf"))

_counters: dict[torch.device, torch.Tensor] = {}
_retired: list[torch.Tensor] = []  # outgrown counter buffers, kept alive for the graphs that captured them
_COUNTERS_MIN = 1024  # T-blocks (16384 tokens) before the per-device buffer has to grow


def supports(config) -> bool:
    """Whether the kernel implements `config`'s routing (a `ModelConfig`); anything else stays eager."""
    num_experts, top_k, n_group = config.n_routed_experts, config.num_experts_per_tok, config.n_group
    if config.scoring_func not in ("softmax", "sigmoid") or config.topk_method not in METHODS:
        return False
    if not 1 <= top_k <= min(num_experts, MAX_TOP_K) or num_experts > MAX_EXPERTS:
        return False
    if config.topk_method == "greedy":
        return True
    return (
        1 <= n_group <= MAX_GROUPS
        and num_experts % n_group == 0
        and 1 <= config.topk_group <= min(n_group, MAX_TOP_K)
        and top_k <= config.topk_group * (num_experts // n_group)  # K experts always fit in the kept groups
    )


@triton.jit
def _select(
    logits,  # [BLOCK_T, E_PAD] fp32
    rows,
    is_row,
    bias_ptr,
    ids_ptr,
    weights_ptr,
    E,
    scaling,
    BLOCK_T: tl.constexpr,
    E_PAD: tl.constexpr,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    SIGMOID: tl.constexpr,
    METHOD: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    N_GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    NORM: tl.constexpr,
):
    """Scores, group limiting and the K rounds of argmax of `select_experts`, on one T-block's logits."""
    cols = tl.arange(0, E_PAD)
    is_col = (cols < E)[None, :]  # [1, E_PAD]
    if SIGMOID:
        scores = tl.where(is_col, tl.sigmoid(logits), 0.0)  # [BLOCK_T, E_PAD]
    else:
        masked = tl.where(is_col, logits, _NEG_INF)
        p = tl.exp(masked - tl.max(masked, axis=1)[:, None])
        scores = p / tl.sum(p, axis=1)[:, None]  # [BLOCK_T, E_PAD], 0 on padding
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + cols, mask=cols < E, other=0.0).to(tl.float32)[None, :]
    choice = tl.where(is_col, choice, _NEG_INF)

    if METHOD != 0:  # keep the TOPK_GROUP groups with the best group score
        group = (cols // GROUP_SIZE)[None, :]  # [1, E_PAD]; padding lies past the last group
        gcols = tl.arange(0, G_PAD)[None, :]  # [1, G_PAD]
        group_scores = tl.full([BLOCK_T, G_PAD], _NEG_INF, tl.float32)
        for g in tl.static_range(N_GROUP):
            v = tl.where(group == g, choice, _NEG_INF)  # [BLOCK_T, E_PAD]
            best = tl.max(v, axis=1)  # [BLOCK_T]
            if METHOD == 2 and GROUP_SIZE > 1:  # noaux_tc: the sum of the group's top two
                first = tl.min(tl.where(v == best[:, None], cols[None, :], E_PAD), axis=1)
                second = tl.max(tl.where(cols[None, :] == first[:, None], _NEG_INF, v), axis=1)
                best = best + second
            group_scores = tl.where(gcols == g, best[:, None], group_scores)
        is_kept = tl.zeros([BLOCK_T, E_PAD], dtype=tl.int32)
        for _ in tl.static_range(TOPK_GROUP):
            top = tl.max(group_scores, axis=1)
            gid = tl.min(tl.where((group_scores == top[:, None]) & (gcols < N_GROUP), gcols, G_PAD), axis=1)
            group_scores = tl.where(gcols == gid[:, None], _NEG_INF, group_scores)
            is_kept = tl.where(group == gid[:, None], 1, is_kept)
        if METHOD == 2:  # masked as select_experts does: -inf for noaux_tc, 0 for group_limited_greedy
            choice = tl.where(is_kept != 0, choice, _NEG_INF)
        else:
            choice = tl.where(is_col, tl.where(is_kept != 0, choice, 0.0), _NEG_INF)

    kcols = tl.arange(0, K_PAD)[None, :]  # [1, K_PAD]
    topk_ids = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int32)
    topk_weights = tl.zeros([BLOCK_T, K_PAD], dtype=tl.float32)
    is_free = is_col & (tl.zeros([BLOCK_T, E_PAD], dtype=tl.int32) == 0)  # [BLOCK_T, E_PAD]
    for k in tl.static_range(K):
        c = tl.where(is_free, choice, _NEG_INF)
        top = tl.max(c, axis=1)  # [BLOCK_T]
        idx = tl.min(tl.where(is_free & (c == top[:, None]), cols[None, :], E_PAD), axis=1)  # lowest id wins
        is_hit = cols[None, :] == idx[:, None]
        w = tl.sum(tl.where(is_hit, scores, 0.0), axis=1)  # the unbiased score of the chosen expert
        is_free = is_free & (cols[None, :] != idx[:, None])
        topk_ids = tl.where(kcols == k, idx[:, None], topk_ids)
        topk_weights = tl.where(kcols == k, w[:, None], topk_weights)
    if NORM:
        topk_weights = topk_weights / (tl.sum(topk_weights, axis=1)[:, None] + 1e-20)
    topk_weights = topk_weights * scaling
    out = rows[:, None] * K + kcols
    is_out = is_row[:, None] & (kcols < K)
    tl.store(ids_ptr + out, topk_ids.to(tl.int64), mask=is_out)
    tl.store(weights_ptr + out, topk_weights, mask=is_out)


@triton.jit(do_not_specialize=["T", "num_splits", "chunks_per_split"])
def _router_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    partial_ptr,
    counter_ptr,
    ids_ptr,
    weights_ptr,
    T,
    H,
    E,
    stride_x,
    stride_w,
    num_splits,
    chunks_per_split,
    scaling,
    BLOCK_T: tl.constexpr,
    E_PAD: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    SPLIT_UNROLL: tl.constexpr,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    SIGMOID: tl.constexpr,
    METHOD: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    N_GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    NORM: tl.constexpr,
):
    block = tl.program_id(0)
    split = tl.program_id(1)
    rows = block.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    is_row = rows < T
    cols = tl.arange(0, E_PAD)
    is_col = cols < E
    ks = tl.arange(0, BLOCK_K)

    acc = tl.zeros([BLOCK_T, E_PAD], dtype=tl.float32)
    chunk_end = tl.minimum((split + 1) * chunks_per_split, tl.cdiv(H, BLOCK_K))
    for chunk in range(split * chunks_per_split, chunk_end):
        k = chunk * BLOCK_K + ks  # [BLOCK_K]
        x = tl.load(
            x_ptr + rows[:, None] * stride_x + k[None, :], mask=is_row[:, None] & (k < H)[None, :], other=0.0
        )  # [BLOCK_T, BLOCK_K]
        w = tl.load(
            w_ptr + cols[:, None] * stride_w + k[None, :], mask=is_col[:, None] & (k < H)[None, :], other=0.0
        )  # [E_PAD, BLOCK_K]
        if IEEE:
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)

    # Every split publishes its partial; the last to arrive sums them in split order and selects.
    tile = rows[:, None] * E_PAD + cols[None, :]  # [BLOCK_T, E_PAD] offsets in one split's [T-blocks * BLOCK_T, E_PAD]
    split_stride = tl.num_programs(0).to(tl.int64) * (BLOCK_T * E_PAD)  # one split's partials
    tl.store(partial_ptr + split * split_stride + tile, acc, mask=is_row[:, None])
    tl.debug_barrier()  # every thread's partial is written before the release below
    arrived = tl.atomic_add(counter_ptr + block, 1, sem="acq_rel", scope="gpu")
    if arrived == num_splits - 1:
        logits = tl.zeros([BLOCK_T, E_PAD], dtype=tl.float32)
        for s0 in range(0, num_splits, SPLIT_UNROLL):
            for j in tl.static_range(SPLIT_UNROLL):
                s = s0 + j
                part = tl.load(
                    partial_ptr + s * split_stride + tile,
                    mask=is_row[:, None] & (s < num_splits),
                    other=0.0,
                    cache_modifier=".cg",  # written by other SMs: read from L2
                )
                logits = logits + part
        tl.store(counter_ptr + block, 0)  # ready for the next launch (and the next graph replay)
        _select(
            logits,
            rows,
            is_row,
            bias_ptr,
            ids_ptr,
            weights_ptr,
            E,
            scaling,
            BLOCK_T,
            E_PAD,
            K,
            K_PAD,
            SIGMOID,
            METHOD,
            HAS_BIAS,
            N_GROUP,
            G_PAD,
            GROUP_SIZE,
            TOPK_GROUP,
            NORM,
        )


@cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few splits, so CPU tests cover the split path
    return torch.cuda.get_device_properties(device).multi_processor_count


def _counter_buffer(device: torch.device, num_blocks: int) -> torch.Tensor:
    """The zeroed arrival counters (int32, >= num_blocks) of `device`. Every launch leaves them at zero, so one
    buffer serves every later launch. A CUDA-graph capture that finds none (or too small) gets its own zeroed
    buffer inside the graph: kernels do not run during capture, so a cached buffer would not be zeroed yet."""
    buf = _counters.get(device)
    if buf is not None and buf.numel() >= num_blocks:
        return buf
    size = max(_COUNTERS_MIN, triton.next_power_of_2(num_blocks))
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros(size, dtype=torch.int32, device=device)
    if buf is not None:
        _retired.append(buf)  # outgrown, but a captured graph may still use it: never freed
    buf = torch.zeros(size, dtype=torch.int32, device=device)
    _counters[device] = buf
    return buf


def fused_router(
    x: torch.Tensor,
    weight: torch.Tensor,
    e_score_correction_bias: torch.Tensor | None,
    config,
    routed_scaling_factor: float,
    *,
    num_splits: int | None = None,
) -> Routing:
    """`select_experts(F.linear(x.float(), weight.float()), ...)` for `config` (a `ModelConfig` that `supports`
    accepts) in one launch.

    x: [T, H] (or [..., H]) bf16/fp16/fp32; weight: [E, H] bf16/fp16/fp32, read in its own dtype;
    e_score_correction_bias: [E] or None (used by noaux_tc only). Returns `Routing(topk_ids [T, K] int64,
    topk_weights [T, K] fp32)`, K ordered by descending selection score, ties to the lower expert id.
    `num_splits` (tests) overrides how many programs share H.
    """
    num_experts, hidden = weight.shape
    if x.shape[-1] != hidden:
        raise ValueError(f"rows of {x.shape[-1]} for a gate weight of shape {tuple(weight.shape)}")
    if x.dtype not in DTYPES or weight.dtype not in DTYPES:
        raise ValueError(f"fused_router takes {DTYPES}, not x {x.dtype} / weight {weight.dtype}")
    if not supports(config) or config.n_routed_experts != num_experts:
        raise ValueError("fused_router does not support this routing config; check `supports` first")
    top_k = config.num_experts_per_tok
    x2 = x.reshape(-1, hidden)  # [T, H]
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    weight = weight.contiguous()
    num_tokens = x2.shape[0]
    topk_ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=x.device)
    topk_weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return Routing(topk_ids=topk_ids, topk_weights=topk_weights)

    method = METHODS[config.topk_method]
    grouped = method != 0
    n_group = config.n_group if grouped else 1
    has_bias = method == 2 and e_score_correction_bias is not None
    bias = e_score_correction_bias.contiguous() if has_bias else topk_weights  # a dummy pointer when unused
    is_ieee = not (x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16))
    e_pad = max(16, triton.next_power_of_2(num_experts))
    # One weight tile [E_PAD, BLOCK_K] of ~32 KiB per pipeline stage.
    block_k = max(16, min(128, triton.next_power_of_2(hidden), 32768 // (e_pad * weight.element_size())))
    num_chunks = triton.cdiv(hidden, block_k)
    num_blocks = triton.cdiv(num_tokens, BLOCK_T)
    if num_splits is None:  # enough programs to fill the GPU twice, at most MAX_SPLITS per T-block
        num_splits = min(MAX_SPLITS, triton.cdiv(2 * _num_sms(x.device), num_blocks))
    num_splits = max(1, min(num_splits, num_chunks))
    chunks_per_split = triton.cdiv(num_chunks, num_splits)
    num_splits = triton.cdiv(num_chunks, chunks_per_split)  # no split without a chunk
    partial = torch.empty(num_splits, num_blocks * BLOCK_T, e_pad, dtype=torch.float32, device=x.device)
    counters = _counter_buffer(x.device, num_blocks)
    _router_kernel[(num_blocks, num_splits)](
        x2,
        weight,
        bias,
        partial,
        counters,
        topk_ids,
        topk_weights,
        num_tokens,
        hidden,
        num_experts,
        x2.stride(0),
        weight.stride(0),
        num_splits,
        chunks_per_split,
        float(routed_scaling_factor),
        BLOCK_T=BLOCK_T,
        E_PAD=e_pad,
        BLOCK_K=block_k,
        IEEE=is_ieee,
        SPLIT_UNROLL=_SPLIT_UNROLL,
        K=top_k,
        K_PAD=max(2, triton.next_power_of_2(top_k)),
        SIGMOID=config.scoring_func == "sigmoid",
        METHOD=method,
        HAS_BIAS=has_bias,
        N_GROUP=n_group,
        G_PAD=max(2, triton.next_power_of_2(n_group)),
        GROUP_SIZE=num_experts // n_group,
        TOPK_GROUP=config.topk_group if grouped else 1,
        NORM=bool(config.norm_topk_prob),
        num_warps=8 if e_pad >= 256 else 4,
        num_stages=2,
    )
    return Routing(topk_ids=topk_ids, topk_weights=topk_weights)
