"""The warm-up that compiles the CUDA step's kernels (afd.engine.warm_up), run on CPU with `force`: it leaves no trace.

It must hand back every cache block, leave the null block zero, never cross to the FFN side of a disaggregated
exchange (a p2p FFN rank would take it for a step), and change nothing the engine computes afterwards.
"""

from __future__ import annotations

import torch

from afd.connectors.base import Exchange
from afd.engine.engine import Engine, LocalExchange, Request
from afd.engine.warm_up import FULL_STEP_PROMPT_LEN, budget_prompt_lens, warm_up_engine, warm_up_ffn
from afd.model.weights import load_attention_model, load_ffn_model

PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9]]


class _Remote(Exchange):
    """Stands in for a disaggregated exchange: answers as the local one, counts its calls."""

    def __init__(self, local: LocalExchange) -> None:
        self.local, self.calls = local, 0

    def __call__(self, layer_idx, x, routing):
        self.calls += 1
        return self.local(layer_idx, x, routing)


def _run(engine: Engine):
    for p in PROMPTS:
        engine.add(Request(list(p), 6))
    return engine.run()


def test_warm_up_leaves_no_trace_and_never_crosses_to_the_ffn_side() -> None:
    attn, ffn = load_attention_model("tiny"), load_ffn_model("tiny")
    want = _run(Engine(attn, LocalExchange(ffn), 64, block_size=4))
    remote = _Remote(LocalExchange(ffn))
    engine = Engine(attn, remote, 64, block_size=4)
    free_before = engine.kv_cache.pool.num_free
    warm_up_engine(engine, force=True)
    assert remote.calls == 0  # answered by zeros: nothing reached the FFN side
    assert engine.kv_cache.pool.num_free == free_before
    assert not engine.kv_cache.cache[:, : engine.kv_cache.block_size].any()  # the null block stays zero
    got = _run(engine)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert all(g.logprobs == w.logprobs for g, w in zip(got, want, strict=True))


def test_warm_up_continues_a_prompt_beside_decodes_and_alone_as_a_server_does(monkeypatch) -> None:
    """After each prompt set's prefill and decode, the first prompt takes a chunk with cached context beside the
    others' decodes, then one alone: the prefill kernel's variants of a continued prompt compile here too."""
    from afd.engine.warm_up import CONTINUE_TOKENS, PROMPT_LENS

    attn = load_attention_model("tiny")
    steps = []
    real_forward = attn.forward

    def forward(input_ids, positions, batch, kv_cache, exchange):
        steps.append((list(batch.query_lens), list(batch.context_lens), positions.tolist()))
        return real_forward(input_ids, positions, batch, kv_cache, exchange)

    monkeypatch.setattr(attn, "forward", forward)
    engine = Engine(attn, LocalExchange(load_ffn_model("tiny")), 64, block_size=4)
    free_before = engine.kv_cache.pool.num_free
    warm_up_engine(engine, force=True)
    assert engine.kv_cache.pool.num_free == free_before
    n = CONTINUE_TOKENS
    for lens in PROMPT_LENS:
        mixed = ([n] + [1] * (len(lens) - 1), [c + 1 for c in lens])
        alone = ([n], [lens[0] + 1 + n])
        at = [s[:2] for s in steps].index(mixed)
        assert steps[at + 1][:2] == alone
        assert steps[at][2][:n] == list(range(lens[0] + 1, lens[0] + 1 + n))  # positions follow the cached tokens
        assert steps[at + 1][2] == list(range(lens[0] + 1 + n, lens[0] + 1 + 2 * n))


def test_a_whole_model_warms_up_its_experts_at_every_shape_and_a_disaggregated_one_does_not(monkeypatch) -> None:
    from afd.engine import warm_up

    calls = []
    monkeypatch.setattr(warm_up, "warm_up_ffn", lambda ffn, device, **kw: calls.append((ffn, kw)))
    ffn = load_ffn_model("tiny")
    engine = Engine(load_attention_model("tiny"), LocalExchange(ffn), 96, block_size=4)
    warm_up_engine(engine, force=True)
    assert len(calls) == 1 and calls[0][0] is ffn and calls[0][1]["max_num_batched_tokens"] == 96
    warm_up_engine(Engine(load_attention_model("tiny"), _Remote(LocalExchange(ffn)), 64, block_size=4), force=True)
    assert len(calls) == 1  # the FFN ranks warm up their own experts


