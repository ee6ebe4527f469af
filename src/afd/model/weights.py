"""Role-scoped weight loading: each role reads only the tensors it owns.

A model is a Hugging Face checkpoint directory (`config.json` + `*.safetensors`, tensor names as
`transformers` saves them) or a preset (`tiny`, `deepseek-v2-lite`) whose tensors are drawn from a
generator seeded by (seed, tensor name), so any role can build exactly its own tensors and all roles
agree (on the same device type).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from afd.model.attention_side import AttentionModel, ModelConfig
from afd.model.ffn_side import FFNModel

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

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
    # DeepSeek-V2-Lite's config.json shapes (deepseek-ai/DeepSeek-V2-Lite), random weights.
    "deepseek-v2-lite": {
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


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; use one of {sorted(DTYPES)}")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def _is_preset(model: str | Path) -> bool:
    return isinstance(model, str) and model in PRESETS


def load_model_config(model: str | Path) -> ModelConfig:
    """Config of a preset name or a checkpoint directory."""
    if _is_preset(model):
        return ModelConfig.from_hf(PRESETS[str(model)])
    path = Path(model)
    if not (path / "config.json").is_file():
        raise ValueError(
            f"{str(model)!r} is neither a preset ({', '.join(PRESETS)}) nor a directory with a config.json"
        )
    return ModelConfig.from_hf(json.loads((path / "config.json").read_text()))


# --- which tensors each role owns ------------------------------------------------------------------


def _hf_key(name: str) -> str:
    """Our parameter name -> the Hugging Face tensor name (experts are mapped separately)."""
    if name.startswith("lm_head."):
        return name
    name = re.sub(r"^layers\.(\d+)\.gate\.", r"layers.\1.mlp.gate.", name)
    name = re.sub(r"^layers\.(\d+)\.shared_experts\.", r"layers.\1.mlp.shared_experts.", name)
    return "model." + name


def _expert_keys(layer_idx: int, expert: int) -> tuple[str, str, str]:
    p = f"model.layers.{layer_idx}.mlp.experts.{expert}."
    return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"


def _plain_params(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    return ((n, p) for n, p in model.named_parameters() if not n.endswith((".w13", ".w2")))


def attention_keys(config: ModelConfig, *, gate_on_attention: bool = True, shared_experts: bool = False) -> list[str]:
    """Hugging Face tensor names an attention-side load reads."""
    with torch.device("meta"):
        model = AttentionModel(config, gate_on_attention=gate_on_attention, shared_experts=shared_experts)
    keys = [_hf_key(n) for n, _ in model.named_parameters()]
    if config.tie_word_embeddings:
        keys.remove("lm_head.weight")
    return keys


def ffn_keys(
    config: ModelConfig,
    *,
    expert_range: range | tuple[int, int] | None = None,
    gate_on_attention: bool = True,
    shared_experts: bool = True,
) -> list[str]:
    """Hugging Face tensor names an FFN-side load of `expert_range` reads (only those experts)."""
    with torch.device("meta"):
        model = FFNModel(
            config, expert_range=expert_range, gate_on_attention=gate_on_attention, shared_experts=shared_experts
        )
    keys = [_hf_key(n) for n, _ in _plain_params(model)]
    for layer in model.layers:
        if model.layers[layer].experts is not None:
            for e in range(model.expert_start, model.expert_stop):
                keys.extend(_expert_keys(int(layer), e))
    return keys


# --- tensor sources --------------------------------------------------------------------------------


class _Checkpoint:
    """Reads named tensors from the safetensors files of a directory, one `get_tensor` per name."""

    def __init__(self, path: Path) -> None:
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"checkpoint directory {str(path)!r} has no *.safetensors files")
        self.where: dict[str, Path] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as handle:
                for k in handle.keys():
                    self.where[k] = f

    def iter(self, keys: list[str], device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
        missing = [k for k in keys if k not in self.where]
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} tensors this role needs, e.g. {missing[0]!r}")
        by_file: dict[Path, list[str]] = {}
        for k in keys:
            by_file.setdefault(self.where[k], []).append(k)
        dev = str(device) if device.type != "cuda" or device.index is not None else "cuda:0"
        for f, names in by_file.items():
            with safe_open(str(f), framework="pt", device=dev) as handle:
                for k in names:
                    yield k, handle.get_tensor(k)


def _seed_of(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


def _preset_tensor(seed: int, name: str, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """One preset tensor: norms are ones, the correction bias is small, matrices N(0, 1/fan_in).

    Unit-variance activations through every layer, and an lm_head scaled up so the next-token
    distribution is peaked: a connector that perturbs one expert's rows moves the log-probabilities
    far beyond the 1e-4 tolerance instead of hiding under a flat distribution.
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
    return torch.randn(shape, generator=gen, device=device) * std


