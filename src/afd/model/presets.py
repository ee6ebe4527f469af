"""Named presets: DeepSeek config.json contents whose weights are drawn from a generator seeded by (seed, tensor
name), so that any role builds exactly its own tensors and all roles agree (on the same device type)."""

from __future__ import annotations

import hashlib
from typing import Any

import torch

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "model_type": "deepseek_v3",
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "q_lora_rank": 32,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "n_routed_experts": 10,
        "n_shared_experts": 2,
        "num_experts_per_tok": 3,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "n_group": 2,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "rope_interleave": True,
        "tie_word_embeddings": False,
    },
    # Small, with the MLA latent vLLM's CPU kernel takes (kv_lora_rank 512 + qk_rope_head_dim 64): the preset to
    # `afd export` for the vLLM adapter on CPU. Id 256 is EOS (the byte-level tokenizer's).
    "tiny-mla512": {
        "model_type": "deepseek_v2",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 3,
        "num_attention_heads": 2,
        "q_lora_rank": None,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 64,
        "v_head_dim": 16,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "scoring_func": "softmax",
        "topk_method": "group_limited_greedy",
        "n_group": 2,
        "topk_group": 1,
        "norm_topk_prob": False,
        "routed_scaling_factor": 2.0,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
    },
    # DeepSeek-V2-Lite's config.json shapes (deepseek-ai/DeepSeek-V2-Lite), random weights.
    "deepseek-v2-lite": {
        "torch_dtype": "bfloat16",  # as its release ships it: the router weight's values (`preset_tensor`)
        "model_type": "deepseek_v2",
        "vocab_size": 102400,
        "hidden_size": 2048,
        "intermediate_size": 10944,
        "moe_intermediate_size": 1408,
        "num_hidden_layers": 27,
        "num_attention_heads": 16,
        "q_lora_rank": None,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 64,
        "n_shared_experts": 2,
        "num_experts_per_tok": 6,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "scoring_func": "softmax",
        "topk_method": "greedy",
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.0,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 163840,
        "tie_word_embeddings": False,
        "rope_scaling": {
            "type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
    },
    # DeepSeek-V2's config.json shapes (deepseek-ai/DeepSeek-V2, 236B), random weights: for plan / simulate.
    "deepseek-v2": {
        "torch_dtype": "bfloat16",  # as its release ships it: the router weight's values (`preset_tensor`)
        "model_type": "deepseek_v2",
        "vocab_size": 102400,
        "hidden_size": 5120,
        "intermediate_size": 12288,
        "moe_intermediate_size": 1536,
        "num_hidden_layers": 60,
        "num_attention_heads": 128,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 160,
        "n_shared_experts": 2,
        "num_experts_per_tok": 6,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "scoring_func": "softmax",
        "topk_method": "group_limited_greedy",
        "n_group": 8,
        "topk_group": 3,
        "norm_topk_prob": False,
        "routed_scaling_factor": 16.0,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 163840,
        "tie_word_embeddings": False,
        "rope_scaling": {
            "type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
    },
    # DeepSeek-V3's config.json shapes (deepseek-ai/DeepSeek-V3, 671B; released in fp8 e4m3, 128x128 blocks).
    "deepseek-v3": {
        "torch_dtype": "bfloat16",  # as its release ships it: the router weight's values (`preset_tensor`)
        "model_type": "deepseek_v3",
        "vocab_size": 129280,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 3,
        "moe_layer_freq": 1,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "n_group": 8,
        "topk_group": 4,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 163840,
        "tie_word_embeddings": False,
        "rope_scaling": {
            "type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "quantization_config": {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        },
    },
}
LM_HEAD_GAIN = 3.0


def _seed_of(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


def preset_tensor(
    seed: int, name: str, shape: tuple[int, ...], device: torch.device, release_dtype: str | None = None
) -> torch.Tensor:
    """One preset tensor: norms are ones, the correction bias is small, matrices N(0, 1/fan_in).

    Unit-variance activations through every layer, and an lm_head scaled up so the next-token
    distribution is peaked: a connector that perturbs one expert's rows moves the log-probabilities
    far beyond the 1e-4 tolerance instead of hiding under a flat distribution. In a preset of a released model
    (`release_dtype`: its config's `torch_dtype`) the router's weight takes that dtype's values, as the release ships
    it, so a model in that dtype holds it exactly (`weights._gate_dtype`).
    """
    if name.endswith("norm.weight"):
        return torch.ones(shape, device=device)
    gen = torch.Generator(device=device).manual_seed(_seed_of(seed, name))
    if name.endswith("e_score_correction_bias"):
        std = 0.01
    elif name.endswith("embed_tokens.weight"):
        std = 1.0
    else:
        std = shape[-1] ** -0.5 * (LM_HEAD_GAIN if name.endswith("lm_head.weight") else 1.0)
    t = torch.randn(shape, generator=gen, device=device) * std
    if release_dtype is not None and name.endswith(".mlp.gate.weight"):
        return t.to(getattr(torch, release_dtype)).float()
    return t
