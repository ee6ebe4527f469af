"""Role-scoped loading, presets, and the FFN expert split."""

from __future__ import annotations

import pytest
import torch

import afd.model.weights as weights
from afd.model.moe import group_by_expert
from afd.model.presets import PRESETS, preset_tensor
from afd.model.weights import (
    attention_keys,
    ffn_keys,
    load_attention_model,
    load_ffn_model,
    load_model_config,
)
from afd.routing import Routing
from afd.topology import expert_ranges

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    """A tiny DeepseekV3 checkpoint saved in several shards."""
    path = tmp_path_factory.mktemp("ckpt")
    cfg = transformers.DeepseekV3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=2,
        kv_lora_rank=16,
        q_lora_rank=8,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        n_routed_experts=10,
        n_shared_experts=1,
        num_experts_per_tok=3,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
    )
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(cfg)
    model.save_pretrained(path, max_shard_size="20KB")
    return path, {k: v.detach().clone() for k, v in model.state_dict().items()}


class _RecordingOpen:
    """Wraps safetensors.safe_open and records every tensor read."""

    def __init__(self, real, reads: list[str]):
        self.real, self.reads = real, reads

    def __call__(self, *args, **kwargs):
        handle = self.real(*args, **kwargs)
        reads = self.reads

        class Handle:
            def __enter__(self):
                self.h = handle.__enter__()
                return self

            def __exit__(self, *exc):
                return handle.__exit__(*exc)

            def keys(self):
                return self.h.keys()

            def get_tensor(self, name):
                reads.append(name)
                return self.h.get_tensor(name)

            def get_slice(self, name):
                reads.append(name)
                return self.h.get_slice(name)

        return Handle()


@pytest.mark.timeout(30)
def test_ffn_load_reads_only_its_experts(hf_checkpoint, monkeypatch):
    path, state = hf_checkpoint
    assert len(list(path.glob("*.safetensors"))) > 1
    reads: list[str] = []
    monkeypatch.setattr(weights, "safe_open", _RecordingOpen(weights.safe_open, reads))
    config = load_model_config(path)

    ffn = load_ffn_model(path, expert_range=(3, 7), dtype="float32", device="cpu")
    assert sorted(reads) == sorted(ffn_keys(config, expert_range=(3, 7)))
    experts_read = {int(k.split(".")[5]) for k in reads if ".mlp.experts." in k}
    assert experts_read == {3, 4, 5, 6}
    assert not any("self_attn" in k or "embed" in k or "lm_head" in k or ".mlp.gate." in k for k in reads)
    w13 = ffn.layers["2"].experts.w13
    want = torch.cat([state["model.layers.2.mlp.experts.gate_up_proj"][e][None] for e in range(3, 7)])
    torch.testing.assert_close(w13, want)

    reads.clear()
    load_attention_model(path, dtype="float32", device="cpu")
    assert sorted(reads) == sorted(attention_keys(config))
    assert not any(".mlp.experts." in k or "shared_experts" in k for k in reads)
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in reads


@pytest.mark.timeout(30)
def test_gate_on_ffn_moves_gate_and_dense_mlp(hf_checkpoint):
    path, _ = hf_checkpoint
    config = load_model_config(path)
    attn_keys = attention_keys(config, gate_on_attention=False)
    keys = ffn_keys(config, expert_range=(0, 4), gate_on_attention=False)
    assert not any(".mlp." in k for k in attn_keys)
    assert "model.layers.0.mlp.gate_proj.weight" in keys and "model.layers.1.mlp.gate.weight" in keys
    assert set(attn_keys).isdisjoint(keys)