def test_warm_up_runs_the_shared_experts_held_here_and_the_sampling_path(monkeypatch) -> None:
    """With the shared experts on the attention side, the warm-up runs them at every shape (their GEMMs load too),
    still without crossing to the FFN side; every warm-up forward is followed by the sampling path (greedy and a
    sampled row, the pinned copy to the host)."""
    from afd.engine import warm_up

    attn = load_attention_model("tiny", shared_experts=True)
    shared_calls, sampled = [], []
    real_shared, real_sampling = attn.shared, warm_up.launch_sampling

    def shared(layer_idx, x):
        shared_calls.append(x.shape[0])
        return real_shared(layer_idx, x)

    def launch_sampling(model, hidden, sampling, positions):
        out = real_sampling(model, hidden, sampling, positions)
        sampled.append((sampling, out[0].tolist()))
        return out

    monkeypatch.setattr(attn, "shared", shared)
    monkeypatch.setattr(warm_up, "launch_sampling", launch_sampling)
    remote = _Remote(LocalExchange(load_ffn_model("tiny")))
    engine = Engine(attn, remote, 64, block_size=4)
    warm_up_engine(engine, force=True)
    assert remote.calls == 0
    assert len(set(shared_calls)) > 1  # several shapes, as the attention layers see them
    assert sampled and all(p[0] is None and not p[1].greedy for p, _ in sampled)
    vocab = attn.config.vocab_size
    assert all(len(tokens) == 2 and all(0 <= t < vocab for t in tokens) for _, tokens in sampled)


def test_ffn_warm_up_runs_every_form_and_changes_no_weight() -> None:
    ffn = load_ffn_model("tiny")
    before = {k: v.clone() for k, v in ffn.state_dict().items()}
    warm_up_ffn(ffn, torch.device("cpu"), force=True)
    assert all(torch.equal(before[k], v) for k, v in ffn.state_dict().items())


def test_the_full_step_warm_up_fills_the_budget_within_the_model_length_and_the_free_cache() -> None:
    assert budget_prompt_lens(8192, 4096, 10**6, 16) == (FULL_STEP_PROMPT_LEN,) * 8  # 8 x 1024 = the budget
    assert budget_prompt_lens(8192, 257, 10**6, 16) == (256,) * 32  # prompts fit the model length
    # each 1024-token prompt needs 65 blocks of 16 (one more token): 3 fit in 3,200 free tokens
    assert budget_prompt_lens(8192, 4096, 3200, 16) == (1024,) * 3
    assert budget_prompt_lens(64, 4096, 10**6, 4) == (64,)  # a small budget: one prompt of the whole budget
    assert budget_prompt_lens(8192, 4096, 0, 16) == ()  # nothing fits: no full step


def test_ffn_warm_up_of_a_full_step_changes_no_weight() -> None:
    ffn = load_ffn_model("tiny")
    before = {k: v.clone() for k, v in ffn.state_dict().items()}
    warm_up_ffn(ffn, torch.device("cpu"), max_num_batched_tokens=2048, force=True)
    assert all(torch.equal(before[k], v) for k, v in ffn.state_dict().items())


class _Wave:
    """Records what a warm-up step asks of a p2p attention exchange."""

    def __init__(self, gate_on_attention: bool) -> None:
        self.gate_on_attention, self.calls = gate_on_attention, []

    def step_wave(self, has_work: bool, keep_alive: bool = False) -> bool:
        self.calls.append(("wave", has_work))
        return True

    def begin_step(self, num_tokens, ubatch_tokens=None) -> None:
        self.calls.append(("begin", num_tokens))

    def __call__(self, layer_idx, x, routing):
        self.calls.append(("exchange", layer_idx, tuple(x.shape), x.any().item(), routing))
        return torch.zeros_like(x)


def test_the_p2p_warm_up_step_crosses_every_boundary_layer_with_one_zero_row() -> None:
    from afd.engine.warm_up import warm_up_wave_exchange

    for gate_on_attention in (True, False):
        model = load_attention_model("tiny", gate_on_attention=gate_on_attention)
        wave = _Wave(gate_on_attention)
        warm_up_wave_exchange(wave, model)
        assert wave.calls[:2] == [("wave", True), ("begin", 1)]  # one step of the DP wave, one token
        crossed = wave.calls[2:]
        assert [c[1] for c in crossed] == model.boundary_layers  # every boundary layer, in order
        hidden = model.config.hidden_size
        assert all(c[2] == (1, hidden) and not c[3] for c in crossed)  # one row of zeros
        for *_, routing in crossed:
            if gate_on_attention:  # expert 0 at weight 0: it adds nothing anywhere
                assert routing.topk_ids.tolist() == [[0] * model.config.num_experts_per_tok]
                assert not routing.topk_weights.any()
            else:
                assert routing is None
