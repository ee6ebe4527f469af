"""Prefill graph pieces with the in-process MoE inside them (afd.engine.graphs.prefill, `ffn_model`): mixed steps
(decodes beside prompt chunks) padded to several buckets equal the plain eager forward (CPU, fp32, `capture=False`
runs the same padded pieces), padding rows are routed to no expert, and nothing reaches an exchange; without
`ffn_model` (a disaggregated exchange) the exchange still sees exactly the real rows at every boundary layer. The
choice is made once by the ModelRunner, and the memory estimate grows by the MoE's temporaries."""

from __future__ import annotations

import functools
import logging
import random

import pytest
import torch
from helpers.e2e import MODEL, assert_matches_reference
from helpers.graph_fakes import RealRowsOnly
from helpers.prefill_steps import prepared_step

import afd.engine.model_runner as model_runner
from afd.engine.engine import Engine, LocalExchange, Request
from afd.engine.graphs.prefill import PrefillGraphRunner, graph_memory_estimate, moe_graph_bytes_per_token
from afd.model.attention_side import run_segments
from afd.model.kv_cache import PagedLatentCache
from afd.model.weights import load_attention_model, load_ffn_model, load_model_config
from afd.routing import Routing

BLOCK = 4
BUDGET = 300  # buckets 128, 256, 300
# (query length, cached context) per sequence: decodes (1, c) beside fresh prompts (n, 0) and chunks after context
LAYOUTS = {
    "95 tokens in 128": [(1, 9), (1, 17), (60, 0), (1, 3), (30, 20), (1, 40), (1, 2)],
    "203 tokens in 256": [(1, 5), (200, 33), (1, 12), (1, 7)],
    "291 tokens in 300": [(1, 21), (290, 0)],
    "128 tokens, no padding": [(1, 4)] * 8 + [(120, 0)],
    "a lone decode beside a chunk": [(1, 30), (5, 11)],
    # the engine's order with fresh prompts only: the attention cores run inside the pieces (one graph a step)
    "decodes, then fresh prompts, in 256": [(1, 9), (1, 17), (1, 3), (60, 0), (2, 0), (90, 0)],
    "fresh prompts only, in 128": [(100, 0), (27, 0)],
    "decodes, then a chunk after 150 cached tokens, in 256": [(1, 9), (1, 4), (120, 150), (20, 0)],
    # 500 keys (cached context included) past the 128 + 300 the bucket's layout holds: the pieces pause at the cores
    "decodes, then a chunk after 400 cached tokens, in 128": [(1, 5), (1, 6), (100, 400)],
}
CORES_INSIDE = {
    "128 tokens, no padding",
    "decodes, then fresh prompts, in 256",
    "fresh prompts only, in 128",
    "decodes, then a chunk after 150 cached tokens, in 256",
}


@pytest.fixture(scope="module")
def tiny():
    return load_attention_model(MODEL), load_ffn_model(MODEL)


def _cache(attn) -> PagedLatentCache:
    cache = PagedLatentCache(attn.config, num_blocks=256, block_size=BLOCK, dtype=torch.float32, device="cpu")
    rows = cache.cache.shape[1]
    cache.cache[:, BLOCK : rows - 1].normal_(0.0, 1.0, generator=torch.Generator().manual_seed(0))  # cached context
    return cache


class Recording(LocalExchange):
    """A local exchange that records the rows it was handed per boundary layer."""

    def __init__(self, ffn) -> None:
        super().__init__(ffn)
        self.calls: list[tuple[int, int]] = []

    def __call__(self, layer_idx, x, routing):
        self.calls.append((layer_idx, x.shape[0]))
        return super().__call__(layer_idx, x, routing)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fixed_shape", [False, True], ids=["exact loop", "fixed shape"])