def _is_gate_key(key: str) -> bool:
    return re.search(r"\.gate\.(weight|e_score_correction_bias)$", key) is not None


def _read(
    model_ref: str | Path,
    config: ModelConfig,
    keys: list[str],
    *,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    model: nn.Module,
) -> dict[str, torch.Tensor]:
    """The tensors `keys`, on `device`, cast to `dtype` one by one (the gate stays float32)."""
    if _is_preset(model_ref):
        shapes = {_hf_key(n): tuple(p.shape) for n, p in _plain_params(model)}
        H, inter = config.hidden_size, config.moe_intermediate_size
        for k in keys:
            if ".mlp.experts." in k:
                shapes[k] = (H, inter) if k.endswith("down_proj.weight") else (inter, H)
        raw: Iterator[tuple[str, torch.Tensor]] = ((k, _preset_tensor(seed, k, shapes[k], device)) for k in keys)
    else:
        raw = _Checkpoint(Path(model_ref)).iter(keys, device)
    return {k: t.to(device=device, dtype=torch.float32 if _is_gate_key(k) else dtype) for k, t in raw}


def _assign(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    old = module._parameters[attr]
    if tuple(old.shape) != tuple(tensor.shape):
        raise ValueError(f"tensor for {name!r} has shape {tuple(tensor.shape)}, expected {tuple(old.shape)}")
    module._parameters[attr] = nn.Parameter(tensor, requires_grad=False)


def _fill(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Put loaded tensors into a meta-built model (experts are stacked separately)."""
    for n, _ in list(_plain_params(model)):
        _assign(model, n, tensors[_hf_key(n)])


def load_attention_model(
    model: str | Path,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    gate_on_attention: bool = True,
    seed: int = 0,
    shared_experts: bool = False,
) -> AttentionModel:
    """Attention side: embedding, attention, norms, gate / dense MLPs (gate on attention), lm_head (and the shared
    experts with `shared_experts`)."""
    config, dtype, device = load_model_config(model), resolve_dtype(dtype), torch.device(device)
    with torch.device("meta"):
        out = AttentionModel(config, gate_on_attention=gate_on_attention, dtype=dtype, shared_experts=shared_experts)
    keys = attention_keys(config, gate_on_attention=gate_on_attention, shared_experts=shared_experts)
    tensors = _read(model, config, keys, dtype=dtype, device=device, seed=seed, model=out)
    if config.tie_word_embeddings:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    _fill(out, tensors)
    logger.info("attention model loaded: %d tensors, %s on %s", len(keys), dtype, device)
    return out.eval()


def load_ffn_model(
    model: str | Path,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    expert_range: range | tuple[int, int] | None = None,
    gate_on_attention: bool = True,
    seed: int = 0,
    shared_experts: bool = True,
) -> FFNModel:
    """FFN side: routed experts of `expert_range` (default all), shared experts (unless `shared_experts=False`),
    gate/dense MLPs (gate on FFN)."""
    config, dtype, device = load_model_config(model), resolve_dtype(dtype), torch.device(device)
    with torch.device("meta"):
        out = FFNModel(
            config,
            expert_range=expert_range,
            gate_on_attention=gate_on_attention,
            dtype=dtype,
            shared_experts=shared_experts,
        )
    keys = ffn_keys(
        config, expert_range=expert_range, gate_on_attention=gate_on_attention, shared_experts=shared_experts
    )
    tensors = _read(model, config, keys, dtype=dtype, device=device, seed=seed, model=out)
    _fill(out, tensors)
    for layer_name, layer in out.layers.items():
        if layer.experts is None:
            continue
        w13, w2 = [], []
        for e in range(out.expert_start, out.expert_stop):
            gate, up, down = (tensors.pop(k) for k in _expert_keys(int(layer_name), e))
            w13.append(torch.cat([gate, up], dim=0))
            w2.append(down)
        H, inter = config.hidden_size, config.moe_intermediate_size
        _assign(out, f"layers.{layer_name}.experts.w13", _stack(w13, (0, 2 * inter, H), dtype, device))
        _assign(out, f"layers.{layer_name}.experts.w2", _stack(w2, (0, H, inter), dtype, device))
    logger.info("FFN model loaded: experts [%d, %d), %s on %s", out.expert_start, out.expert_stop, dtype, device)
    return out.eval()


def _stack(
    ts: list[torch.Tensor], empty_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    if not ts:
        return torch.empty(empty_shape, dtype=dtype, device=device)
    return torch.stack([t.to(device=device, dtype=dtype) for t in ts])
