"""The GPU half of tests/unit/test_prefill_graph_moe.py: with the in-process exchange (bf16 on CUDA, where the MoE
takes the fixed-shape path) the prefill graph pieces hold each boundary layer's MoE and pause only at the attention
cores, or hold the cores too for steps of decodes and fresh prompts (one graph a step); a captured mixed step equals
the eager forward, and replaying it issues no host sync."""

from __future__ import annotations

import random
import warnings

import pytest
import torch
from helpers.e2e import MODEL
from helpers.prefill_steps import prepared_step

from afd.engine.engine import Engine, LocalExchange, Request
from afd.engine.graphs.decode import capture_safe_moe
from afd.engine.graphs.layout import PAUSED
from afd.engine.graphs.prefill import PrefillGraphRunner, token_buckets
from afd.model.attention_side import run_segments
from afd.model.kv_cache import PagedLatentCache
from afd.model.weights import load_attention_model, load_ffn_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
BUDGET = 512
TOL = 5e-2  # bf16 logprobs: padding changes the GEMMs' shapes and so their rounding


class Refusing(LocalExchange):
    """The engine's exchange when the MoE is inside the pieces: prompt steps must never call it."""

    def __init__(self, ffn) -> None:
        super().__init__(ffn)
        self.calls = 0

    def __call__(self, layer_idx, x, routing):
        self.calls += 1
        return super().__call__(layer_idx, x, routing)


@pytest.fixture(scope="module")
def models():
    ffn = load_ffn_model(MODEL, dtype="bfloat16", device="cuda")
    if not capture_safe_moe(ffn):
        pytest.skip("the routed experts have no fixed-shape path on this GPU (torch._grouped_mm needs sm90+)")
    return load_attention_model(MODEL, dtype="bfloat16", device="cuda"), ffn


def _logprobs(attn, hidden: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(attn.compute_logits(hidden), dim=-1)


@pytest.mark.timeout(600)
def test_captured_mixed_steps_equal_eager_and_replay_without_host_sync(models) -> None:
    """Every bucket captured with the MoE inside, both ways (one piece per attention core, plus one to the output;
    or the cores inside too, one graph); mixed steps (decodes beside prompt chunks, several buckets, padding rows)
    replayed from them against the plain eager forward: with the cores paused logprobs within 5e-2, with them
    inside mean |Δp| within 5e-3 and 99% of the greedy tokens equal; the exchange never called; and a replay
    issues no host synchronisation."""
    attn, ffn = models
    cache = PagedLatentCache(attn.config, num_blocks=512, block_size=16, dtype=torch.bfloat16, device="cuda")
    cache.cache[:, 16 : cache.cache.shape[1] - 1].normal_(0.0, 1.0)
    runner = PrefillGraphRunner(attn, cache, BUDGET, ffn_model=ffn)
    with torch.inference_mode():
        runner.capture_all()
    assert not runner.disabled, "a capture failed (its traceback is in the log)"
    assert runner.captured == runner.captured_cores_inside == token_buckets(BUDGET)
    for (_, cores), graph in runner._graphs.items():
        if cores != PAUSED:  # decodes and prompts from a layout: the whole step is one graph
            assert len(graph.graphs) == 1 and not graph.pauses
        else:
            assert len(graph.graphs) == attn.config.num_hidden_layers + 1
            assert all(kind == "core" for kind, _ in graph.pauses)
    layouts = [
        [(1, 40)] * 6 + [(90, 0)],  # 96 tokens in 128, cores inside
        [(1, 300)] * 16 + [(250, 100)],  # 266 in 384, cores inside (a chunk after cached context)
        [(1, 17), (511, 0)],  # 512: no padding (a lone decode is not batched: the pieces pause)
        [(1, 300)] * 16 + [(200, 0), (3, 0), (50, 0)],  # 269 in 384, cores inside, tiles of several prompts
        [(300, 0), (200, 0)],  # 500 in 512, fresh prompts only, cores inside
    ]
    inside = []  # (layout, mean |Δp|, greedy tokens equal) with the cores inside
    for seed, layout in enumerate(layouts):
        batch, ids, pos = prepared_step(attn, cache, layout, seed)
        exchange = Refusing(ffn)
        with torch.inference_mode():
            want = _logprobs(attn, run_segments(attn.forward_segments(ids, pos, batch, cache), LocalExchange(ffn)))
            got = _logprobs(attn, run_segments(runner.segments(batch, ids, pos), exchange).clone())
            runner.cores_inside = False
            paused = _logprobs(attn, run_segments(runner.segments(batch, ids, pos), exchange).clone())
            runner.cores_inside = True
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    run_segments(runner.segments(batch, ids, pos), exchange)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        syncs = [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]
        assert not syncs, f"layout {seed}: host syncs at {syncs}"
        assert exchange.calls == 0
        diff = (paused - want).abs().max().item()
        assert diff <= TOL, f"layout {seed}, cores paused: |Δ logprob| {diff:.2e}"
        # cores inside: keys expanded over the layout's rows and decodes split over the tables' full width (other
        # GEMM shapes and summation orders, so other bf16 roundings, which 27 layers of random weights over random
        # cached latents amplify): bounded in probability, the greedy tokens almost all equal (fp32: exact, in
        # tests/e2e/test_prefill_graph_gpu.py)
        inside.append(
            (
                seed,
                (got.exp() - want.exp()).abs().sum(-1).mean().item() / 2,
                (got.argmax(-1) == want.argmax(-1)).float().mean().item(),
            )
        )
        for slot in batch.slots:
            cache.free(slot)
    assert all(mean_dp <= 5e-3 and equal >= 0.99 for _, mean_dp, equal in inside), (
        f"(layout, mean |Δp|, equal): {inside}"
    )
    assert runner.steps_cores_inside == 2 * 4  # each layout run twice; all but the lone decode's fit the layout


@pytest.mark.timeout(600)
def test_engine_replays_mixed_steps_with_the_moe_inside(models) -> None:
    """The engine's ModelRunner picks the MoE inside for the in-process exchange; fresh prompts, chunked prompts
    and steps mixed with decodes through the replayed pieces give the eager engine's tokens, logprobs within 5e-2."""
    attn, ffn = models
    rng = random.Random(1)
    prompts = [[rng.randrange(250) for _ in range(n)] for n in (130, 7, 290, 1, 45, 600, 3, 260, 1000, 17)]

    def run(graphs: bool):
        engine = Engine(attn, LocalExchange(ffn), BUDGET, block_size=16, max_num_seqs=16, num_blocks=1024)
        assert engine.prefill_graphs and engine.prefill_graphs[0].ffn_model is ffn
        if not graphs:
            engine.prefill_graphs = []
        else:
            with torch.inference_mode():
                engine.prefill_graphs[0].capture_all()
            assert not engine.prefill_graphs[0].disabled
        for p in prompts:
            engine.add(Request(list(p), 6, prompt_logprobs=True))
        return engine.run()

    want, got = run(False), run(True)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.token_ids == w.token_ids, f"request {i}: tokens {g.token_ids} != {w.token_ids}"
        diff = max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs, strict=True))
        pairs = zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:], strict=True)
        prompt_diff = max((abs(a - b) for a, b in pairs), default=0.0)
        assert max(diff, prompt_diff) <= TOL, f"request {i}: |Δ logprob| {diff:.2e}, prompt {prompt_diff:.2e}"