@pytest.mark.parametrize("moe_inside", [True, False], ids=["MoE inside", "exchange eager"])
def test_mixed_steps_equal_the_eager_forward(tiny, moe_inside: bool, fixed_shape: bool) -> None:
    """Decodes beside fresh prompts and chunks after cached context, padded to every bucket (and one step with no
    padding): the real rows equal `forward_segments` run plainly (fp32). MoE inside: the exchange is never called
    (the pieces pause only at the attention cores). Exchange eager: it sees the T real rows at every boundary
    layer, in order, exactly as the plain forward hands them. Steps of decodes and prompt chunks within the layout
    (CORES_INSIDE) run their attention cores inside the pieces, from the bucket's layout buffers; the others pause
    at them."""
    attn, ffn = tiny
    ffn.fixed_shape_moe = fixed_shape  # the path the GPU captures (torch._grouped_mm's CPU fallback) or the loop
    try:
        cache = _cache(attn)
        runner = PrefillGraphRunner(attn, cache, BUDGET, capture=False, ffn_model=ffn if moe_inside else None)
        for seed, (name, layout) in enumerate(LAYOUTS.items()):
            batch, ids, pos = prepared_step(attn, cache, layout, seed)
            plain = Recording(ffn)
            with torch.inference_mode():
                want = run_segments(attn.forward_segments(ids, pos, batch, cache), plain)
                padded = Recording(ffn)
                inside_before = runner.steps_cores_inside
                segments = runner.segments(batch, ids, pos)
                got = run_segments(segments, padded)
            assert runner.steps_cores_inside - inside_before == (name in CORES_INSIDE), name
            T = ids.shape[0]
            assert got.shape == want.shape == (T, attn.config.hidden_size), name
            torch.testing.assert_close(got, want, rtol=0, atol=2e-5, msg=name)
            assert plain.calls == [(layer, T) for layer in attn.boundary_layers], name
            assert padded.calls == ([] if moe_inside else plain.calls), name
            for slot in batch.slots:
                cache.free(slot)
        assert runner.captured == [128, 256, 300]  # every bucket was used
    finally:
        ffn.fixed_shape_moe = None


def test_padding_rows_are_routed_to_no_expert(tiny, monkeypatch) -> None:
    """Inside the pieces, every routed-expert call of a step of 95 real rows in bucket 128 sees 128 rows: the real
    ones with the gate's routing, the 33 padding ones with expert id -1 (which no expert holds) and weight 0."""
    attn, ffn = tiny
    cache = _cache(attn)
    runner = PrefillGraphRunner(attn, cache, BUDGET, capture=False, ffn_model=ffn)
    batch, ids, pos = prepared_step(attn, cache, LAYOUTS["95 tokens in 128"], 0)
    with torch.inference_mode():
        runner.capture_all()  # the passes of a capture (all rows routed) before the spy
    seen: list[Routing] = []
    real_experts = ffn.experts_topk

    def spy(layer_idx, x, routing):
        seen.append(Routing(routing.topk_ids.clone(), routing.topk_weights.clone()))
        return real_experts(layer_idx, x, routing)

    monkeypatch.setattr(ffn, "experts_topk", spy)
    with torch.inference_mode():
        run_segments(runner.segments(batch, ids, pos), Recording(ffn))
    assert len(seen) == len(attn.config.moe_layers)
    for routing in seen:
        assert routing.topk_ids.shape[0] == 128
        assert (routing.topk_ids[95:] == -1).all() and (routing.topk_weights[95:] == 0).all()
        assert (routing.topk_ids[:95] >= 0).all() and (routing.topk_weights[:95] > 0).all()


def _engine_run(tiny, prompts, *, moe_inside: bool | None):
    """The engine over a recording exchange; `moe_inside` None: no prefill runner (the plain engine)."""
    attn, ffn = tiny
    exchange = RealRowsOnly(LocalExchange(ffn))
    engine = Engine(attn, exchange, BUDGET, block_size=BLOCK, max_num_seqs=8)
    if moe_inside is not None:
        runner = PrefillGraphRunner(attn, engine.kv_cache, BUDGET, capture=False, ffn_model=ffn if moe_inside else None)
        engine.prefill_graphs = [runner]
    for p in prompts:
        engine.add(Request(list(p), 5, prompt_logprobs=True))
    return engine, engine.run(), exchange.rows_seen


