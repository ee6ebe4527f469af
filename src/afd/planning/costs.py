"""The cost arithmetic of afd's steps, pure: model shapes → bytes and FLOPs → seconds through a `Profile`.

Every function takes numbers (and `Shapes`) and returns numbers; nothing here runs a model or looks at a machine.
Conventions: a "step" is one engine step of one attention replica; a "layer pass" is one MoE layer on one FFN rank;
an exchange is one MoE layer's round trip (send and answer). Routing is taken as uniform top-k.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from afd.buckets import path_rows
from afd.model.config import ModelConfig
from afd.planning.profile import Calibration, Part, Profile

WEIGHT_BYTES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "fp8": 1.0 + 4.0 / (128 * 128)}  # fp8: + block scales
GPU_MEMORY_UTILIZATION = 0.9  # the engine's default share of a GPU's memory
DEVICE_OVERHEAD_BYTES = 2 << 30  # per rank: CUDA context, communication buffers (runtime.resources' figure)
ACTIVATION_BYTES_PER_TOKEN = 64 * 1024  # budget per token of the step for activations (rough)


@dataclass(frozen=True)
class Shapes:
    """Parameter counts and sizes of one model, and the bytes of each element."""

    hidden: int
    layers: int
    moe_layers: int
    dense_layers: int
    attn_params: int  # one layer's MLA and norms
    dense_mlp_params: int  # one dense layer's MLP
    expert_params: int  # one routed expert
    shared_params: int  # one layer's shared experts together
    gate_params: int  # one MoE layer's router
    vocab_params: int  # embedding (one row read per token) or lm_head: vocab × hidden
    num_experts: int
    topk: int
    heads: int
    kv_latent: int  # kv_lora_rank + qk_rope_head_dim: one cached latent per token and layer
    kv_lora: int
    qk_head_dim: int
    v_head_dim: int
    weight_bytes: float  # per parameter
    act_bytes: int  # per hidden-state element on the wire and in the cache

    @property
    def attention_side_params(self) -> int:
        """What an attention rank reads per step: every layer's attention, dense MLPs, routers, lm_head."""
        return (
            self.layers * self.attn_params
            + self.dense_layers * self.dense_mlp_params
            + self.moe_layers * self.gate_params
            + self.vocab_params
        )

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv_latent * self.layers * self.act_bytes

    def attention_weight_bytes(self) -> float:
        return (self.attention_side_params + self.vocab_params) * self.weight_bytes  # + the embedding table

    def ffn_weight_bytes(self, num_local_experts: int) -> float:
        return self.moe_layers * (num_local_experts * self.expert_params + self.shared_params) * self.weight_bytes

    def total_weight_bytes(self) -> float:
        return self.attention_weight_bytes() + self.ffn_weight_bytes(self.num_experts)


def shapes_of(config: ModelConfig, weight_format: str) -> Shapes:
    """`Shapes` of a DeepSeek-V2/V3 config, weights in `weight_format` (`WEIGHT_BYTES`'s keys)."""
    h, heads = config.hidden_size, config.num_attention_heads
    qk, v = config.qk_head_dim, config.v_head_dim
    if config.q_lora_rank:
        q = h * config.q_lora_rank + config.q_lora_rank + config.q_lora_rank * heads * qk
    else:
        q = h * heads * qk
    kv_a = h * (config.kv_lora_rank + config.qk_rope_head_dim) + config.kv_lora_rank
    kv_b = config.kv_lora_rank * heads * (config.qk_nope_head_dim + v)
    attn = q + kv_a + kv_b + heads * v * h + 2 * h
    moe = len(config.moe_layers)
    return Shapes(
        hidden=h,
        layers=config.num_hidden_layers,
        moe_layers=moe,
        dense_layers=config.num_hidden_layers - moe,
        attn_params=attn,
        dense_mlp_params=3 * h * config.intermediate_size,
        expert_params=3 * h * config.moe_intermediate_size,
        shared_params=3 * h * config.moe_intermediate_size * config.n_shared_experts,
        gate_params=config.n_routed_experts * h,
        vocab_params=config.vocab_size * h,
        num_experts=config.n_routed_experts,
        topk=config.num_experts_per_tok,
        heads=heads,
        kv_latent=config.kv_lora_rank + config.qk_rope_head_dim,
        kv_lora=config.kv_lora_rank,
        qk_head_dim=qk,
        v_head_dim=v,
        weight_bytes=WEIGHT_BYTES[weight_format],
        act_bytes=4 if weight_format == "float32" else 2,
    )


