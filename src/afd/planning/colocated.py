"""What an attention rank and an FFN rank cost each other when they share one GPU, measured inside real steps.

Co-located, the two processes take turns on the device: every MoE layer the attention rank's work stops while the
FFN rank's runs, and the switch between them costs more than the bytes. A round trip with a no-op FFN (`afd bench
exchange`) prices that wrongly both ways: on one H200 it took 0.62 ms a layer, while served decode steps, whose
waits are captured in their graphs, paid ~0.45 ms, and steps holding prompt tokens, which wait on the host at each
layer, more. So the profile takes both from whole steps of `afd`'s own async 1A1F engine:

- `colocated_decode`: a run whose steps after the first are all decodes of `DECODE_BATCH` rows; the median step;
- `colocated_prompt`: a run of lone prompts of `PROMPT_TOKENS` tokens, one token out each, so every step is one
  prompt; the mean step;

each less what the profile's own parts price the same step at (attention, every layer's experts, the host), per
MoE layer (`fixed_s`). The simulator adds them per layer to co-located steps in place of the exchange fit.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable
from dataclasses import replace

from afd.planning import costs
from afd.planning.deployment import Deployment, StepCosts, StepLoad
from afd.planning.profile import Part, Profile

logger = logging.getLogger(__name__)

DECODE_BATCH = 64  # decode rows of the decode run (its prompts are DECODE_PROMPT tokens, DECODE_TOKENS out)
DECODE_PROMPT = 16
DECODE_TOKENS = 64
PROMPT_TOKENS = 512  # each prompt of the prompt run, alone in its step (the token budget)
PROMPT_REQUESTS = 16
PARTS = ("colocated_decode", "colocated_prompt")


def decode_load() -> StepLoad:
    """The decode run's median step: every sequence halfway through its tokens."""
    ctx = DECODE_BATCH * (DECODE_PROMPT + DECODE_TOKENS / 2)
    return StepLoad(DECODE_BATCH, ctx, 0, 0.0, DECODE_BATCH, emitted=DECODE_BATCH)


def prompt_load() -> StepLoad:
    """One step of the prompt run: one prompt from an empty cache, its one token out."""
    pairs = costs.chunk_pairs(0, PROMPT_TOKENS)
    return StepLoad(0, 0.0, PROMPT_TOKENS, pairs, 1, emitted=1, admitted=1)


def colocated_parts(profile: Profile, s: costs.Shapes, decode_step_s: float, prompt_step_s: float) -> dict[str, Part]:
    """The two parts from the runs' measured steps: each step less its parts on `profile` (the turns left out), per
    MoE layer, never below zero."""
    bare = replace(profile, parts={k: v for k, v in profile.parts.items() if k not in PARTS})
    steps = StepCosts(Deployment("async", colocated=True), s, bare)
    layers = max(s.moe_layers, 1)
    return {
        "colocated_decode": Part(fixed_s=max(decode_step_s - steps.colocated_compute_s(decode_load()), 0.0) / layers),
        "colocated_prompt": Part(fixed_s=max(prompt_step_s - steps.colocated_compute_s(prompt_load()), 0.0) / layers),
    }


def measure_colocated(
    profile: Profile, model: str, dtype: str, device: str, say: Callable[[str], None] = logger.info
) -> Profile:
    """`profile` with the two co-located parts measured on this machine (both ranks on its first GPU, or the CPU),
    the runs' steps kept in `measured["colocated"]`."""
    from afd.bench.harness import run_connector
    from afd.bench.offline import run_config
    from afd.bench.workload import Workload
    from afd.config import default_shared_experts
    from afd.model.weights import load_model_config
    from afd.runtime.spec import RunSpec

    config = load_model_config(model)
    extra = run_config("async", 1, default_shared_experts("async"))

    def run(requests: int, prompt_len: int, tokens_out: int) -> dict:
        workload = Workload("uniform", requests, prompt_len, prompt_len, max_tokens=tokens_out)
        spec = RunSpec(
            model=model, dtype=dtype, device=device, max_new_tokens=tokens_out,
            max_num_batched_tokens=PROMPT_TOKENS, timeout_s=600,
        )  # fmt: skip
        result = run_connector("async", 1, 1, spec, workload.prompts(config.vocab_size), extra_config=extra)
        return result.replicas[0]

    say(f"co-located async 1A1F: {DECODE_BATCH} sequences decoding together ...")
    decode = run(DECODE_BATCH, DECODE_PROMPT, DECODE_TOKENS)
    say(f"co-located async 1A1F: {PROMPT_REQUESTS} prompts of {PROMPT_TOKENS} tokens, one step each ...")
    prompt = run(PROMPT_REQUESTS, PROMPT_TOKENS, 1)
    if not decode["decode_steps_ms"] or not prompt["num_steps"]:
        raise RuntimeError("the co-located runs timed no decode or prompt steps")
    decode_step_s = statistics.median(decode["decode_steps_ms"]) * 1e-3
    prompt_step_s = prompt["elapsed_s"] / prompt["num_steps"]
    parts = colocated_parts(profile, costs.shapes_of(config, dtype), decode_step_s, prompt_step_s)
    say(
        f"co-located: decode step {decode_step_s * 1e3:.2f} ms at {DECODE_BATCH} rows, prompt step "
        f"{prompt_step_s * 1e3:.2f} ms at {PROMPT_TOKENS} tokens: "
        + ", ".join(f"{k} {v.fixed_s * 1e3:.3f} ms a layer" for k, v in parts.items())
    )
    measured = {
        **profile.measured,
        "colocated": {
            "decode": {"batch": DECODE_BATCH, "prompt": DECODE_PROMPT, "tokens": DECODE_TOKENS,
                       "step_s": decode_step_s, "steps_ms": decode["decode_steps_ms"]},
            "prompt": {"tokens": PROMPT_TOKENS, "requests": PROMPT_REQUESTS, "step_s": prompt_step_s,
                       "num_steps": prompt["num_steps"], "elapsed_s": prompt["elapsed_s"]},
        },
    }  # fmt: skip
    return replace(profile, parts={**profile.parts, **parts}, measured=measured)
