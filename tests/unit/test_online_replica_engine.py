"""Requests that arrive into a running engine, in this process: stop tokens, aborts, per-step tokens, and bad requests
that end alone while the loop keeps serving."""

from __future__ import annotations

from collections import defaultdict

import pytest
from helpers.e2e import MODEL, PROMPTS

from afd.engine.engine import Engine, LocalExchange, Request
from afd.engine.generate import generate
from afd.model.weights import load_attention_model, load_ffn_model
from afd.runtime.online import serve_replica


@pytest.fixture(scope="module")
def models():
    return load_attention_model(MODEL), load_ffn_model(MODEL)


def make_engine(models, **kwargs) -> Engine:
    attn, ffn = models
    return Engine(attn, LocalExchange(ffn), 16, num_blocks=64, **kwargs)


# ---------------------------------------------------------------- the engine, no processes
@pytest.mark.timeout(60)
def test_stop_token_ends_the_request_after_emitting_it(models):
    (ref,) = generate(MODEL, [PROMPTS[0]], max_new_tokens=8)
    stop = ref.token_ids[3]
    cut = ref.token_ids.index(stop) + 1
    engine = make_engine(models)
    engine.add(Request(PROMPTS[0], 8, stop_token_ids=[stop]))
    engine.add(Request(PROMPTS[0], 8))
    stopped, full = engine.run()
    assert (stopped.token_ids, stopped.finish_reason) == (ref.token_ids[:cut], "stop")
    assert (full.token_ids, full.finish_reason) == (ref.token_ids, "length")


@pytest.mark.timeout(60)
def test_abort_frees_the_cache_and_spares_the_others(models):
    ref = generate(MODEL, PROMPTS[:2], max_new_tokens=6)
    engine = make_engine(models, max_num_seqs=2)
    ids = [engine.add(Request(p, 6)) for p in [*PROMPTS[:2], PROMPTS[2]]]  # the third waits for a sequence slot
    engine.step()
    engine.step()
    assert engine.load().running == 2 and engine.load().waiting == 1 and engine.load().cache_usage > 0
    waiting = engine.abort(ids[2])
    assert waiting.finish_reason == "abort" and waiting.token_ids == []
    running = engine.abort(ids[1])
    assert running.finish_reason == "abort" and 0 < len(running.token_ids) < 6
    assert running.token_ids == ref[1].token_ids[: len(running.token_ids)]
    assert engine.abort(ids[1]) is None and engine.abort(12345) is None  # finished or unknown: a no-op
    (survivor,) = engine.run()
    assert survivor.token_ids == ref[0].token_ids and survivor.finish_reason == "length"
    assert engine.load() == type(engine.load())(0, 0, 0.0)
    assert engine.kv_cache.pool.num_free == engine.kv_cache.num_blocks and engine.cache_tokens_used == 0


@pytest.mark.timeout(60)
def test_last_step_tokens_stream_every_output(models):
    engine = make_engine(models)
    for p in PROMPTS:
        engine.add(Request(p, 5))
    streamed, outputs = defaultdict(list), []
    while engine.has_work():
        outputs += engine.step()
        for t in engine.last_step_tokens:
            streamed[t.request_id].append((t.token_id, t.logprob))
    assert len(outputs) == len(PROMPTS)
    for out in outputs:
        assert streamed[out.request_id] == list(zip(out.token_ids, out.logprobs, strict=True))
    engine.step()  # an idle step appends nothing
    assert engine.last_step_tokens == []


@pytest.mark.timeout(60)
def test_bad_requests_end_alone_and_the_loop_keeps_serving(models):
    """The online loop in process, over a scripted link: refusals are `finished` with reason "error" and one
    sentence; a good request after them is served; shutdown aborts what runs and says bye."""
    script = [
        [
            {"type": "add", "rid": "vocab", "prompt_ids": [1, 10**6], "max_tokens": 2},
            {"type": "add", "rid": "shape", "prompt_ids": "1 2 3", "max_tokens": 2},
            {"type": "add", "rid": "sampling", "prompt_ids": [1], "max_tokens": 2, "sampling": {"temperature": -1}},
            {"type": "add", "rid": "fields", "prompt_ids": [1], "max_tokens": 2, "sampling": {"beam": 4}},
            {"type": "add", "rid": "huge", "prompt_ids": [1], "max_tokens": 100_000},
            {"type": "add", "rid": "good", "prompt_ids": PROMPTS[1], "max_tokens": 4},
            {"type": "add", "rid": "endless", "prompt_ids": PROMPTS[2], "max_tokens": 500},
            {"type": "abort", "rid": "never-seen"},
            {"type": "what"},
        ],
        *[[]] * 6,
        [{"type": "add", "rid": "endless", "prompt_ids": [1], "max_tokens": 1}, {"type": "shutdown"}],
    ]
    link = ScriptedLink(script)
    serve_replica(make_engine(models), link)
    ends = [(m["rid"], m["reason"]) for m in link.sent if m["type"] == "finished"]
    assert ends[-2:] == [("endless", "error"), ("endless", "abort")]  # a second "endless" is refused; shutdown aborts
    finished = {m["rid"]: m for m in link.sent if m["type"] == "finished" and m["rid"] != "endless"}
    errors = {rid: m["message"] for rid, m in finished.items() if m["reason"] == "error"}
    assert "vocabulary" in errors["vocab"] and "prompt_ids" in errors["shape"]
    assert "temperature" in errors["sampling"] and "sampling" in errors["fields"]
    assert "KV-cache blocks" in errors["huge"]
    assert finished["good"]["reason"] == "length"
    (ref,) = generate(MODEL, [PROMPTS[1]], max_new_tokens=4)
    assert [t for m in link.sent if m["type"] == "tokens" for rid, t, _ in m["items"] if rid == "good"] == ref.token_ids
    assert link.sent[-1] == {"type": "bye"} and link.sent[-2]["type"] == "load"
    assert link.sent[-2]["running"] == 0 and link.sent[-2]["cache_usage"] == 0.0


class ScriptedLink:
    """A `ReplicaLink` stand-in: each poll hands out the next batch of the script; everything sent is kept."""

    def __init__(self, script: list[list[dict]]) -> None:
        self.script, self.sent = list(script), []

    def poll(self, timeout_s: float = 0.0, linger_ms: int = 0, device_busy=None) -> list[dict]:
        return self.script.pop(0) if self.script else []

    def send(self, message: dict) -> None:
        self.sent.append(message)