# ---------------------------------------------------------------- the attention side
def decode_bytes(s: Shapes, ctx_tokens: float) -> float:
    """Bytes a decode step reads on the attention side: its weights, and the latents of `ctx_tokens` cached
    tokens summed over the batch."""
    return s.attention_side_params * s.weight_bytes + ctx_tokens * s.kv_latent * s.layers * s.act_bytes


def decode_flops(s: Shapes, batch: int, ctx_tokens: float) -> float:
    """FLOPs of `batch` decode rows: the linear layers, and MLA's absorbed core over `ctx_tokens` latents."""
    return 2.0 * s.attention_side_params * batch + 2.0 * s.heads * (s.kv_latent + s.kv_lora) * ctx_tokens * s.layers


def prefill_flops(s: Shapes, tokens: int, attended: float) -> float:
    """FLOPs of `tokens` prompt tokens that together attend to `attended` (token, key) pairs: linear layers (lm_head
    only for the sampled rows, left out) and the un-absorbed core."""
    linear = 2.0 * (s.attention_side_params - s.vocab_params) * tokens
    return linear + 2.0 * s.heads * (s.qk_head_dim + s.v_head_dim) * attended * s.layers


def chunk_pairs(start: int, length: int) -> float:
    """(query, key) pairs of a causal chunk of `length` tokens after `start` cached ones."""
    return length * start + length * (length + 1) / 2


def attention_step_s(
    p: Profile, s: Shapes, batch: int, ctx_tokens: float, prefill_tokens: int, prefill_pairs: float
) -> float:
    """Seconds of one attention-side step: `batch` decode rows over `ctx_tokens` cached latents, plus
    `prefill_tokens` prompt tokens with `prefill_pairs` attended pairs (each part's `per_item_s` per decode row,
    per prompt token). Zero for an empty step."""
    if batch + prefill_tokens == 0:
        return 0.0
    part = p.part("attention_decode")
    t = part.time(decode_bytes(s, ctx_tokens), decode_flops(s, batch, ctx_tokens), batch, ctx_tokens)
    if prefill_tokens:
        t += p.part("prefill").time(0.0, prefill_flops(s, prefill_tokens, prefill_pairs), prefill_tokens)
    return t


def serving_s(cal: Calibration, tokens_out: int, admitted: int, held: int = 0) -> float:
    """What serving adds to an engine step beyond its parts (the profile's calibration): the step's own cost, each
    token it streams out, each request it admits, each request the replica holds (running or waiting). Zero for an
    empty step."""
    if tokens_out == 0 and admitted == 0:
        return 0.0
    return cal.step_s + cal.token_s * tokens_out + cal.request_s * admitted + cal.held_s * held


# ---------------------------------------------------------------- the FFN side
def experts_touched(num_local: int, num_experts: int, topk: int, tokens: float) -> float:
    """Expected distinct experts of `num_local` that `tokens` tokens touch, each picking `topk` of `num_experts`."""
    if tokens <= 0 or num_local == 0:
        return 0.0
    return num_local * (1.0 - (1.0 - topk / num_experts) ** tokens)


def kernel_max_pairs() -> int:
    """The most (token, k) pairs whose routed experts the profile's fit of afd's decode kernels covers; past it
    the matmuls bind, and the grouped GEMM's fit stands for both the 16-bit grouped GEMM and FP8's row tiles (a
    profile measures bf16 experts)."""
    from afd.model.moe import FUSED_MOE_MAX_PAIRS

    return FUSED_MOE_MAX_PAIRS


def routed_pass_s(p: Profile, s: Shapes, tokens: float, num_local: int, graph_tokens: float | None = None) -> float:
    """One MoE layer's routed experts on a rank holding `num_local` experts, for `tokens` tokens' rows: the kernels'
    fit up to `kernel_max_pairs` pairs (every token's top-k, as the engine counts them), the grouped GEMM's past
    it where the profile has one. `graph_tokens`: the rows of the CUDA graph the step replays (its bucket, padding
    included), which is what the engine chooses the path by; the padding rows cost nothing."""
    if tokens <= 0:
        return 0.0
    touched = experts_touched(num_local, s.num_experts, s.topk, tokens)
    flops = 2.0 * s.expert_params * tokens * s.topk * num_local / s.num_experts
    part = routed_part(p, s, max(tokens, graph_tokens or 0.0))
    return p.part(part).time(touched * s.expert_params * s.weight_bytes, flops)


@functools.cache
def _graph_buckets(prompt: bool, max_num_batched_tokens: int, max_num_seqs: int) -> list[int]:
    from afd.buckets import batch_buckets, token_buckets

    return token_buckets(max_num_batched_tokens) if prompt else batch_buckets(max_num_seqs)


