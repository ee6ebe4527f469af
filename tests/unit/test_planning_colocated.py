"""`afd.planning.colocated`: the co-located parts taken from measured whole steps, and what the simulator does
with them (pure: no processes)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from afd.model.weights import load_model_config
from afd.planning import colocated, costs
from afd.planning.deployment import Deployment, StepCosts
from afd.planning.profile import Part, Profile, load_profile


@pytest.fixture
def lite() -> tuple[Profile, costs.Shapes]:
    profile = load_profile("h200")
    profile = replace(profile, parts={k: v for k, v in profile.parts.items() if k not in colocated.PARTS})
    return profile, costs.shapes_of(load_model_config("deepseek-v2-lite"), "bfloat16")


def test_the_parts_are_what_a_measured_step_leaves_per_layer_beyond_its_parts(lite) -> None:
    """A step measured at its parts plus 0.4 ms a layer (decode) and 0.8 ms (prompt) gives back 0.4 and 0.8 ms;
    the simulator, given them, prices those steps at what was measured; a step faster than its parts gives 0."""
    profile, s = lite
    steps = StepCosts(Deployment("async", colocated=True), s, profile)
    layers = s.moe_layers
    decode_s = steps.colocated_compute_s(colocated.decode_load()) + layers * 0.4e-3
    prompt_s = steps.colocated_compute_s(colocated.prompt_load()) + layers * 0.8e-3
    parts = colocated.colocated_parts(profile, s, decode_s, prompt_s)
    assert parts["colocated_decode"].fixed_s == pytest.approx(0.4e-3)
    assert parts["colocated_prompt"].fixed_s == pytest.approx(0.8e-3)
    with_parts = StepCosts(Deployment("async", colocated=True), s, replace(profile, parts={**profile.parts, **parts}))
    assert with_parts.replica_step(colocated.decode_load()) == pytest.approx(decode_s)
    floor = profile.calibration.prompt_step_s  # a step holding prompt tokens lasts at least this
    assert with_parts.replica_step(colocated.prompt_load()) == pytest.approx(max(prompt_s, floor))
    assert colocated.colocated_parts(profile, s, 1e-6, 1e-6)["colocated_decode"].fixed_s == 0.0


def test_only_colocated_steps_take_them(lite) -> None:
    """Ranks on GPUs of their own keep the exchange's round trip; co-located ones without the parts too; with
    them, a decode step and a prompt step each take their own."""
    profile, s = lite
    parts = {"colocated_decode": Part(fixed_s=1e-3), "colocated_prompt": Part(fixed_s=5e-3)}
    measured = replace(profile, parts={**profile.parts, **parts})
    load = colocated.decode_load()
    apart = Deployment("async")
    assert StepCosts(apart, s, measured).replica_step(load) == StepCosts(apart, s, profile).replica_step(load)
    together = Deployment("async", colocated=True)
    base = StepCosts(together, s, profile).colocated_compute_s(load)
    assert StepCosts(together, s, measured).replica_step(load) == pytest.approx(base + s.moe_layers * 1e-3)
    prompt = colocated.prompt_load()
    base = StepCosts(together, s, profile).colocated_compute_s(prompt)
    assert StepCosts(together, s, measured).replica_step(prompt) == pytest.approx(
        max(base + s.moe_layers * 5e-3, profile.calibration.prompt_step_s)
    )
