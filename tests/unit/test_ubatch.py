"""Micro-batch ping-pong on the attention side (`async_moe_ubatching`): the split, the driver,
the engine's split steps, out-of-order replies in the async exchange, and launched runs against the reference."""

from __future__ import annotations

from collections import deque

import pytest
import torch
from helpers.async_fakes import HIDDEN, endpoints, models, reference, routing
from helpers.e2e import MODEL, assert_matches_reference
from helpers.ubatch_runs import IN_PROCESS_PROMPTS, endpoint_args, run_in_process, tokens
from hypothesis import given
from hypothesis import strategies as st

from afd.connectors.base import Exchange
from afd.engine.engine import Engine, LocalExchange, Request
from afd.engine.generate import generate
from afd.model.attention_side import run_segments, run_ubatches, split_ubatches
from afd.model.batch import Batch
from afd.model.weights import load_attention_model, load_ffn_model, load_model_config
from afd.topology import AsyncTopology

# fp32: a micro-batch's GEMMs see fewer rows than the whole step's and may block them differently (CPU: up to
# 1.5e-6 seen); the driver itself adds nothing (bit-identical to each micro-batch run on its own)
TOL = 1e-5


@pytest.fixture(scope="module")
def tiny():
    return load_attention_model(MODEL), load_ffn_model(MODEL)


class FifoExchange(Exchange):
    """send/recv over an in-process FFN model: each answer is computed at send and returned in send order."""

    def __init__(self, local: LocalExchange, num_ubatches: int) -> None:
        self.local, self.num_ubatches = local, num_ubatches
        self.answers: deque[torch.Tensor] = deque()
        self.max_in_flight = 0

    def send(self, layer_idx: int, x: torch.Tensor, routing) -> None:
        self.answers.append(self.local(layer_idx, x, routing))
        self.max_in_flight = max(self.max_in_flight, len(self.answers))

    def recv(self) -> torch.Tensor:
        return self.answers.popleft()

    def __call__(self, layer_idx: int, x: torch.Tensor, routing) -> torch.Tensor:
        self.send(layer_idx, x, routing)
        return self.recv()


# ---------------------------------------------------------------- the split


@given(st.lists(st.integers(1, 300), max_size=40), st.integers(1, 6))
def test_split_keeps_order_balances_tokens_and_never_leaves_a_group_empty(query_lens: list[int], m: int) -> None:
    groups = split_ubatches(query_lens, m)
    assert len(groups) == min(m, len(query_lens))
    assert [i for g in groups for i in g] == list(range(len(query_lens))), "consecutive, in order, each once"
    assert all(len(g) > 0 for g in groups)
    if query_lens:
        total = sum(query_lens)
        assert max(sum(query_lens[i] for i in g) for g in groups) <= total / len(groups) + max(query_lens)


def test_split_examples() -> None:
    assert split_ubatches([1] * 8, 2) == [range(0, 4), range(4, 8)]
    assert split_ubatches([100, 1, 1, 1], 2) == [range(0, 1), range(1, 4)]
    assert split_ubatches([1, 1, 1, 100], 2) == [range(0, 3), range(3, 4)]
    assert split_ubatches([30, 10, 10, 10, 30], 3) == [range(0, 1), range(1, 4), range(4, 5)]
    assert split_ubatches([5, 7], 3) == [range(0, 1), range(1, 2)]  # never more groups than sequences
    assert split_ubatches([9], 2) == [range(0, 1)] and split_ubatches([], 2) == []


# ---------------------------------------------------------------- the driver and the engine


@pytest.mark.parametrize("m", [2, 3])
def test_ping_pong_equals_the_whole_forward(tiny, m: int) -> None:
    """The micro-batches' forwards, driven in ping-pong through a FIFO exchange, give exactly what each gives
    run on its own, and the whole step's hidden states within fp32 noise; every micro-batch is in flight
    before the first answer is taken."""
    attn, ffn = tiny
    lens = [7, 1, 12, 3, 5]
    prompts = [tokens(n, i) for i, n in enumerate(lens)]
    ids = torch.tensor([t for p in prompts for t in p])
    pos = torch.cat([torch.arange(n) for n in lens])
    with torch.inference_mode():
        whole = run_segments(
            attn.forward_segments(ids, pos, Batch(list(range(5)), lens, [0] * 5), None), LocalExchange(ffn)
        )
        exchange = FifoExchange(LocalExchange(ffn), m)
        groups = split_ubatches(lens, m)
        starts = [0, *torch.tensor(lens).cumsum(0).tolist()]

        def segments(g: range):
            rows = slice(starts[g.start], starts[g.stop])
            part = Batch(list(g), lens[g.start : g.stop], [0] * len(g))
            return attn.forward_segments(ids[rows], pos[rows], part, None)

        split = torch.cat(run_ubatches([segments(g) for g in groups], exchange))
        alone = torch.cat([run_segments(segments(g), LocalExchange(ffn)) for g in groups])
    assert torch.equal(split, alone)
    torch.testing.assert_close(split, whole, atol=TOL, rtol=TOL)
    assert exchange.max_in_flight == len(groups) == m