def graph_tokens(tokens: int, prompt: bool, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """The rows of the CUDA graph a whole replica's step of `tokens` tokens replays (afd.buckets): a prompt-holding
    step's token bucket, a decode step's batch bucket; `tokens` itself past the largest."""
    from afd.buckets import pick_bucket

    return pick_bucket(tokens, _graph_buckets(prompt, max_num_batched_tokens, max_num_seqs)) or tokens


def routed_part(p: Profile, s: Shapes, tokens: float) -> str:
    """The profile part that prices `tokens` tokens' routed experts (`routed_pass_s`): chosen as the engine chooses
    the path, by `afd.buckets.path_rows` of the rows."""
    if path_rows(math.ceil(tokens)) * s.topk > kernel_max_pairs() and "routed_experts_grouped" in p.parts:
        return "routed_experts_grouped"
    return "routed_experts"


def shared_pass_s(p: Profile, s: Shapes, tokens: float) -> float:
    """One MoE layer's shared experts for `tokens` tokens."""
    if tokens <= 0 or s.shared_params == 0:
        return 0.0
    return p.part("shared_experts").time(s.shared_params * s.weight_bytes, 2.0 * s.shared_params * tokens)


# ---------------------------------------------------------------- the exchange
def destinations_per_token(num_experts: int, topk: int, num_ffn: int) -> float:
    """FFN ranks a token's top-k reaches, in expectation (async wire version 3's rows per token)."""
    per_rank = num_experts / num_ffn
    missed = math.comb(num_experts - round(per_rank), topk) / math.comb(num_experts, topk)
    return num_ffn * (1.0 - missed)


def exchange_bytes(s: Shapes, connector: str, tokens: float, num_ffn: int) -> float:
    """Bytes of one MoE layer's round trip for `tokens` tokens of one replica, both ways, as each wire lays them out
    (architecture.md): async sends a row per (token, destination) with its top-k in band and gets fp32 partials
    back (bf16 at F = 1); p2p sends each token once to its FFN hub with weights and ids and gets it back."""
    row = s.hidden * s.act_bytes + 8 * s.topk
    if connector == "async":
        rows = destinations_per_token(s.num_experts, s.topk, num_ffn)
        back = s.hidden * (s.act_bytes if num_ffn == 1 else 4)
        return tokens * rows * (row + back)
    return tokens * (row + s.hidden * s.act_bytes)


def all_to_all_bytes(s: Shapes, tokens: float, num_ranks: int) -> float:
    """Bytes one rank sends (and receives) in an expert all-to-all's dispatch and combine over `num_ranks` ranks."""
    if num_ranks <= 1:
        return 0.0
    return 2.0 * tokens * s.topk * (num_ranks - 1) / num_ranks * s.hidden * s.act_bytes


def wire_s(part: Part, nbytes: float, *, cross_node: bool, link) -> float:
    """A transfer: the part's fit inside a node; across nodes the NIC's bandwidth and latency bound it."""
    t = part.time(nbytes)
    if cross_node:
        t = max(t, part.fixed_s + link.inter_node_latency_s + nbytes / link.inter_node_Bps)
    return t


# ---------------------------------------------------------------- micro-batch ping-pong
def layer_cycle_s(a: float, f: float, c: float, ubatches: int) -> float:
    """One boundary layer of a step split into `ubatches` micro-batches, each `a` on the attention rank, `c` on the
    wire, `f` on the FFN ranks: the attention rank and the FFN ranks each do their part of every micro-batch, and
    no micro-batch's own chain is shorter than a + c + f (m = 1: no overlap)."""
    if ubatches <= 1:
        return a + c + f
    return max(ubatches * a, ubatches * f, a + c + f)


# ---------------------------------------------------------------- memory
def kv_capacity_tokens(s: Shapes, gpu_bytes: float, weight_bytes: float, max_num_batched_tokens: int) -> int:
    """Tokens of latent cache left on a GPU after the weights, the rank's overhead and the step's activations
    (GPU_MEMORY_UTILIZATION of its memory); negative when the weights alone do not fit."""
    free = gpu_bytes * GPU_MEMORY_UTILIZATION - weight_bytes - DEVICE_OVERHEAD_BYTES
    free -= max_num_batched_tokens * ACTIVATION_BYTES_PER_TOKEN
    return int(free // s.kv_bytes_per_token) if free > 0 else -1


def fits(gpu_bytes: float, weight_bytes: float) -> bool:
    return weight_bytes + DEVICE_OVERHEAD_BYTES <= gpu_bytes * GPU_MEMORY_UTILIZATION
