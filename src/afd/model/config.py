"""The fields of a DeepSeek-V2/V3 `config.json` the forward pass needs, and the rope / YaRN constants derived
from them (both sides of the split and the cache sizing read these)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from afd.model.fp8 import DEFAULT_BLOCK, QUANTIZATIONS, parse_quantization_config

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
    # (b0, b1) when every attention/MLP linear is block-scaled FP8 (`afd.model.fp8`); None: 16/32-bit linears
    fp8_block: tuple[int, int] | None = None

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
            fp8_block=parse_quantization_config(d.get("quantization_config")),
        )

    def with_quantization(self, quantization: str | None) -> ModelConfig:
        """The config as loaded with `--quantization`: None keeps the checkpoint's format; "fp8" makes every
        attention/MLP linear FP8 (in the checkpoint's blocks if it ships FP8, else 128 x 128)."""
        if quantization is None:
            return self
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization {quantization!r} is not supported; use one of {QUANTIZATIONS}")
        return self if self.fp8_block is not None else replace(self, fp8_block=DEFAULT_BLOCK)

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


def scaled(x: torch.Tensor, scale: float) -> torch.Tensor:
    """`x * scale`, without a kernel when the scale is 1 (every dtype but float16): the product is `x` itself, and
    at prefill sizes each such multiply reads and writes a whole [T, H] for nothing."""
    return x if scale == 1.0 else x * scale


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_factor(config: ModelConfig) -> float:
    ys = config.rope_scaling
    return ys.get("factor") or config.max_position_embeddings / ys["original_max_position_embeddings"]


def softmax_scale(config: ModelConfig) -> float:
    """The attention's softmax scale: 1/sqrt(qk_head_dim), with YaRN's mscale_all_dim correction squared. Plain
    floats: a model built on meta needs it, and its first tensor op on meta imports sympy (2 s of a rank's start)."""
    scale = config.qk_head_dim**-0.5
    ys = config.rope_scaling
    if ys is not None and ys.get("mscale_all_dim"):
        scale *= _yarn_mscale(_yarn_factor(config), ys["mscale_all_dim"]) ** 2
    return scale


def rope_parameters(config: ModelConfig) -> tuple[torch.Tensor, float, float]:
    """(inv_freq [R/2] fp32, cos/sin scale, softmax scale) for default rope or YaRN as DeepSeek uses it."""
    dim = config.qk_rope_head_dim
    base = config.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)  # [R/2]
    ys = config.rope_scaling
    if ys is None:
        return 1.0 / pos_freqs, 1.0, softmax_scale(config)
    orig_max = ys["original_max_position_embeddings"]
    factor = _yarn_factor(config)
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
    return inv_freq, float(attention_factor), softmax_scale(config)