@pytest.mark.parametrize("m", [2, 3])
def test_engine_with_micro_batches_equals_the_engine_without(tiny, m: int) -> None:
    """Chunked prefill (a 16-token budget) mixes decodes and prompt chunks in one step; with the exchange's
    num_ubatches > 1 every step of two or more sequences runs as micro-batches, and every token, logprob and
    prompt logprob equals the un-split engine's."""
    attn, ffn = tiny
    prompts = [tokens(23, 1), [7, 3], tokens(9, 2), [11], tokens(14, 3)]
    requests = [Request(p, 4, prompt_logprobs=True) for p in prompts]
    whole = Engine(attn, LocalExchange(ffn), 16)
    exchange = FifoExchange(LocalExchange(ffn), m)
    split = Engine(attn, exchange, 16)
    for r in requests:
        whole.add(r)
        split.add(r)
    want, got = whole.run(), split.run()
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=TOL, rtol=0)
        torch.testing.assert_close(
            torch.tensor(a.prompt_logprobs[1:]), torch.tensor(b.prompt_logprobs[1:]), atol=TOL, rtol=0
        )
    assert split.ubatched_steps > 0 and exchange.max_in_flight == m
    assert whole.ubatched_steps == 0


# ---------------------------------------------------------------- the async exchange


def test_async_reply_to_a_later_micro_batch_first_waits_for_its_own_recv() -> None:
    """Two sends in flight to one FFN rank (ring_depth 2 from async_moe_num_ubatches 2); the FFN rank answers
    the second first. Before, recv took that reply for the first send and failed on its echo; now it keeps it,
    combines the first send's own answer, then hands the kept one to the second recv."""
    with endpoints(1, async_moe_ubatching=True) as (ex, (server,)):
        assert ex.num_ubatches == 2 and ex.window.geometry.ring_depth == 2
        g = torch.Generator().manual_seed(5)
        (x1, r1), (x2, r2) = [(torch.randn(n, HIDDEN, generator=g), routing(n, g)) for n in (4, 6)]
        ex.send(0, x1, r1)
        ex.send(1, x2, r2)
        model = models(1)[0]
        server.window._scan = server.window.geometry.slot_index(0, 1)  # its next poll finds stage 1 first
        assert server.step(model, max_items=1) == 1  # only the second send is answered
        real = ex.window._read_flags
        reads = []

        def read() -> list[int]:  # once the attention side has seen the early reply, the first one comes
            flags = real()
            reads.append(1)
            if len(reads) == 1:
                assert server.step(model, max_items=1) == 1
            return flags

        ex.window._read_flags = read
        torch.testing.assert_close(ex.recv(), reference(0, x1, r1.topk_ids, r1.topk_weights))
        torch.testing.assert_close(ex.recv(), reference(1, x2, r2.topk_ids, r2.topk_weights))
        assert ex._in_flight == set() and not ex._early and not ex._pending


def test_engine_over_the_async_exchange_in_process_equals_the_reference(tiny) -> None:
    """1A2F in one process over real shared memory, FFN ranks in threads: the engine splits its steps into 3
    micro-batches in ping-pong (replies of two FFN ranks to three sends in flight, in any order) and every
    output equals the reference."""
    topo = AsyncTopology(1, 2, load_model_config(MODEL).n_routed_experts)
    args = endpoint_args(async_moe_ubatching=True, async_moe_num_ubatches=3)
    outputs, engine = run_in_process(
        topo, args, tiny[0], lambda f: load_ffn_model(MODEL, expert_range=topo.expert_ranges[f])
    )
    assert engine.ubatched_steps > 0
    assert_matches_reference(outputs, generate(MODEL, IN_PROCESS_PROMPTS, max_new_tokens=4, prompt_logprobs=True))
