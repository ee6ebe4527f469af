"""`ModelRunner` on its own (tiny model, CPU): a hand-built step's sampled token and logprob equal the model's own
forward, an idle step shows the exchange every boundary layer with no rows, and a step split into micro-batches
gives the whole step's tokens."""

from __future__ import annotations

from collections import deque

import pytest
import torch

from afd.connectors.base import Exchange
from afd.engine.model_runner import LocalExchange, ModelRunner
from afd.engine.request import Request
from afd.engine.sequence import Scheduled, SequenceState
from afd.model.batch import Batch
from afd.model.kv_cache import PagedLatentCache
from afd.model.weights import load_attention_model, load_ffn_model
from afd.routing import Routing

BLOCK = 4
PROMPTS = [[3, 1, 4, 1, 5, 9, 2], [6, 5, 3], [5, 8, 9, 7, 9, 3]]


@pytest.fixture(scope="module")
def tiny():
    return load_attention_model("tiny"), load_ffn_model("tiny")


def new_cache(attn) -> PagedLatentCache:
    return PagedLatentCache(
        attn.config, num_blocks=32, block_size=BLOCK, max_num_seqs=4, dtype=torch.float32, device="cpu"
    )


class Recording(Exchange):
    """The local exchange, recording `begin_step` and every call; `num_ubatches` > 1 answers send/recv in order."""

    def __init__(self, local: LocalExchange, num_ubatches: int = 1) -> None:
        self.local, self.num_ubatches = local, num_ubatches
        self.steps: list[tuple[int, list[int] | None]] = []
        self.calls: list[tuple[int, tuple[int, ...], bool]] = []
        self.answers: deque[torch.Tensor] = deque()

    def begin_step(self, num_tokens, ubatch_tokens=None) -> None:
        self.steps.append((num_tokens, None if ubatch_tokens is None else list(ubatch_tokens)))

    def __call__(self, layer_idx: int, x: torch.Tensor, routing: Routing | None) -> torch.Tensor:
        self.calls.append((layer_idx, tuple(x.shape), routing is not None))
        return self.local(layer_idx, x, routing)

    def send(self, layer_idx: int, x: torch.Tensor, routing: Routing | None) -> None:
        self.answers.append(self(layer_idx, x, routing))

    def recv(self) -> torch.Tensor:
        return self.answers.popleft()


def prefill(runner: ModelRunner, prompts: list[list[int]]) -> list[Scheduled]:
    """Every prompt as one whole chunk, each sequence given its cache slot first."""
    steps = []
    for i, p in enumerate(prompts):
        seq = SequenceState(i, Request(list(p), 4, prompt_logprobs=True))
        seq.slot = runner.kv_cache.allocate(seq.capacity)
        steps.append(Scheduled(seq, list(p), 0))
    return steps


def reference(tiny, prompts: list[list[int]]) -> list[tuple[int, float, list[float | None]]]:
    """Each prompt alone through `AttentionModel.forward`: its greedy next token, that token's logprob, and its
    prompt logprobs."""
    attn, ffn = tiny
    out = []
    for p in prompts:
        cache = new_cache(attn)
        batch = Batch(slots=[cache.allocate(len(p) + 3)], query_lens=[len(p)], context_lens=[0])
        ids = torch.tensor(p)
        with torch.inference_mode():
            hidden = attn(ids, torch.arange(len(p)), batch, cache, LocalExchange(ffn))  # [T, H]
            logprobs = torch.log_softmax(attn.compute_logits(hidden), dim=-1)  # [T, V]
        token = int(logprobs[-1].argmax())
        scored = logprobs[:-1].gather(1, ids[1:, None]).squeeze(1).tolist()
        out.append((token, float(logprobs[-1, token]), [None, *scored]))
    return out


def test_a_prefill_step_samples_what_the_model_computes(tiny) -> None:
    attn, ffn = tiny
    exchange = Recording(LocalExchange(ffn))
    runner = ModelRunner(attn, exchange, new_cache(attn), max_num_batched_tokens=64, max_num_seqs=4)
    assert runner.cuda_graphs is None and runner.prefill_graphs == []  # CPU: eager
    steps = prefill(runner, PROMPTS)
    with torch.inference_mode():
        launched = runner.launch(steps)
    tokens, logprobs = runner.read_tokens(launched)
    want = reference(tiny, PROMPTS)
    assert [int(t) for t in tokens] == [w[0] for w in want]
    assert logprobs == pytest.approx([w[1] for w in want], abs=1e-5)
    for s, w in zip(steps, want, strict=True):
        assert s.seq.prompt_logprobs[0] is None
        assert s.seq.prompt_logprobs[1:] == pytest.approx(w[2][1:], abs=1e-5)
    T = sum(map(len, PROMPTS))
    assert exchange.steps == [(T, None)] and runner.ubatched_steps == 0 and not runner.last_launch_decode
    assert [c[0] for c in exchange.calls] == attn.boundary_layers
    assert all(c[1] == (T, attn.config.hidden_size) for c in exchange.calls)


def test_an_idle_step_crosses_every_boundary_layer_with_no_rows(tiny) -> None:
    attn, ffn = tiny
    exchange = Recording(LocalExchange(ffn))
    runner = ModelRunner(attn, exchange, new_cache(attn), max_num_batched_tokens=16, max_num_seqs=4)
    runner.idle_step()
    assert exchange.steps == [(0, None)]
    assert exchange.calls == [(i, (0, attn.config.hidden_size), attn.gate_on_attention) for i in attn.boundary_layers]


def test_micro_batches_give_the_whole_steps_tokens(tiny) -> None:
    attn, ffn = tiny
    results = []
    for m in (1, 2):
        exchange = Recording(LocalExchange(ffn), num_ubatches=m)
        runner = ModelRunner(attn, exchange, new_cache(attn), max_num_batched_tokens=64, max_num_seqs=4)
        assert runner.num_ubatches == m
        with torch.inference_mode():
            launched = runner.launch(prefill(runner, PROMPTS))
        results.append(runner.read_tokens(launched))
        assert runner.ubatched_steps == (m - 1)
        if m == 2:  # consecutive sequences, balanced tokens: [7] | [3, 6]
            assert exchange.steps == [(16, [7, 9])]
    (tokens1, logprobs1), (tokens2, logprobs2) = results
    assert tokens2 == tokens1
    assert logprobs2 == pytest.approx(logprobs1, abs=1e-4)
