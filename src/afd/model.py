"""DeepSeek-V2/V3 split at the MoE boundary: the config, shared blocks and the attention side.

The FFN side (`FFNModel`: routed experts of a range, shared experts) lives in `afd.ffn_model`.

Numerics follow the `transformers` DeepseekV2/V3 implementation (the oracle in tests). The attention
side never calls expert weights: a boundary layer hands `(layer_idx, x, routing)` to an `exchange`.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from afd import kernels
from afd.kv_cache import PagedLatentCache
from afd.moe import Routing, select_experts

logger = logging.getLogger(__name__)

Exchange = Callable[[int, torch.Tensor, Routing | None], torch.Tensor]
MODEL_TYPES = ("deepseek_v2", "deepseek_v3")


@dataclass(frozen=True)
class ModelConfig:
    """The fields of a DeepSeek-V2/V3 `config.json` that the forward pass needs."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    rope_interleave: bool = True
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    tie_word_embeddings: bool = False

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config.json dict (old `rope_scaling` or new `rope_parameters`)."""
        model_type = d.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported; expected one of {MODEL_TYPES}")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {d['hidden_act']!r} is not supported; only silu is")
        is_v3 = model_type == "deepseek_v3"
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", d.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "yarn"):
            raise ValueError(f"rope type {rope_type!r} is not supported; use default or yarn")
        rope_scaling = None
        if rope_type == "yarn":
            rope_scaling = {k: v for k, v in rope.items() if k not in ("type", "rope_type")}
            rope_scaling.setdefault("original_max_position_embeddings", d["max_position_embeddings"])
        n_group = d.get("n_group") or 1
        topk_group = d.get("topk_group") or 1
        return cls(
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            moe_intermediate_size=d["moe_intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=d["num_attention_heads"],
            q_lora_rank=d.get("q_lora_rank"),
            kv_lora_rank=d["kv_lora_rank"],
            qk_nope_head_dim=d["qk_nope_head_dim"],
            qk_rope_head_dim=d["qk_rope_head_dim"],
            v_head_dim=d["v_head_dim"],
            n_routed_experts=d.get("n_routed_experts") or 0,
            n_shared_experts=d.get("n_shared_experts") or 0,
            num_experts_per_tok=d.get("num_experts_per_tok") or 1,
            first_k_dense_replace=d.get("first_k_dense_replace") or 0,
            moe_layer_freq=d.get("moe_layer_freq") or 1,
            scoring_func=d.get("scoring_func", "sigmoid" if is_v3 else "softmax"),
            topk_method=d.get("topk_method") or ("noaux_tc" if is_v3 else "greedy"),
            n_group=n_group,
            topk_group=topk_group,
            norm_topk_prob=bool(d.get("norm_topk_prob", is_v3)),
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rope_interleave=bool(d.get("rope_interleave", True)),
            max_position_embeddings=d["max_position_embeddings"],
            attention_bias=bool(d.get("attention_bias", False)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (
            self.n_routed_experts > 0
            and layer_idx >= self.first_k_dense_replace
            and layer_idx % self.moe_layer_freq == 0
        )

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    def residual_scale(self, dtype: torch.dtype) -> float:
        """float16 carries the residual stream scaled by 1/routed_scaling_factor so nothing overflows."""
        return 1.0 / self.routed_scaling_factor if dtype == torch.float16 else 1.0


# --- building blocks -------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """`weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`, normalized in fp32; one Triton kernel on CUDA."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.enabled(x.device):
            from afd.kernels.norm import rms_norm

            return rms_norm(x, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class MLP(nn.Module):
    """SwiGLU MLP: dense layers and shared experts.

    On CUDA (Triton enabled) gate and up run as one GEMM over a `[2I, H]` weight whose two halves *are*
    `gate_proj.weight` and `up_proj.weight` (views, so no second copy of the weights), then one fused
    `silu(g) * u` kernel, then `down_proj`. Parameter names and the state dict stay as checkpoints have them.
    """

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self._gate_up: torch.Tensor | None = None  # [2I, H], built on first CUDA use
        self._can_fuse = True  # False once a CUDA graph captured the unfused weights' addresses

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.enabled(x.device):
            from afd.kernels.swiglu import silu_mul, swiglu

            gate_up = self._gate_up_weight()
            h = swiglu(x, gate_up) if gate_up is not None else silu_mul(self.gate_proj(x), self.up_proj(x))
            return self.down_proj(h)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def _gate_up_weight(self) -> torch.Tensor | None:
        """The `[2I, H]` gate/up weight, re-pointing both parameters into it on first use (or after a loader
        replaced them). None (two GEMMs) if a CUDA graph is being captured before it exists: a copy recorded
        into a graph does not run at capture, and a graph that recorded the separate weights' addresses would
        read freed memory if they moved later, so this MLP then never fuses."""
        gate, up, fused = self.gate_proj.weight, self.up_proj.weight, self._gate_up
        inter = gate.shape[0]
        if (
            fused is not None
            and gate.data_ptr() == fused.data_ptr()
            and up.data_ptr() == fused[inter:].data_ptr()
            and fused.shape[0] == 2 * inter
            and gate.dtype == up.dtype == fused.dtype
        ):
            return fused
        if not self._can_fuse or gate.device != up.device or gate.dtype != up.dtype:
            return None
        if gate.is_cuda and torch.cuda.is_current_stream_capturing():
            self._can_fuse = False
            return None
        fused = torch.cat([gate.detach(), up.detach()])  # [2I, H]
        if gate.is_cuda:  # the old weights are freed below: no reuse before the copy above has read them
            for old in (gate.data, up.data):
                old.record_stream(torch.cuda.current_stream(gate.device))
        gate.data, up.data = fused[:inter], fused[inter:]
        self._gate_up = fused
        return fused


class Gate(nn.Module):
    """MoE router: fp32 logits, then `select_experts` (shared by both sides)."""

    _fp32: tuple[tuple[int, int], torch.Tensor] | None = None

    def _weight_fp32(self) -> torch.Tensor:
        """The weight in fp32, converted once rather than every step (kept while the weight is unchanged). Never
        cached during CUDA-graph capture, whose kernels do not run until replay."""
        w = self.weight
        if w.dtype == torch.float32:
            return w
        key = (w.data_ptr(), w._version)
        if self._fp32 is not None and self._fp32[0] == key:
            return self._fp32[1]
        w32 = w.detach().float()
        if not (w.is_cuda and torch.cuda.is_current_stream_capturing()):
            self._fp32 = (key, w32)
        return w32

    def __init__(self, config: ModelConfig, routed_scaling_factor: float) -> None:
        super().__init__()
        self.config = config
        self.routed_scaling_factor = routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(config.n_routed_experts)) if config.topk_method == "noaux_tc" else None
        )

    def forward(self, x: torch.Tensor) -> Routing:
        c = self.config
        logits = F.linear(x.float(), self._weight_fp32())  # [T, E]
        return select_experts(
            logits,
            top_k=c.num_experts_per_tok,
            scoring_func=c.scoring_func,
            topk_method=c.topk_method,
            n_group=c.n_group,
            topk_group=c.topk_group,
            norm_topk_prob=c.norm_topk_prob,
            routed_scaling_factor=self.routed_scaling_factor,
            e_score_correction_bias=self.e_score_correction_bias,
        )


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_parameters(config: ModelConfig) -> tuple[torch.Tensor, float, float]:
    """(inv_freq [R/2] fp32, cos/sin scale, softmax scale) for default rope or YaRN as DeepSeek uses it."""
    dim = config.qk_rope_head_dim
    base = config.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)  # [R/2]
    softmax_scale = config.qk_head_dim**-0.5
    ys = config.rope_scaling
    if ys is None:
        return 1.0 / pos_freqs, 1.0, softmax_scale
    orig_max = ys["original_max_position_embeddings"]
    factor = ys.get("factor") or config.max_position_embeddings / orig_max
    mscale, mscale_all_dim = ys.get("mscale"), ys.get("mscale_all_dim")
    attention_factor = ys.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = ys.get("beta_fast") or 32, ys.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(orig_max / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if ys.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # [R/2]
    is_extrapolated = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * is_extrapolated
    if mscale_all_dim:
        softmax_scale *= _yarn_mscale(factor, mscale_all_dim) ** 2
    return inv_freq, float(attention_factor), softmax_scale


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Rotate x [T, ..., R] by cos/sin [T, R/2] (fp32); interleaved pairs (x0, x1) or halves.

    The output is always laid out as [rotated firsts | rotated seconds]; q and k share the layout. `out` (x's shape
    and dtype; may be x itself, e.g. the rope part of q) receives it in place. One Triton kernel on CUDA.
    """
    if kernels.enabled(x.device):
        from afd.kernels.rope import rope

        return rope(x, cos, sin, interleave, out=out)
    xf = x.float()
    x1, x2 = (xf[..., 0::2], xf[..., 1::2]) if interleave else xf.chunk(2, dim=-1)
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    cos, sin = cos.view(shape), sin.view(shape)
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    return rotated if out is None else out.copy_(rotated)


@dataclass
class Boundary:
    """What a boundary layer hands to the FFN side: `hidden [T, H]` (post-attention-normed) and its routing
    (None when the gate runs on the FFN side)."""

    layer_idx: int
    hidden: torch.Tensor
    routing: Routing | None


def zero_exchange(layer_idx: int, x: torch.Tensor, routing: Routing | None) -> torch.Tensor:
    """An exchange that never crosses to the FFN side (graph capture, warm-up): answers zeros [T, H]."""
    return torch.zeros_like(x)


def run_segments(segments: Generator[Boundary, torch.Tensor, torch.Tensor], exchange: Exchange) -> torch.Tensor:
    """Drive a `forward_segments` generator to its end, answering every boundary through `exchange`."""
    try:
        boundary = next(segments)
        while True:
            boundary = segments.send(exchange(boundary.layer_idx, boundary.hidden, boundary.routing))
    except StopIteration as end:
        return end.value


# --- batch -----------------------------------------------------------------------------------------


@dataclass
class Batch:
    """Where each sequence of a flattened step sits: `query_lens[i]` consecutive rows, cache `slots[i]`,
    `context_lens[i]` tokens already cached before this step.

    The device fields are filled once per step by `PagedLatentCache.prepare` and read by every layer.
    """

    slots: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    context_lens: list[int] = field(default_factory=list)
    slot_mapping: torch.Tensor | None = None  # [T] flat cache row of every token of the step
    decode_token_rows: torch.Tensor | None = None  # [Bd] rows of the step that `decode_seqs` sit at
    decode_rows: torch.Tensor | None = None  # [Bd, L] cache rows of their contexts (padding: the zero row)
    decode_valid: torch.Tensor | None = None  # [Bd, L] which of those are real
    context_rows: dict[int, torch.Tensor] = field(default_factory=dict)  # i -> [ctx + n] rows, other cached seqs
    # Batch even a lone decode token: a CUDA graph (afd.cuda_graph) needs the fixed-shape batched path at size 1.
    batch_decodes: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def starts(self) -> list[int]:
        """First row of each sequence in the flattened step."""
        return [0, *itertools.accumulate(self.query_lens)][:-1]

    @property
    def decode_seqs(self) -> list[int]:
        """Single-token sequences attended in one batched pass (absorbed MLA); only worth it for two or more
        (or one, when `batch_decodes` asks for the fixed-shape path)."""
        decode = [i for i, n in enumerate(self.query_lens) if n == 1]
        return decode if len(decode) > 1 or (self.batch_decodes and decode) else []


# --- attention side --------------------------------------------------------------------------------


class MLAttention(nn.Module):
    """Multi-head latent attention; caches the compressed latent, expands keys/values per sequence."""

    def __init__(self, config: ModelConfig, layer_idx: int, softmax_scale: float) -> None:
        super().__init__()
        c = config
        self.config, self.layer_idx, self.softmax_scale = c, layer_idx, softmax_scale
        self.num_heads = c.num_attention_heads
        q_out = c.num_attention_heads * c.qk_head_dim
        if c.q_lora_rank is None:
            self.q_proj = nn.Linear(c.hidden_size, q_out, bias=False)
        else:
            self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=c.attention_bias)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank)
            self.q_b_proj = nn.Linear(c.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, bias=c.attention_bias)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank)
        kv_b_out = c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, kv_b_out, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.v_head_dim, c.hidden_size, bias=c.attention_bias)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: Batch, kv_cache: PagedLatentCache | None
    ) -> torch.Tensor:
        c, nh = self.config, self.num_heads
        T = x.shape[0]
        if c.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(T, nh, c.qk_head_dim)  # [T, nh, D]
        q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        kv_c, k_pe = self.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        kv_c = self.kv_a_layernorm(kv_c)  # [T, C]
        apply_rope(q_pe, cos, sin, c.rope_interleave, out=q_pe)  # in place: q is now [q_nope | rotated q_pe]
        k_pe = apply_rope(k_pe, cos, sin, c.rope_interleave)  # [T, R]
        if kv_cache is not None:  # every token of the step at once, before any sequence reads its context
            kv_cache.write(self.layer_idx, batch.slot_mapping, torch.cat([kv_c, k_pe], dim=-1))

        out = x.new_empty(T, nh, c.v_head_dim)  # [T, nh, Dv]
        batched = set(batch.decode_seqs) if kv_cache is not None else set()
        if batched and len(batched) == len(batch.query_lens):  # all decodes (graphed steps): rows in order
            return self.o_proj(self._decode_attention(q_nope, q_pe, kv_cache, batch.decode_rows, batch.decode_valid)
                               .reshape(T, nh * c.v_head_dim))  # fmt: skip
        if batched:  # one pass over every single-token sequence instead of a loop over them
            rows = batch.decode_token_rows  # [Bd]
            o = self._decode_attention(q_nope[rows], q_pe[rows], kv_cache, batch.decode_rows, batch.decode_valid)
            out[rows] = o  # [Bd, nh, Dv]
        self._prefill_attention(out, q, kv_c, k_pe, batch, kv_cache, batched)
        return self.o_proj(out.view(T, nh * c.v_head_dim))  # [T, H]

    def _prefill_attention(
        self,
        out: torch.Tensor,
        q: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        batch: Batch,
        kv_cache: PagedLatentCache | None,
        batched: set[int],
    ) -> None:
        """Every sequence not in `batched` (prompts, prompt chunks, a lone decode) into its rows of `out`.

        q: [T, nh, D], kv_c: [T, C], k_pe: [T, R] (this step's new latents), out: [T, nh, Dv], written in
        place. On CUDA with the Triton kernels all of them go through one varlen kernel launch; elsewhere
        (the CPU path and the oracle) one SDPA per sequence.
        """
        seqs = [i for i in range(len(batch.query_lens)) if i not in batched]
        if not seqs:
            return
        if kernels.enabled(q.device):
            self._prefill_attention_varlen(out, q, kv_c, k_pe, batch, kv_cache, seqs)
        else:
            self._prefill_attention_sdpa(out, q, kv_c, k_pe, batch, kv_cache, seqs)

    def _sequence_latents(
        self,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        batch: Batch,
        kv_cache: PagedLatentCache | None,
        i: int,
        row: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The key latents sequence `i` (its queries at rows `row`...) attends to: [L, C], [L, R], L = its
        context + its new tokens."""
        c = self.config
        n, ctx = batch.query_lens[i], batch.context_lens[i]
        if ctx == 0:  # a fresh prompt attends to its own new latents
            return kv_c[row : row + n], k_pe[row : row + n]
        if kv_cache is None:
            raise ValueError("a sequence with cached context needs a kv_cache")
        latents = kv_cache.read(self.layer_idx, batch.context_rows[i])  # [ctx + n, C + R]
        seq_kv_c, seq_k_pe = latents.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        return seq_kv_c, seq_k_pe

    def _prefill_attention_sdpa(
        self,
        out: torch.Tensor,
        q: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        batch: Batch,
        kv_cache: PagedLatentCache | None,
        seqs: list[int],
    ) -> None:
        """The eager path: per sequence, keys and values expanded through kv_b_proj, then one SDPA."""
        c, nh = self.config, self.num_heads
        starts = batch.starts
        for i in seqs:
            n, ctx, row = batch.query_lens[i], batch.context_lens[i], starts[i]
            seq_kv_c, seq_k_pe = self._sequence_latents(kv_c, k_pe, batch, kv_cache, i, row)
            L = seq_kv_c.shape[0]
            kv = self.kv_b_proj(seq_kv_c).view(L, nh, c.qk_nope_head_dim + c.v_head_dim)
            k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)  # [L, nh, *]
            k = torch.cat([k_nope, seq_k_pe.unsqueeze(1).expand(L, nh, c.qk_rope_head_dim)], dim=-1)
            # A decode token sees its whole context and a fresh prompt is plainly causal: neither needs a
            # mask, which keeps SDPA off its slow masked path. Only a chunk after cached context builds one.
            is_visible = None if n == 1 or ctx == 0 else torch.ones(n, L, dtype=torch.bool, device=q.device).tril(ctx)
            o = F.scaled_dot_product_attention(
                q[row : row + n].transpose(0, 1),  # [nh, n, D]
                k.transpose(0, 1),  # [nh, L, D]
                v.transpose(0, 1),  # [nh, L, Dv]
                attn_mask=is_visible,
                is_causal=n > 1 and ctx == 0,
                scale=self.softmax_scale,
            )
            out[row : row + n] = o.transpose(0, 1)

    def _prefill_attention_varlen(
        self,
        out: torch.Tensor,
        q: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        batch: Batch,
        kv_cache: PagedLatentCache | None,
        seqs: list[int],
    ) -> None:
        """The kernel path: the key latents of all `seqs` concatenated, keys and values expanded by one
        kv_b_proj call, one varlen attention launch (afd.kernels.prefill_attention), no host sync.

        Sequence lengths come from the host lists; their device copy (cu_seqlens and, when decodes sit
        between the sequences, the query rows) is one pinned asynchronous copy.
        """
        from afd.kernels.prefill_attention import prefill_attention

        c, nh = self.config, self.num_heads
        query_lens = [batch.query_lens[i] for i in seqs]
        key_lens = [batch.context_lens[i] + n for i, n in zip(seqs, query_lens, strict=True)]
        starts = batch.starts
        Tq = sum(query_lens)
        every_row = Tq == q.shape[0]  # then `seqs` are all the sequences, in order
        if every_row and all(batch.context_lens[i] == 0 for i in seqs):  # fresh prompts only
            keys_c, keys_pe = kv_c, k_pe  # [Lk, C], [Lk, R]: their own new latents, as they are
        else:
            parts = [self._sequence_latents(kv_c, k_pe, batch, kv_cache, i, starts[i]) for i in seqs]
            keys_c, keys_pe = (torch.cat(p) for p in zip(*parts, strict=True))  # [Lk, C], [Lk, R]
        Lk = keys_c.shape[0]
        kv = self.kv_b_proj(keys_c).view(Lk, nh, c.qk_nope_head_dim + c.v_head_dim)
        k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)  # [Lk, nh, Dn], [Lk, nh, Dv]: views
        cu_seqlens = [0, *itertools.accumulate(query_lens), 0, *itertools.accumulate(key_lens)]
        meta = torch.tensor(cu_seqlens, dtype=torch.int32)  # [2S + 2] (+ [Tq] query rows below)
        S = len(seqs)
        if not every_row:  # append the step row of every packed query: its sequence's first row + its index in it
            shift = torch.tensor([starts[i] for i in seqs], dtype=torch.int32) - meta[:S]  # [S]
            q_rows = torch.arange(Tq, dtype=torch.int32) + shift.repeat_interleave(torch.tensor(query_lens))
            meta = torch.cat([meta, q_rows])
        meta = meta.pin_memory().to(q.device, non_blocking=True) if q.is_cuda else meta.to(q.device)
        cu_seqlens_q, cu_seqlens_k = meta[: S + 1], meta[S + 1 : 2 * S + 2]  # [S + 1] int32 each
        args = (k_nope, keys_pe, v, cu_seqlens_q, cu_seqlens_k, max(query_lens), self.softmax_scale)
        if every_row:
            prefill_attention(q, *args, out=out)
        else:  # decodes (attended in their own batched pass) sit between: gather the queries, scatter back
            rows = meta[2 * S + 2 :].long()  # [Tq]
            out.index_copy_(0, rows, prefill_attention(q.index_select(0, rows), *args))

    def _decode_attention(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_cache: PagedLatentCache,
        rows: torch.Tensor,
        is_valid: torch.Tensor,
    ) -> torch.Tensor:
        """Single-token queries against their cached latents, keys and values never expanded (absorbed MLA).

        q_nope: [B, nh, Dn], q_pe: [B, nh, R], rows: [B, L] cache rows of each context (padding: the zero row),
        is_valid: [B, L] -> [B, nh, Dv]. Scores are `(q_nope W_uk) . kv_c + q_pe . k_pe`, the output
        `(probs . kv_c) W_uv`: the same products as expanding K and V, associated the other way, so nothing of
        size L x heads is built. On CUDA a Triton kernel reads the latents in place from the paged pool; the
        einsums below (CPU, `AFD_DISABLE_TRITON`) gather them first and are its test oracle.
        """
        c, nh = self.config, self.num_heads
        w = self.kv_b_proj.weight.view(nh, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        w_uk, w_uv = w.split([c.qk_nope_head_dim, c.v_head_dim], dim=1)  # [nh, Dn, C], [nh, Dv, C]
        q_latent = torch.einsum("bhd,hdc->bhc", q_nope, w_uk)  # [B, nh, C]
        if kernels.enabled(q_nope.device):
            from afd.kernels.mla_decode import mla_decode

            cache_layer = kv_cache.cache[self.layer_idx]  # [rows, C + R], a view of the pool
            o_latent = mla_decode(q_latent, q_pe, cache_layer, rows, is_valid, self.softmax_scale)  # [B, nh, C]
        else:
            context = kv_cache.read(self.layer_idx, rows)  # [B, L, C + R]
            kv_c, k_pe = context.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)  # [B, L, C], [B, L, R]
            scores = torch.einsum("bhc,blc->bhl", q_latent, kv_c) + torch.einsum("bhr,blr->bhl", q_pe, k_pe)
            scores = scores.float().mul_(self.softmax_scale).masked_fill_(~is_valid[:, None, :], float("-inf"))
            probs = scores.softmax(dim=-1).to(kv_c.dtype)  # [B, nh, L]
            o_latent = torch.einsum("bhl,blc->bhc", probs, kv_c)  # [B, nh, C]
        return torch.einsum("bhc,hvc->bhv", o_latent, w_uv)  # [B, nh, Dv]


