"""The adapter's checks on vLLM's config, in the process that builds that config.

vLLM calls `AFDConfigHook.verify_and_update_config` for the afd architectures while it builds its `VllmConfig`
(in `vllm.LLM(...)` or the API server, before any engine process starts), so a refusal is the error the user
sees first. The model constructor runs `prepare` again in the worker process; the checks are cheap.
"""

from __future__ import annotations

import logging

import vllm
from vllm.config import VllmConfig
from vllm.model_executor.models.config import VerifyAndUpdateConfig
from vllm.platforms import current_platform

from afd.config import AFDConfig
from afd.model.config import ModelConfig
from afd.vllm_plugin.checks import (
    EngineSettings,
    afd_config_from,
    check_engine,
    check_model,
    check_vllm_version,
    model_config_of,
    rotary_custom_ops,
)

logger = logging.getLogger(__name__)


def prepare(vllm_config: VllmConfig) -> tuple[AFDConfig, ModelConfig]:
    """Check everything the adapter depends on; the AFD config and afd's view of the model, or AdapterError."""
    check_vllm_version(vllm.__version__)
    model_config = vllm_config.model_config
    parallel = vllm_config.parallel_config
    cfg = afd_config_from(vllm_config.additional_config if isinstance(vllm_config.additional_config, dict) else {})
    device = current_platform.device_type  # "cpu", "cuda", ...
    dtype = model_config.dtype  # a torch.dtype once vLLM resolved "auto"
    check_engine(
        cfg,
        EngineSettings(
            device=device,
            dtype=dtype,
            enforce_eager=bool(model_config.enforce_eager),
            tensor_parallel_size=parallel.tensor_parallel_size,
            pipeline_parallel_size=parallel.pipeline_parallel_size,
            data_parallel_size=parallel.data_parallel_size,
        ),
    )
    model = model_config_of(model_config.model, model_config.hf_config.to_dict())
    check_model(model, model_config.architecture or "", device, model_config.quantization)
    return cfg, model


class AFDConfigHook(VerifyAndUpdateConfig):
    """vLLM's per-architecture config hook for the afd architectures."""

    @staticmethod
    def verify_and_update_config(vllm_config: VllmConfig) -> None:
        cfg, _ = prepare(vllm_config)
        compilation = vllm_config.compilation_config
        custom_ops = rotary_custom_ops(vllm.__version__, current_platform.device_type, list(compilation.custom_ops))
        if custom_ops is not None:
            compilation.custom_ops = custom_ops
            logger.info(
                "afd: vLLM %s's CPU rotary_embedding op rotates DeepSeek's query wrongly; using its PyTorch "
                "version instead (custom_ops %s)",
                vllm.__version__,
                custom_ops,
            )
        logger.info("afd: the MoE layers go to %d FFN rank(s) over %s", cfg.num_ffn_ranks, cfg.connector)
