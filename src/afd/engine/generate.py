"""The single-process reference run: load both halves of a model into one process and run a fixed list of
prompts through the engine with the in-process exchange (`afd generate`, the numerics oracle of every connector)."""

from __future__ import annotations

from pathlib import Path

import torch

from afd.engine.engine import Engine, LocalExchange
from afd.engine.request import Output, Request
from afd.engine.sampling import SamplingParams
from afd.model.kv_cache import CacheOptions


def generate(
    model: str | Path,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    seed: int = 0,
    prompt_logprobs: bool = False,
    gate_on_attention: bool = True,
    max_num_batched_tokens: int | None = None,
    cache: CacheOptions | None = None,
    sampling: SamplingParams | None = None,
    enforce_eager: bool = False,
    quantization: str | None = None,
) -> list[Output]:
    """The single-process reference: load both sides (`quantization` "fp8": FP8 linears, `afd.model.fp8`), run all
    prompts (each sampled by `sampling`, greedy when None), outputs in prompt order."""
    from afd.model.weights import load_attention_model, load_ffn_model, load_model_config

    config = load_model_config(model)
    if not prompts:
        raise ValueError("no prompts were given; pass at least one prompt")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    for p in prompts:
        if not p:
            raise ValueError("a prompt is empty; every prompt needs at least one token id")
        bad = [t for t in p if not 0 <= t < config.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {config.vocab_size})")
    load = dict(dtype=dtype, device=device, gate_on_attention=gate_on_attention, seed=seed, quantization=quantization)
    attn, ffn = load_attention_model(model, **load), load_ffn_model(model, **load)
    engine = Engine(
        attn,
        LocalExchange(ffn),
        max_num_batched_tokens or 8192,
        enforce_eager=enforce_eager,
        **(cache or CacheOptions()).engine_kwargs(),
    )
    for p in prompts:
        engine.add(Request(list(p), max_new_tokens, prompt_logprobs, sampling))
    return engine.run()
