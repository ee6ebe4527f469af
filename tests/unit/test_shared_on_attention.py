"""Shared experts on the attention rank (`connector_extra_config.shared_experts_on_attention`, async): the plan
sends no shared rows, the FFN ranks load and run only routed experts and reply in fp32, the attention rank runs
the shared experts between send and recv and adds them before the one rounding; outputs equal the reference."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from helpers.e2e import MODEL, assert_matches_reference
from helpers.ubatch_runs import IN_PROCESS_PROMPTS, endpoint_args, run_in_process

from afd.config import AsyncExtraConfig, ConfigError
from afd.connectors.asynchronous.attention import AsyncAttentionExchange
from afd.connectors.asynchronous.dispatch import ExpertMap, plan_dispatch
from afd.connectors.asynchronous.wire import SlotLayout
from afd.engine.generate import generate
from afd.model.weights import attention_keys, ffn_keys, load_attention_model, load_ffn_model, load_model_config
from afd.topology import AsyncTopology, expert_ranges

KEY = "shared_experts_on_attention"


# ---------------------------------------------------------------- pure parts


@pytest.mark.parametrize("num_ffn", [1, 2, 3])
def test_plan_without_shared_rows_keeps_the_same_destinations(num_ffn: int) -> None:
    """Only the shared flags change: every FFN rank gets the same tokens (ascending), none as a shared row."""
    gen = torch.Generator().manual_seed(num_ffn)
    topk_ids = torch.stack([torch.randperm(16, generator=gen)[:4] for _ in range(40)])  # [T, K], 16 experts
    experts = ExpertMap.from_ranges(expert_ranges(16, num_ffn))
    default, here = plan_dispatch(topk_ids, experts), plan_dispatch(topk_ids, experts, shared_on_ffn=False)
    assert here.rows == default.rows and here.offsets == default.offsets
    assert here.shared_rows == (0,) * num_ffn and sum(default.shared_rows) == 40
    for f in range(num_ffn):
        seg = here.token_index[here.segment(f)]
        assert seg.tolist() == sorted(default.token_index[default.segment(f)].tolist())


def test_replies_are_fp32_when_the_attention_rank_adds_the_shared_experts() -> None:
    args = dict(hidden_size=64, dtype=torch.bfloat16, topk=6, max_num_batched_tokens=32)
    assert SlotLayout.for_model(num_ffn=1, **args).reply_dtype == torch.bfloat16
    assert SlotLayout.for_model(num_ffn=1, shared_on_attention=True, **args).reply_dtype == torch.float32


def test_each_role_loads_the_shared_experts_once() -> None:
    """Together the two roles read every tensor of the default split, and the shared experts on one side only."""
    config = load_model_config(MODEL)
    ranges = expert_ranges(config.n_routed_experts, 2)
    default = set(attention_keys(config)) | {k for r in ranges for k in ffn_keys(config, expert_range=r)}
    attn = set(attention_keys(config, shared_experts=True))
    ffn = {k for r in ranges for k in ffn_keys(config, expert_range=r, shared_experts=False)}
    shared = {k for k in default if ".mlp.shared_experts." in k}
    assert shared and shared <= attn and not shared & ffn
    assert attn | ffn == default


def test_attention_side_shared_experts_equal_the_ffn_sides() -> None:
    attn = load_attention_model(MODEL, shared_experts=True)
    ffn = load_ffn_model(MODEL)
    assert attn.has_shared_experts and not load_ffn_model(MODEL, shared_experts=False).has_shared_experts
    x = torch.randn(5, attn.config.hidden_size, generator=torch.Generator().manual_seed(0))
    for layer in attn.config.moe_layers:
        torch.testing.assert_close(attn.shared(layer, x), ffn.shared(layer, x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="not on the attention side"):
        load_attention_model(MODEL).shared(attn.config.moe_layers[0], x)


def test_config_rejects_a_non_bool() -> None:
    assert AsyncExtraConfig.from_dict({KEY: True}).shared_experts_on_attention
    with pytest.raises(ConfigError, match=f"connector_extra_config.{KEY} must be true or false"):
        AsyncExtraConfig.from_dict({KEY: "yes"})


# ---------------------------------------------------------------- in process, real shared memory


def _endpoint_args(num_ubatches: int) -> dict:
    ubatching = {"async_moe_ubatching": True, "async_moe_num_ubatches": num_ubatches} if num_ubatches > 1 else {}
    return endpoint_args(**{KEY: True}, **ubatching)


@pytest.mark.timeout(60)
def test_exchange_without_the_models_shared_experts_is_refused() -> None:
    topo = AsyncTopology(1, 1, load_model_config(MODEL).n_routed_experts)
    with pytest.raises(ValueError, match="needs the attention model's shared experts"):
        AsyncAttentionExchange(dist.HashStore(), topo, 0, **_endpoint_args(1))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("num_ffn, num_ubatches", [(1, 1), (2, 3)])
def test_engine_with_shared_experts_here_equals_the_reference(num_ffn: int, num_ubatches: int) -> None:
    """One attention rank in this process, FFN ranks in threads over real shared memory; with three micro-batches
    in flight the shared outputs of each wait beside its own send."""
    topo = AsyncTopology(1, num_ffn, load_model_config(MODEL).n_routed_experts)
    model = load_attention_model(MODEL, shared_experts=True)
    outputs, engine = run_in_process(
        topo,
        _endpoint_args(num_ubatches),
        model,
        lambda f: load_ffn_model(MODEL, expert_range=topo.expert_ranges[f], shared_experts=False),
        shared_experts=model.shared,
    )
    assert (engine.ubatched_steps > 0) == (num_ubatches > 1)
    assert_matches_reference(outputs, generate(MODEL, IN_PROCESS_PROMPTS, max_new_tokens=4, prompt_logprobs=True))


def test_command_line_default_is_the_attention_rank_for_async_unless_the_config_or_flag_says() -> None:
    """`afd launch/generate/serve/bench` put async's shared experts on its attention ranks when neither the config
    nor `--shared-experts` says where; a config's own value and the flag win; other connectors keep them on the FFN
    side; the dataclass default (the Python API, the vLLM adapter) stays off."""
    from afd.cli.args import launch_config
    from afd.config import AsyncExtraConfig, default_shared_experts, given_extra_keys

    def placed(source, connector="async", flag=None) -> bool:
        extra = launch_config(source, connector, port=1, shared_experts=flag).connector_extra_config
        return getattr(extra, KEY, False)

    assert placed(None) and placed('{"connector_extra_config": {"ring_depth": 2}}')
    assert not placed(json.dumps({"connector_extra_config": {KEY: False}}))
    assert not placed(json.dumps({"afd": {"connector": "async", "connector_extra_config": {KEY: False}}}))
    assert not placed(None, flag="ffn")
    assert placed(json.dumps({"connector_extra_config": {KEY: False}}), flag="attention")
    assert not placed('{"connector": "p2p", "connector_extra_config": {"timeout_s": 5}}', "p2p")
    assert placed(json.dumps({"connector": "p2p"}), "async")  # another connector's config: the default
    assert default_shared_experts("async") == "attention" and default_shared_experts("p2p") == "ffn"
    assert given_extra_keys(json.dumps({"afd": {"connector_extra_config": {KEY: True}}})) == {KEY}
    assert not AsyncExtraConfig().shared_experts_on_attention
