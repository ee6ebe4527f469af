"""The vLLM adapter's checks, without vLLM: what it accepts, refusals in one sentence, and where the CPU rotary op is
turned off."""

from __future__ import annotations

import pytest
import torch
from helpers.vllm_shapes import SHAPES

from afd.config import parse_config
from afd.model.config import ModelConfig
from afd.vllm_plugin.checks import (
    AdapterError,
    EngineSettings,
    afd_config_from,
    check_engine,
    check_model,
    check_vllm_version,
    rotary_custom_ops,
)

pytestmark = pytest.mark.vllm
ARCH = {"v2": "AFDDeepseekV2ForCausalLM", "v3": "AFDDeepseekV3ForCausalLM"}
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


# ---------------------------------------------------------------- what the adapter accepts (no vLLM needed)
def _model(**overrides) -> ModelConfig:
    return ModelConfig.from_hf({"model_type": "deepseek_v2", **SHAPES, **overrides})


def _engine(**overrides) -> EngineSettings:
    return EngineSettings(**{"device": "cpu", "dtype": torch.float32, "enforce_eager": True, **overrides})


@pytest.mark.parametrize(
    "call, sentence",
    [
        (lambda: check_vllm_version("0.33.0"), "tested with vLLM 0.32.0 only and vLLM 0.33.0 is installed"),
        (lambda: afd_config_from({}), 'need additional_config={"afd": {...}}'),
        (lambda: afd_config_from({"afd": {"connector": "nccl"}}), "additional_config['afd']: connector must be"),
        (lambda: afd_config_from({"afd": {"role": "ffn"}}), "vLLM runs the attention side"),
        (lambda: afd_config_from({"afd": {"compute_gate_on_attention": False}}), "computes the gate in vLLM"),
        (
            lambda: afd_config_from(
                {"afd": {"connector": "async", "connector_extra_config": {"shared_experts_on_attention": True}}}
            ),
            "leaves the shared experts to the FFN ranks",
        ),
        (lambda: check_engine(parse_config({}), _engine(enforce_eager=False)), "enforce_eager=True"),
        (lambda: check_engine(parse_config({}), _engine(tensor_parallel_size=2)), "tensor_parallel_size=1"),
        (
            lambda: check_engine(parse_config({"connector_extra_config": {"p2p_ubatching": True}}), _engine()),
            "turn it off in connector_extra_config",
        ),
        (
            lambda: check_engine(
                parse_config({"connector": "async", "connector_extra_config": {"async_moe_ubatching": True}}),
                _engine(),
            ),
            "vLLM runs a step as one forward",
        ),
        (
            lambda: check_engine(parse_config({"connector": "async", "num_attention_ranks": 2}), _engine()),
            "num_attention_ranks=2 but vLLM runs data_parallel_size=1",
        ),
        (
            lambda: check_engine(parse_config({"num_attention_ranks": 2}), _engine(data_parallel_size=2)),
            "p2p with num_attention_ranks=2",
        ),
        (lambda: check_model(_model(kv_lora_rank=16), ARCH["v2"], "cpu"), "CPU MLA kernel needs kv_lora_rank=512"),
        (lambda: check_model(_model(), ARCH["v3"], "cpu"), "runs deepseek_v3 checkpoints but this one is deepseek_v2"),
        (lambda: check_model(_model(n_routed_experts=0), ARCH["v2"], "cpu"), "no MoE layer"),
        (lambda: check_model(_model(quantization_config=FP8), ARCH["v2"], "cpu"), "CPU build has no FP8 linear"),
        (lambda: check_model(_model(), ARCH["v2"], "cpu", "fp8"), "cannot run FP8 attention weights"),
    ],
)
def test_refusals_are_one_sentence(call, sentence):
    with pytest.raises(AdapterError) as exc:
        call()
    assert sentence in str(exc.value)
    assert "\n" not in str(exc.value)


def test_what_the_adapter_accepts():
    """The settings the end-to-end tests run, and async with one attention rank per vLLM data-parallel rank."""
    check_vllm_version("0.32.0")
    assert afd_config_from({"afd": {"connector": "GpuAsyncAFDConnector", "role": "attention"}}).connector == "async"
    check_engine(parse_config({}), _engine())
    check_engine(parse_config({"connector": "async", "num_attention_ranks": 2}), _engine(data_parallel_size=2))
    check_model(_model(), ARCH["v2"], "cpu")
    check_model(_model(kv_lora_rank=16), ARCH["v2"], "cuda")  # vLLM's GPU kernels take other widths
    check_model(_model(quantization_config=FP8), ARCH["v2"], "cuda", "fp8")  # and FP8 linears


def test_cpu_rotary_op_is_turned_off_only_where_it_is_broken():
    assert rotary_custom_ops("0.32.0", "cpu", ["none"]) == ["none", "-rotary_embedding"]
    assert rotary_custom_ops("0.32.0", "cpu", ["+rotary_embedding"]) is None  # the user decided
    assert rotary_custom_ops("0.32.0", "cuda", []) is None
    assert rotary_custom_ops("0.33.0", "cpu", []) is None
