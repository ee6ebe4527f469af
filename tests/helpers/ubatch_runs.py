"""Micro-batched runs shared by the ubatch, prefill-graph and shared-expert tests: random prompts, the in-process async
endpoints and their run, and a launch over prompts of mixed lengths."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from afd.connectors.asynchronous.attention import AsyncAttentionExchange
from afd.connectors.asynchronous.ffn import AsyncFFNServer, run_ffn_loop
from afd.engine.engine import Engine, Request
from afd.engine.generate import generate
from afd.model.weights import load_model_config
from afd.topology import AsyncTopology
from afd.transport.shm import cleanup_segments
from helpers.e2e import MODEL, assert_matches_reference, launch_checked


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 256) for _ in range(n)]  # the tiny preset's vocabulary


IN_PROCESS_PROMPTS = [tokens(23, 1), [7, 3], tokens(9, 2), [11]]


def endpoint_args(**extra_config: object) -> dict:
    """The tiny model's async endpoint arguments on CPU (a 32-token budget), with `extra_config` keys added."""
    config = load_model_config(MODEL)
    return dict(
        hidden_size=config.hidden_size,
        topk=config.num_experts_per_tok,
        num_layers=config.num_hidden_layers,
        dtype=torch.float32,
        device="cpu",
        max_num_batched_tokens=32,
        extra_config={"recv_poll_timeout_ms": 50, **extra_config},
        timeout_s=30.0,
    )


def run_in_process(
    topo: AsyncTopology, args: dict, attention_model, ffn_model_of, *, prepare_engine=None, **exchange_kwargs
):
    """The engine over an `AsyncAttentionExchange` in this process, its FFN ranks in threads over real shared memory
    (`ffn_model_of(f)`: FFN rank f's model; `prepare_engine(engine)`: called before the prompts are added): (the
    outputs of IN_PROCESS_PROMPTS with prompt logprobs, the engine)."""
    store = dist.HashStore()
    errors: list[BaseException] = []

    def ffn_rank(f: int) -> None:
        try:
            server = AsyncFFNServer(store, topo, f, **args)
            run_ffn_loop(server, ffn_model_of(f))
        except BaseException as exc:  # reported by the test, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=ffn_rank, args=(f,), daemon=True) for f in range(topo.num_ffn)]
    for t in threads:
        t.start()
    ex = AsyncAttentionExchange(store, topo, 0, **exchange_kwargs, **args)
    try:
        engine = Engine(attention_model, ex, 32)
        if prepare_engine is not None:
            prepare_engine(engine)
        for p in IN_PROCESS_PROMPTS:
            engine.add(Request(p, 4, prompt_logprobs=True))
        outputs = engine.run()
    finally:
        ex.close()
        for t in threads:
            t.join(30)
        cleanup_segments(ex.window.heap.run_token)
    assert not errors and not any(t.is_alive() for t in threads)
    return outputs, engine


def launch_mixed_lengths(connector: str, num_attn: int, num_ffn: int, run_dir: Path, **extra_config: object) -> None:
    """`afd launch` of three prompts of different lengths per replica with a 16-token budget (steps that mix decodes
    and prompt chunks), checked against the reference."""
    lens = [23, 2, 9, 1, 14, 5, 30, 3, 7]
    prompts = [tokens(lens[i % len(lens)], i) for i in range(3 * num_attn)]
    outputs, _ = launch_checked(
        connector,
        num_attn,
        num_ffn,
        prompts,
        max_new_tokens=4,
        max_num_batched_tokens=16,
        run_dir=run_dir,
        **extra_config,
    )
    assert_matches_reference(outputs, generate(MODEL, prompts, max_new_tokens=4, prompt_logprobs=True))
