"""afd as a vLLM plugin: vLLM runs attention (scheduler, paged cache, API server), afd FFN ranks run the experts.

`register` is the `vllm.general_plugins` entry point; vLLM calls it in every process it starts. It registers
`AFDDeepseekV2ForCausalLM` / `AFDDeepseekV3ForCausalLM` lazily (nothing of vLLM's model code is imported here),
their config hook, and shows afd's log lines in vLLM's log. Select an architecture with
`hf_overrides={"architectures": ["AFDDeepseekV2ForCausalLM"]}` and configure it with
`additional_config={"afd": {...}}` (the AFD config, role attention); see docs/vllm.md.
"""

from __future__ import annotations

import logging

from afd.vllm_plugin.checks import ARCHITECTURES, TESTED_VLLM_VERSIONS

logger = logging.getLogger(__name__)


def register() -> None:
    """Register the afd architectures with vLLM. Never raises: vLLM would only log it and go on without them;
    an untested vLLM version is refused when an afd architecture is used."""
    import vllm
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    from afd.vllm_plugin.hook import AFDConfigHook

    _log_through_vllm()
    for arch in ARCHITECTURES:
        if arch not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(arch, f"afd.vllm_plugin.model:{arch}")
        MODELS_CONFIG_MAP[arch] = AFDConfigHook
    if vllm.__version__ not in TESTED_VLLM_VERSIONS:
        logger.warning("afd's vLLM adapter was tested with vLLM %s, not %s", TESTED_VLLM_VERSIONS, vllm.__version__)


class _ToVllmLog(logging.Handler):
    """Hands afd's records to vLLM's logger, whose handlers vLLM sets up (and may replace) after plugins load."""

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger("vllm").handle(record)


def _log_through_vllm() -> None:
    """vLLM's processes show only the `vllm` logger tree; route afd's INFO lines there too, unless the application
    configured logging itself."""
    afd_logger = logging.getLogger("afd")
    own = [h for h in afd_logger.handlers if not isinstance(h, logging.NullHandler)]
    if own or logging.getLogger().handlers:
        return
    afd_logger.addHandler(_ToVllmLog())
    afd_logger.setLevel(logging.INFO)
    afd_logger.propagate = False
