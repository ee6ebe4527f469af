"""What the planning tests share: tiny's shapes and a small CPU profile with fixed parts."""

from __future__ import annotations

from afd.model.weights import load_model_config
from afd.planning import costs
from afd.planning.profile import Calibration, Part, Profile


def tiny_shapes() -> costs.Shapes:
    return costs.shapes_of(load_model_config("tiny"), "float32")


def cpu_profile(cal: Calibration | None = None, front_end_s: float = 0.0) -> Profile:
    """A CPU profile of tiny whose step parts are fixed numbers, with `cal`'s serving costs."""
    parts = {
        "attention_decode": Part(fixed_s=1e-3, per_item_s=2e-5),
        "prefill": Part(per_item_s=1e-5),
        "routed_experts": Part(fixed_s=5e-5),
        "shared_experts": Part(fixed_s=1e-5),
    }
    return Profile({"device": "cpu (x86_64)", "model": "tiny"}, parts, "test", "float32", 16e9,
                   front_end_s=front_end_s, calibration=cal or Calibration())  # fmt: skip


def fit_synthetic_trace(trace, truth: Calibration) -> tuple[list[dict], Calibration, dict]:
    """A served trace "measured" by simulating tiny (`none`) with the serving costs `truth`, the calibration fitted
    to it from the kernels-only profile, and the fitted profile's simulation of the trace at rate inf:
    (measured runs, calibration, that run)."""
    import math
    from dataclasses import replace

    from afd.planning import calibrate
    from afd.planning.deployment import Deployment
    from afd.planning.simulator import simulate_rate

    s, d = tiny_shapes(), Deployment("none")
    lens = [len(x) for x in trace.workload.prompts(100)]
    measured = [simulate_rate(d, s, cpu_profile(truth), trace.workload, lens, r) for r in trace.rates]
    cal = calibrate.fit_calibration(cpu_profile(), s, d, trace, measured, 100)
    again = simulate_rate(d, s, replace(cpu_profile(), calibration=cal), trace.workload, lens, math.inf)
    return measured, cal, again