@pytest.mark.timeout(30)
def test_expert_split_not_dividing_evenly_sums_to_full():
    config = load_model_config("tiny")
    assert config.n_routed_experts % 3 != 0
    full = load_ffn_model("tiny")
    parts = [load_ffn_model("tiny", expert_range=r) for r in expert_ranges(config.n_routed_experts, 3)]
    torch.testing.assert_close(parts[1].layers["1"].experts.w13, full.layers["1"].experts.w13[4:7])
    torch.manual_seed(0)
    x = torch.randn(9, config.hidden_size)
    for layer in config.moe_layers:
        routing = _gate(layer, x)
        total = sum(p.experts_topk(layer, x, routing) for p in parts)
        torch.testing.assert_close(total, full.experts_topk(layer, x, routing), atol=1e-6, rtol=0)


def _gate(layer: int, x: torch.Tensor) -> Routing:
    return load_attention_model("tiny").layers[layer].gate(x)


@pytest.mark.timeout(30)
def test_grouped_experts_agree_with_topk_form():
    config = load_model_config("tiny")
    ffn = load_ffn_model("tiny", expert_range=(2, 9))
    torch.manual_seed(1)
    x = torch.randn(13, config.hidden_size)
    routing = _gate(1, x)
    groups = group_by_expert(routing.topk_ids, 2, 9)
    assert (
        groups.group_sizes
        == torch.bincount(routing.topk_ids[(routing.topk_ids >= 2) & (routing.topk_ids < 9)] - 2, minlength=7).tolist()
    )
    y = ffn.experts(1, x[groups.token_idx], groups.group_sizes)  # [N, H]
    w = routing.topk_weights.reshape(-1)[groups.pair_idx]
    want = torch.zeros(x.shape).index_add_(0, groups.token_idx, y * w[:, None])
    torch.testing.assert_close(ffn.experts_topk(1, x, routing), want)
    empty = ffn.experts(1, x[:0], [0] * 7)
    assert empty.shape == (0, config.hidden_size)


@pytest.mark.timeout(30)
def test_presets_and_errors():
    lite = load_model_config("deepseek-v2-lite")
    with torch.device("meta"):
        from afd.model.attention_side import AttentionModel
        from afd.model.ffn_side import FFNModel

        n = sum(p.numel() for m in (AttentionModel(lite), FFNModel(lite)) for p in m.parameters())
    assert abs(n - 15.7e9) / 15.7e9 < 0.01, n
    assert lite.rope_scaling["factor"] == 40 and lite.q_lora_rank is None
    with pytest.raises(ValueError, match="neither a preset"):
        load_model_config("no-such-model")
    with pytest.raises(ValueError, match="dtype"):
        load_attention_model("tiny", dtype="float64")
    with pytest.raises(ValueError, match="outside"):
        load_ffn_model("tiny", expert_range=(5, 11))


@pytest.mark.timeout(30)
def test_router_weight_kept_in_a_16_bit_dtype_only_where_it_holds_it_exactly(hf_checkpoint):
    path, state = hf_checkpoint  # an fp32 checkpoint: its gate has more bits than bf16
    key = "model.layers.1.mlp.gate.weight"
    assert load_attention_model(path, dtype="bfloat16").layers[1].gate.weight.dtype == torch.float32
    exact = state[key].bfloat16().float()
    assert weights._gate_dtype(key, exact, torch.bfloat16) == torch.bfloat16
    assert weights._gate_dtype(key, exact, torch.float32) == torch.float32
    assert weights._gate_dtype(key, state[key], torch.bfloat16) == torch.float32
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert weights._gate_dtype(bias, torch.zeros(10), torch.bfloat16) == torch.float32
    # a release's preset ships its router weight in bf16's values, as the release does; a test preset does not
    assert "torch_dtype" not in PRESETS["tiny"] and PRESETS["deepseek-v3"]["torch_dtype"] == "bfloat16"
    released = preset_tensor(0, key, (10, 32), torch.device("cpu"), "bfloat16")
    assert released.dtype == torch.float32 and weights._gate_dtype(key, released, torch.bfloat16) == torch.bfloat16
    assert torch.equal(released, preset_tensor(0, key, (10, 32), torch.device("cpu")).bfloat16().float())
    for dtype in ("float32", "bfloat16"):
        gate = load_attention_model("tiny", dtype=dtype).layers[1].gate
        assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
