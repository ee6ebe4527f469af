"""Prefill CUDA graphs (afd.engine.graphs.prefill): the token buckets (pure), and steps with prompt tokens run as the
runner lays them out — padded to a bucket, row-wise pieces apart from the attention core and the exchange —
equal to the unpadded engine's (CPU, fp32: the same pieces run eagerly, `capture=False`), with the exchange
seeing only real rows, with and without micro-batches; on the device, replayed graphs against eager steps."""

from __future__ import annotations

import random

import pytest
import torch
from helpers.e2e import MODEL, assert_matches_reference
from helpers.graph_fakes import RealRowsOnly
from helpers.ubatch_runs import IN_PROCESS_PROMPTS, endpoint_args, run_in_process

from afd.engine.engine import Engine, LocalExchange, Request
from afd.engine.generate import generate
from afd.engine.graphs.prefill import PrefillGraphRunner, token_buckets
from afd.model.weights import load_attention_model, load_ffn_model, load_model_config
from afd.runtime.online import step_summary
from afd.topology import AsyncTopology

BLOCK = 4


def test_token_buckets_grow_by_at_most_a_quarter_above_eight_steps() -> None:
    buckets = token_buckets(8192)
    assert buckets[:9] == [128 * k for k in range(1, 10)][:8] + [1280]
    assert buckets[-1] == 8192 and buckets == sorted(set(buckets))
    for small, large in zip(buckets[8:], buckets[9:], strict=False):
        assert large <= 1.25 * small  # padding above 1,024 tokens: at most a quarter more rows
    assert token_buckets(100) == [100]  # a budget below the smallest bucket is its own bucket
    assert token_buckets(300) == [128, 256, 300]  # the budget itself always has one
    with pytest.raises(ValueError, match="at least 1"):
        token_buckets(0)


def test_bucket_is_the_smallest_that_holds_the_step() -> None:
    runner = PrefillGraphRunner.__new__(PrefillGraphRunner)
    runner.buckets, runner.disabled = token_buckets(300), False
    assert [runner.bucket(n) for n in (1, 128, 129, 257, 300)] == [128, 128, 256, 300, 300]
    assert runner.handles(300) and not runner.handles(301) and not runner.handles(0)
    with pytest.raises(ValueError, match="no prefill graph bucket"):
        runner.bucket(301)


@pytest.fixture(scope="module")
def tiny():
    return load_attention_model(MODEL), load_ffn_model(MODEL)


def _run(tiny, prompts, budget: int, *, padded: bool):
    attn, ffn = tiny
    exchange = RealRowsOnly(LocalExchange(ffn))
    engine = Engine(attn, exchange, budget, block_size=BLOCK, max_num_seqs=8)
    assert engine.prefill_graphs == []  # CPU never captures
    if padded:
        engine.prefill_graphs = [PrefillGraphRunner(attn, engine.kv_cache, budget, capture=False)]
    for p in prompts:
        engine.add(Request(list(p), 5, prompt_logprobs=True))
    return engine, engine.run(), exchange.rows_seen


@pytest.mark.timeout(300)
def test_padded_prefill_steps_equal_unpadded_ones_and_send_only_real_rows(tiny) -> None:
    """A 300-token budget (buckets 128, 256, 300): fresh prompts, prompts chunked over several steps (chunks after
    cached context), and steps that mix them with decodes, padded to their buckets: the same tokens as the plain
    engine, logprobs and prompt logprobs within the oracle's tolerance (fp32), and the exchange is handed exactly
    the rows the plain engine hands it, never a padded count."""
    rng = random.Random(0)
    prompts = [[rng.randrange(250) for _ in range(n)] for n in (130, 7, 290, 1, 45, 600, 3, 260)]
    _, want, want_rows = _run(tiny, prompts, 300, padded=False)
    engine, got, rows = _run(tiny, prompts, 300, padded=True)
    assert engine.prefill_graphs[0].captured == [128, 256, 300]  # every bucket was used
    runner = engine.prefill_graphs[0]
    assert runner.steps_cores_inside >= 3  # decodes beside fresh prompts and chunks after context
    # no warm-up here: every graph was captured on a miss, inside a step, and the engine counts them
    assert engine.graphs_captured_while_serving == runner.captured_while_serving == len(runner._graphs) >= 4
    # the replica's last log line says how the prompt steps ran their cores
    summary = step_summary(engine).split("their attention cores: ")[1]
    assert summary == ", ".join(f"{kind} {n}" for kind, n in runner.steps_by_cores.most_common())
    assert "own keys" in summary and "gathered keys" in summary
    assert rows == want_rows
    assert_matches_reference(got, want)
    assert not engine.kv_cache.cache[:, :BLOCK].any()  # padding wrote only the scratch row, never the null block


@pytest.mark.timeout(120)
def test_micro_batches_each_replay_their_own_runner(tiny) -> None:
    """1A2F in one process over real shared memory with 2 micro-batches in ping-pong, each micro-batch on its own
    padded runner (their buffers are in flight at once): every output equals the reference."""
    topo = AsyncTopology(1, 2, load_model_config(MODEL).n_routed_experts)
    args = endpoint_args(async_moe_ubatching=True, async_moe_num_ubatches=2)

    def padded(engine: Engine) -> None:
        engine.prefill_graphs = [PrefillGraphRunner(tiny[0], engine.kv_cache, 32, capture=False) for _ in range(2)]

    outputs, engine = run_in_process(
        topo, args, tiny[0], lambda f: load_ffn_model(MODEL, expert_range=topo.expert_ranges[f]), prepare_engine=padded
    )
    assert engine.ubatched_steps > 0
    assert all(runner.captured == [32] for runner in engine.prefill_graphs)
    assert_matches_reference(outputs, generate(MODEL, IN_PROCESS_PROMPTS, max_new_tokens=4, prompt_logprobs=True))


def test_memory_estimate_covers_the_static_buffers_and_grows_with_the_budget(tiny) -> None:
    """`graph_memory_estimate` (left free by the cache sizing) is above what one runner's per-token static buffers
    take for the same budget (measured on a CPU runner after one padded pass each way: the pieces' buffers and the
    layouts' prompt metadata), and linear in the budget."""
    from afd.engine.graphs.prefill import graph_memory_estimate
    from afd.model.kv_cache import PagedLatentCache

    attn = tiny[0]
    cache = PagedLatentCache(attn.config, num_blocks=64, block_size=BLOCK, dtype=torch.float32, device="cpu")
    runner = PrefillGraphRunner(attn, cache, 256, capture=False)
    with torch.inference_mode():
        runner.capture_all()
    assert runner.captured_cores_inside == runner.captured == [128, 256]
    assert runner.captured_while_serving == 0  # the warm-up's captures do not count
    tensors = [t for t in vars(runner._buffers).values() if isinstance(t, torch.Tensor)]
    static = sum(t.numel() * t.element_size() for t in [*tensors, *runner._layout._meta.values()])
    estimate = graph_memory_estimate(attn.config, torch.float32, 256)
    assert static < estimate < 20 * static
    assert graph_memory_estimate(attn.config, torch.float32, 512) == 2 * estimate
