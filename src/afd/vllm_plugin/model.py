"""vLLM's DeepSeek-V2/V3 with every MoE layer handed to afd FFN ranks.

`AFDDeepseekV2ForCausalLM` is vLLM's `DeepseekV2ForCausalLM` (attention, paged cache, scheduler, sampler: all
vLLM's) with one difference: where vLLM builds `DeepseekV2MoE` (gate, fused experts, shared experts), it builds
`AFDMoE` — afd's own `Gate` (so the routing is exactly afd's `select_experts`: grouped top-k, the V3 correction
bias, `routed_scaling_factor`) and a call to the afd exchange, whose answer is the routed plus shared output.

How: while the parent constructor runs, `deepseek_v2.DeepseekV2MoE` names the AFDMoE class (restored right after),
so no expert tensor is ever allocated here and no fused-MoE layer registers itself in vLLM's static forward
context (`static_all_moe_layers` stays empty; `_check_no_fused_moe` proves it). Expert weights are not kept:
`load_weights` drops them, and `is_unused_checkpoint_weight` lets vLLM skip shards that hold nothing else.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.models import deepseek_v2
from vllm.platforms import current_platform

from afd.model.config import ModelConfig
from afd.model.layers import Gate
from afd.vllm_plugin.hook import prepare
from afd.vllm_plugin.session import AFDSession

logger = logging.getLogger(__name__)

_FFN_WEIGHT = re.compile(r"\.mlp\.(experts|shared_experts)\.")  # tensors the FFN ranks own


class AFDMoE(nn.Module):
    """Stands where vLLM's `DeepseekV2MoE` stands: `forward(x [T, H]) -> [T, H]` (routed + shared, model dtype).

    `model_config` and `routed_scaling_factor` are bound per model by `moe_class`; `exchange` is set once the
    model has joined the AFD world.
    """

    model_config: ModelConfig
    routed_scaling_factor: float

    def __init__(self, config: object, *args: object, prefix: str = "", **kwargs: object) -> None:
        super().__init__()  # vLLM's arguments (parallel and quant config, ...) mean nothing here
        self.layer_idx = int(prefix.split(".")[-2])  # "model.layers.<i>.mlp"
        self.gate = Gate(self.model_config, self.routed_scaling_factor).float()  # fp32, as on afd's own ranks
        self.exchange: AFDSession | None = None

    def forward(self, hidden_states: torch.Tensor, already_sequence_parallel: bool = False) -> torch.Tensor:
        if self.exchange is None:
            raise RuntimeError(f"afd MoE layer {self.layer_idx} ran before the model joined the AFD world")
        routing = self.gate(hidden_states)  # topk_ids [T, K] int64, topk_weights [T, K] fp32
        return self.exchange(self.layer_idx, hidden_states, routing)


def moe_class(model: ModelConfig, dtype: torch.dtype) -> type[AFDMoE]:
    """AFDMoE bound to one model's routing; float16 leaves the scaling factor out as afd (and vLLM) do."""
    rsf = 1.0 if dtype == torch.float16 else model.routed_scaling_factor
    return type("AFDMoE", (AFDMoE,), {"model_config": model, "routed_scaling_factor": rsf})


@contextmanager
def _moe_built_as(cls: type[nn.Module]) -> Iterator[None]:
    """While a DeepSeek model is built, its decoder layers build `cls` where they would build DeepseekV2MoE."""
    saved = deepseek_v2.DeepseekV2MoE
    deepseek_v2.DeepseekV2MoE = cls
    try:
        yield
    finally:
        deepseek_v2.DeepseekV2MoE = saved


def _check_no_fused_moe(vllm_config: VllmConfig) -> None:
    """No fused-MoE layer may be left in vLLM's static forward context: vLLM would run it on every forward."""
    fused = list(vllm_config.compilation_config.static_all_moe_layers)
    if fused:
        raise RuntimeError(f"vLLM registered fused-MoE layers {fused[:3]} on the afd attention side")


class AFDDeepseekV2ForCausalLM(deepseek_v2.DeepseekV2ForCausalLM):
    """vLLM's DeepSeek-V2 whose MoE layers run on afd FFN ranks (`additional_config={"afd": {...}}`)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        cfg, model = prepare(vllm_config)  # the hook's checks again: this process may not have run them
        dtype = vllm_config.model_config.dtype
        with _moe_built_as(moe_class(model, dtype)):
            super().__init__(vllm_config=vllm_config, prefix=prefix)
        _check_no_fused_moe(vllm_config)
        moe = {layer.mlp.layer_idx: layer.mlp for layer in self.model.layers if isinstance(layer.mlp, AFDMoE)}
        if sorted(moe) != model.moe_layers:
            raise RuntimeError(f"vLLM built MoE layers {sorted(moe)}, afd expects {model.moe_layers}")
        device = torch.device(current_platform.device_type)
        if device.type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        self.afd = AFDSession(
            cfg,
            model,
            attn_rank=vllm_config.parallel_config.data_parallel_rank,
            dtype=dtype,
            device=device,
            max_num_batched_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
        )
        for layer in moe.values():
            layer.exchange = self.afd

    def set_moe_parameters(self) -> None:
        """No expert lives here: vLLM must not treat this model as one it balances or loads experts into."""
        self.num_moe_layers = 0
        self.num_expert_groups = getattr(self.config, "n_group", 1)
        self.moe_layers, self.moe_mlp_layers = [], []
        self.num_logical_experts = self.num_physical_experts = self.num_local_physical_experts = 0
        self.num_routed_experts = self.num_shared_experts = self.num_redundant_experts = 0

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        with self.afd.step(positions.shape[0]):  # positions: [T]
            return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)

    def is_unused_checkpoint_weight(self, name: str) -> bool:
        """vLLM does not read safetensors shards that hold only expert tensors."""
        return _FFN_WEIGHT.search(name) is not None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Everything but the routed and shared experts (the gate is loaded here: it runs here)."""
        return super().load_weights((name, w) for name, w in weights if _FFN_WEIGHT.search(name) is None)


class AFDDeepseekV3ForCausalLM(AFDDeepseekV2ForCausalLM):
    """vLLM's DeepSeek-V3 (the same module as V2 in vLLM) whose MoE layers run on afd FFN ranks."""
