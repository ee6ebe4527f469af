"""The reference engine: KV-cache decode, batching, the zero-token step, gate placement, dtypes, input checks."""

from __future__ import annotations

import math

import pytest
import torch

from afd.connectors.base import Exchange
from afd.engine.engine import Engine, LocalExchange, Request
from afd.engine.generate import generate
from afd.model.weights import load_attention_model, load_ffn_model

PROMPTS = [[1, 2, 3], [4, 5], [9, 8, 7, 6, 5, 4, 3, 2, 1], [200]]


@pytest.mark.timeout(30)
def test_kv_cache_decode_equals_recompute():
    outs = generate("tiny", PROMPTS, max_new_tokens=6, dtype="float32", device="cpu", prompt_logprobs=True)
    assert [o.prompt_ids for o in outs] == PROMPTS
    for out in outs:
        assert len(out.token_ids) == len(out.logprobs) == 6
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(out.prompt_ids)
        # Scoring prompt + continuation in one prefill (no cache) gives the decode-time logprobs.
        (full,) = generate("tiny", [out.prompt_ids + out.token_ids], max_new_tokens=0, prompt_logprobs=True)
        assert full.token_ids == [] and full.logprobs == []
        recomputed = full.prompt_logprobs[len(out.prompt_ids) :]
        assert recomputed == pytest.approx(out.logprobs, abs=1e-5)
        assert full.prompt_logprobs[: len(out.prompt_ids)] == pytest.approx(out.prompt_logprobs, abs=1e-5)


@pytest.mark.timeout(30)
def test_batching_does_not_change_results():
    attn, ffn = load_attention_model("tiny"), load_ffn_model("tiny")
    alone = [Engine(attn, LocalExchange(ffn), 64) for _ in PROMPTS]
    want = []
    for engine, p in zip(alone, PROMPTS, strict=True):
        engine.add(Request(p, 5))
        want.append(engine.run()[0].token_ids)
    # A small budget forces prefills to spread over steps and mix with decodes.
    engine = Engine(attn, LocalExchange(ffn), max_num_batched_tokens=10)
    ids = [engine.add(Request(p, 5)) for p in PROMPTS]
    got = engine.run()
    assert [o.request_id for o in got] == ids
    assert [o.token_ids for o in got] == want
    assert engine.kv_cache.num_sequences == 0 and engine.cache_tokens_used == 0
    assert engine.kv_cache.pool.num_free == engine.kv_cache.num_blocks


class _Recorder(Exchange):
    def __init__(self, inner):
        self.inner, self.calls, self.steps = inner, [], []

    def begin_step(self, num_tokens: int) -> None:
        self.steps.append(num_tokens)

    def __call__(self, layer_idx, x, routing):
        self.calls.append((layer_idx, tuple(x.shape), routing is not None))
        return self.inner(layer_idx, x, routing)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("gate_on_attention", [True, False])
def test_zero_token_step_calls_every_boundary_layer(gate_on_attention):
    attn = load_attention_model("tiny", gate_on_attention=gate_on_attention)
    ffn = load_ffn_model("tiny", gate_on_attention=gate_on_attention)
    rec = _Recorder(LocalExchange(ffn))
    engine = Engine(attn, rec, 16)
    assert not engine.has_work()
    assert engine.step() == []
    H = attn.config.hidden_size
    assert rec.steps == [0]
    assert [c[0] for c in rec.calls] == attn.boundary_layers
    assert all(c[1] == (0, H) and c[2] == gate_on_attention for c in rec.calls)
    want = [1, 2, 3] if gate_on_attention else [0, 1, 2, 3]
    assert attn.boundary_layers == want


@pytest.mark.timeout(30)
def test_gate_on_ffn_matches_gate_on_attention():
    a = generate("tiny", PROMPTS, max_new_tokens=3, gate_on_attention=True)
    b = generate("tiny", PROMPTS, max_new_tokens=3, gate_on_attention=False)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    for x, y in zip(a, b, strict=True):
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_is_close_to_float32(dtype):
    ref = generate("tiny", PROMPTS, max_new_tokens=2, prompt_logprobs=True)
    got = generate("tiny", PROMPTS, max_new_tokens=2, prompt_logprobs=True, dtype=dtype)
    for r, g in zip(ref, got, strict=True):
        assert all(math.isfinite(v) for v in g.logprobs + g.prompt_logprobs[1:])
        # compare probabilities: bf16 keeps ~3 digits, so a logprob near -5 moves by ~0.1 while its probability
        # moves by well under 0.03
        got_p = [math.exp(v) for v in g.prompt_logprobs[1:]]
        assert got_p == pytest.approx([math.exp(v) for v in r.prompt_logprobs[1:]], abs=0.03)
    attn = load_attention_model("tiny", dtype=dtype)
    rsf = attn.config.routed_scaling_factor
    assert attn.scale == (1 / rsf if dtype == "float16" else 1.0)
    gate = attn.layers[1].gate
    assert gate.weight.dtype == torch.float32 and gate.routed_scaling_factor == (1.0 if dtype == "float16" else rsf)


@pytest.mark.timeout(30)
def test_input_validation():
    with pytest.raises(ValueError, match="empty"):
        generate("tiny", [[1, 2], []], max_new_tokens=1)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generate("tiny", [[1, 256]], max_new_tokens=1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate("tiny", [[1]], max_new_tokens=-1)
    with pytest.raises(ValueError, match="preset"):
        generate("nope", [[1]], max_new_tokens=1)
    engine = Engine(load_attention_model("tiny"), LocalExchange(load_ffn_model("tiny")), 4)
    engine.add(Request([1, 2, 3, 4, 5], 1))  # longer than the budget: prefilled in chunks (test_chunked_prefill)
    (out,) = generate("tiny", [[7, 8]], max_new_tokens=0)
    assert out.token_ids == [] and out.prompt_logprobs is None
    assert set(out.to_json()) == {"prompt_ids", "token_ids", "logprobs", "prompt_logprobs"}