class AttentionLayer(nn.Module):
    """Attention side of one decoder layer: norms, attention, and the gate or dense MLP it owns."""

    def __init__(self, config: ModelConfig, layer_idx: int, gate_on_attention: bool, dtype: torch.dtype) -> None:
        super().__init__()
        _, _, softmax_scale = rope_parameters(config)
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MLAttention(config, layer_idx, softmax_scale)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        is_moe = config.is_moe_layer(layer_idx)
        self.mlp = MLP(config.hidden_size, config.intermediate_size) if gate_on_attention and not is_moe else None
        rsf = 1.0 if dtype == torch.float16 else config.routed_scaling_factor
        self.gate = Gate(config, rsf) if gate_on_attention and is_moe else None
        self.scale = config.residual_scale(dtype)

    def attend(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: Batch, kv_cache: PagedLatentCache | None
    ) -> tuple[torch.Tensor, Boundary | None]:
        """Everything of the layer on this side: the residual after attention (and after the dense MLP when
        this side owns it) [T, H], and what crosses to the FFN side (None when nothing does)."""
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, batch, kv_cache) * self.scale
        y = self.post_attention_layernorm(h)  # [T, H]
        if self.mlp is not None:
            return h + self.mlp(y) * self.scale, None
        return h, Boundary(self.layer_idx, y, self.gate(y) if self.gate is not None else None)


