"""afd against the `transformers` DeepseekV2/V3 implementation (the correctness oracle), float32."""

from __future__ import annotations

import pytest
import torch
from helpers.hf import spread_weights

from afd.engine.engine import LocalExchange
from afd.engine.generate import generate
from afd.model.batch import Batch
from afd.model.weights import load_attention_model, load_ffn_model

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 17, 3, 99, 42, 7, 61], [11, 2, 80], [63, 64, 1, 9, 33, 25, 70, 71, 4, 13, 50], [8]]
COMMON = dict(
    vocab_size=101,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=12,
    n_routed_experts=10,
    n_shared_experts=2,
    num_experts_per_tok=3,
    first_k_dense_replace=1,
    max_position_embeddings=64,
)
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
    "beta_fast": 32,
    "beta_slow": 1,
}
CASES = {
    # DeepSeek-V2-Lite style: no q_lora, YaRN, greedy softmax routing.
    "v2_nolora_yarn_greedy": ("v2", dict(q_lora_rank=None, rope_parameters=YARN, topk_method="greedy")),
    "v2_lora_group_limited": (
        "v2",
        dict(
            q_lora_rank=8,
            topk_method="group_limited_greedy",
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.0,
            first_k_dense_replace=2,
        ),
    ),
    "v3_lora_noaux_norm_yarn": (
        "v3",
        dict(
            q_lora_rank=8, n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5, rope_parameters=YARN
        ),
    ),
    "v3_nolora_nonorm_halves": (
        "v3",
        dict(
            q_lora_rank=None,
            n_group=5,
            topk_group=3,
            norm_topk_prob=False,
            routed_scaling_factor=1.5,
            rope_interleave=False,
        ),
    ),
}


def _build(kind: str, overrides: dict, tmp_path) -> torch.nn.Module:
    cfg_cls = transformers.DeepseekV2Config if kind == "v2" else transformers.DeepseekV3Config
    model_cls = transformers.DeepseekV2ForCausalLM if kind == "v2" else transformers.DeepseekV3ForCausalLM
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**{**COMMON, **overrides})).eval()
    spread_weights(model)
    model.save_pretrained(tmp_path)
    return model


@torch.no_grad()
def _hf_logits(model, prompt: list[int]) -> torch.Tensor:
    return model(torch.tensor([prompt])).logits[0].float()  # [L, V]


@torch.no_grad()
def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(_hf_logits(model, ids)[-1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_and_greedy_match_transformers(case, tmp_path):
    kind, overrides = CASES[case]
    hf = _build(kind, overrides, tmp_path)
    attn = load_attention_model(tmp_path, dtype="float32", device="cpu")
    ffn = load_ffn_model(tmp_path, dtype="float32", device="cpu")

    # One flattened ragged batch, no cache: logits of every position.
    flat = [t for p in PROMPTS for t in p]
    positions = [i for p in PROMPTS for i in range(len(p))]
    batch = Batch(
        slots=list(range(len(PROMPTS))), query_lens=[len(p) for p in PROMPTS], context_lens=[0] * len(PROMPTS)
    )
    with torch.no_grad():
        hidden = attn(torch.tensor(flat), torch.tensor(positions), batch, None, LocalExchange(ffn))
        logits = attn.compute_logits(hidden)  # [T, V]
    want = torch.cat([_hf_logits(hf, p) for p in PROMPTS])
    assert logits.abs().max() > 0.1  # not a degenerate comparison
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=0)

    # Greedy continuation with the engine (KV cache, mixed prefill/decode) equals transformers'.
    outs = generate(tmp_path, PROMPTS, max_new_tokens=4, dtype="float32", device="cpu")
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.token_ids == _hf_greedy(hf, prompt, 4)