@pytest.mark.timeout(300)
def test_engine_with_the_moe_inside_the_pieces_equals_the_plain_engine(tiny) -> None:
    """Fresh prompts, chunked prompts and steps mixing them with decodes, every step through the padded pieces with
    the MoE inside: the same tokens as the plain engine, logprobs and prompt logprobs within the oracle's tolerance
    (fp32), and no row ever reaches the engine's exchange."""
    rng = random.Random(0)
    prompts = [[rng.randrange(250) for _ in range(n)] for n in (130, 7, 290, 1, 45, 3)]
    _, want, want_rows = _engine_run(tiny, prompts, moe_inside=None)
    engine, got, rows = _engine_run(tiny, prompts, moe_inside=True)
    assert want_rows and rows == []
    assert engine.prefill_graphs[0].captured == [128, 256, 300]
    assert_matches_reference(got, want)
    assert not engine.kv_cache.cache[:, :BLOCK].any()  # padding wrote only the scratch row, never the null block


def test_model_runner_decides_once_by_the_exchange(tiny, monkeypatch, caplog) -> None:
    """Where prefill graphs exist (CUDA; faked here with one eager runner): the in-process exchange whose experts
    take the fixed-shape path gets the MoE inside the pieces; the same exchange with the exact loop, or any exchange
    that is not a `LocalExchange` (p2p, async), keeps the exchange eager between them. One log line each."""
    attn, ffn = tiny
    monkeypatch.setattr(model_runner, "prefill_graph_copies", lambda *_: 1)
    monkeypatch.setattr(model_runner, "PrefillGraphRunner", functools.partial(PrefillGraphRunner, capture=False))
    cache = _cache(attn)

    def build(exchange) -> PrefillGraphRunner:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="afd.engine.model_runner"):
            runner = model_runner.ModelRunner(attn, exchange, cache, max_num_batched_tokens=BUDGET, max_num_seqs=8)
        lines = [r.getMessage() for r in caplog.records if "prefill CUDA graphs" in r.getMessage()]
        assert len(lines) == 1, lines
        build.line = lines[0]
        (prefill,) = runner.prefill_graphs
        return prefill

    ffn.fixed_shape_moe = True
    try:
        assert build(LocalExchange(ffn)).ffn_model is ffn and "MoE inside the pieces" in build.line
        assert build(RealRowsOnly(LocalExchange(ffn))).ffn_model is None and "exchange eager" in build.line
        ffn.fixed_shape_moe = False
        assert build(LocalExchange(ffn)).ffn_model is None and "no fixed-shape path" in build.line
    finally:
        ffn.fixed_shape_moe = None


def test_memory_estimate_adds_the_moe_temporaries() -> None:
    """With the MoE inside, each runner's estimate grows by the MoE's temporaries per token (DeepSeek-V2-Lite
    shapes, bf16: at least its gathered rows, gate/up, activation and outputs for every (token, k) pair); the
    engine's cache sizing takes the larger estimate unless told the exchange is disaggregated."""
    v2 = load_model_config("deepseek-v2-lite")
    bf16, tokens = torch.bfloat16, 2048
    extra = graph_memory_estimate(v2, bf16, tokens, moe_inside=True) - graph_memory_estimate(v2, bf16, tokens)
    assert extra == tokens * moe_graph_bytes_per_token(v2, bf16)
    K, H, inter = v2.num_experts_per_tok, v2.hidden_size, v2.moe_intermediate_size
    assert extra >= tokens * K * (2 * H + 3 * inter) * 2
    step = model_runner.step_activation_bytes
    assert (
        step(v2, bf16, tokens, 1)
        == step(v2, bf16, tokens, 1, moe_inside=True)
        > step(v2, bf16, tokens, 1, moe_inside=False)
    )
    assert step(v2, bf16, tokens, 0) == step(v2, bf16, tokens, 0, moe_inside=False)  # no runner, nothing added