class AttentionModel(nn.Module):
    """Embedding, attention blocks, norms, gate/dense MLPs (gate on attention), final norm, lm_head."""

    def __init__(
        self, config: ModelConfig, *, gate_on_attention: bool = True, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        self.config, self.gate_on_attention, self.dtype = config, gate_on_attention, dtype
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            AttentionLayer(config, i, gate_on_attention, dtype) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.scale = config.residual_scale(dtype)
        self._rope: tuple[torch.Tensor, float] | None = None

    @property
    def boundary_layers(self) -> list[int]:
        """Layers whose MLP crosses to the FFN side."""
        if self.gate_on_attention:
            return self.config.moe_layers
        return list(range(self.config.num_hidden_layers))

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, R/2] fp32 (already multiplied by the YaRN attention factor)."""
        if self._rope is None or self._rope[0].device != positions.device:
            inv_freq, attention_factor, _ = rope_parameters(self.config)
            self._rope = (inv_freq.to(positions.device), attention_factor)
        inv_freq, attention_factor = self._rope
        freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, R/2]
        return freqs.cos() * attention_factor, freqs.sin() * attention_factor

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: Batch,
        kv_cache: PagedLatentCache | None,
        exchange: Exchange,
    ) -> torch.Tensor:
        """input_ids, positions: [T] int64 -> final-normed hidden [T, H] model dtype."""
        if batch.num_tokens != input_ids.shape[0]:
            raise ValueError(f"batch covers {batch.num_tokens} tokens but {input_ids.shape[0]} were given")
        if kv_cache is not None and batch.slot_mapping is None:  # a caller that did not prepare the step
            kv_cache.prepare(batch)
        return run_segments(self.forward_segments(input_ids, positions, batch, kv_cache), exchange)

    def forward_segments(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: Batch, kv_cache: PagedLatentCache | None
    ) -> Generator[Boundary, torch.Tensor, torch.Tensor]:
        """The forward pass, paused at every boundary layer: yields what crosses to the FFN side and resumes
        with the FFN side's answer [T, H]. Why a generator: a CUDA graph can capture each piece between two
        exchanges (afd.cuda_graph) while the exchange itself, which crosses processes, runs eagerly."""
        cos, sin = self.rope(positions)  # [T, R/2]
        h = self.embed_tokens(input_ids) * self.scale  # [T, H]
        for layer in self.layers:
            h, boundary = layer.attend(h, cos, sin, batch, kv_cache)
            if boundary is not None:
                h = h + (yield boundary)
        return self.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] fp32."""
        return self.lm_head(hidden).float()
