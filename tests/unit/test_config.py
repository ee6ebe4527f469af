"""Config parsing: every rejection path, the wrapped shape with aliases, through the library and `afd config`."""

import json

import pytest
from helpers.config_cases import WRAPPED

from afd.config import AsyncExtraConfig, ConfigError, P2pExtraConfig, parse_config


def test_wrapped_shape_with_aliases_folds_to_canonical() -> None:
    cfg = parse_config(WRAPPED)
    assert (cfg.role, cfg.connector, cfg.host, cfg.port) == ("ffn", "async", "10.0.0.2", 7000)
    assert (cfg.num_attention_ranks, cfg.num_ffn_ranks, cfg.world_size) == (3, 2, 5)
    assert cfg.connector_extra_config == AsyncExtraConfig(ring_depth=2)


def test_micro_batching_sizes_the_ring_by_default() -> None:
    """ring_depth is the messages in flight per peer: one per micro-batch unless given (larger is allowed)."""

    def extra(**raw: object) -> AsyncExtraConfig:
        return parse_config({"connector": "async", "connector_extra_config": raw}).connector_extra_config

    assert extra().ring_depth == 1 and extra(async_moe_num_ubatches=3).ring_depth == 1  # off: one in flight
    on = extra(async_moe_ubatching=True, async_moe_num_ubatches=3)
    assert (on.async_moe_ubatching, on.async_moe_num_ubatches, on.ring_depth) == (True, 3, 3)
    assert extra(async_moe_ubatching=True, ring_depth=4).ring_depth == 4
    cfg = parse_config({"connector": "async", "connector_extra_config": {"async_moe_ubatching": True}})
    assert cfg.replace(port=7001).connector_extra_config == cfg.connector_extra_config  # survives a round trip


def test_defaults_and_sources(tmp_path) -> None:
    cfg = parse_config({})
    assert cfg.connector == "p2p" and cfg.port == 6239 and cfg.compute_gate_on_attention
    assert cfg.connector_extra_config == P2pExtraConfig()
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"connector": "P2pNcclAFDConnector", "num_ffn_ranks": 4}))
    assert parse_config(str(path)) == parse_config(path) == parse_config(path.read_text())
    assert parse_config(path).num_ffn_ranks == 4


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"bogus": 1}, "unknown key 'bogus' in the AFD config"),
        ({"connector": "nccl"}, "connector must be one of"),
        ({"role": "expert"}, "role must be 'attention' or 'ffn'"),
        ({"port": 0}, "port must be between 1 and 65535"),
        ({"port": 70000}, "port must be between 1 and 65535"),
        ({"port": "80"}, "port must be an integer"),
        ({"host": ""}, "host must be a non-empty"),
        ({"num_attention_ranks": 0}, "num_attention_ranks must be between 1 and 1024"),
        ({"num_ffn_ranks": 1.5}, "num_ffn_ranks must be an integer"),
        ({"num_ffn_ranks": True}, "num_ffn_ranks must be an integer"),
        ({"compute_gate_on_attention": "yes"}, "compute_gate_on_attention must be true or false"),
        ({"connector": "async", "compute_gate_on_attention": False}, "async connector needs the gate on attention"),
        ({"connector_extra_config": {"ring_depth": 2}}, "unknown key 'ring_depth' in connector_extra_config for p2p"),
        ({"connector_extra_config": {"timeout_s": -1}}, "timeout_s must be greater than 0"),
        ({"connector": "async", "connector_extra_config": {"nope": 1}}, "unknown key 'nope' in connector_extra_config"),
        ({"connector": "async", "connector_extra_config": {"ring_depth": 0}}, "ring_depth must be at least 1"),
        ({"connector": "async", "connector_extra_config": {"routed_cap_multiplier": 0}}, "routed_cap_multiplier"),
        ({"connector": "async", "connector_extra_config": {"recv_poll_timeout_ms": 0}}, "recv_poll_timeout_ms"),
        (
            {
                "connector": "async",
                "connector_extra_config": {"async_moe_ubatching": True, "async_moe_num_ubatches": 1},
            },
            "async_moe_num_ubatches must be at least 2 when async_moe_ubatching is true",
        ),
        (
            {"connector": "async", "connector_extra_config": {"async_moe_ubatching": True, "ring_depth": 1}},
            "ring_depth=1 cannot hold async_moe_num_ubatches=2",
        ),
        ({"connector": "async", "connector_extra_config": {"async_moe_num_ubatches": 17}}, "between 1 and 16"),
        ({"connector": "async", "connector_extra_config": {"async_moe_split": "x"}}, "async_moe_split must be"),
        ({"connector": "async", "connector_extra_config": {"attn_ranks_per_dp": 2}}, "attn_ranks_per_dp=2"),
        ({"connector_extra_config": [1]}, "connector_extra_config must be a JSON object"),
        ({"afd": {}, "port": 1}, "wrapped config must be exactly"),
        ({"role": "ffn", "afd_role": "ffn"}, "given twice"),
    ],
)
def test_rejections_name_the_key(raw: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(raw)


@pytest.mark.parametrize("text, message", [("{not json", "not valid JSON"), ("[1]", "must be a JSON object")])
def test_bad_json(tmp_path, text: str, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        parse_config(path)
    with pytest.raises(ConfigError, match="does not exist"):
        parse_config(str(tmp_path / "missing.json"))
