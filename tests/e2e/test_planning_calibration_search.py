"""The calibration's search run whole on synthetic "measured" traces (a simulated served run with known serving
costs): it recovers them, from a results file too, with a front-end queue, and over two workloads at once. Pure, but
each runs the search's ~1,200 simulations, so they live outside the fast tier."""

from __future__ import annotations

import json
import math

import pytest
from helpers.planning import cpu_profile, fit_synthetic_trace, tiny_shapes

from afd.bench.workload import Workload
from afd.planning import calibrate
from afd.planning.deployment import Deployment
from afd.planning.profile import Calibration
from afd.planning.simulator import simulate_rate


def _workload(requests: int = 40) -> Workload:
    return Workload("mixed", requests, long_len=128, short_len=16, max_tokens=8, seed=3)


def _trace(requests: int = 40) -> calibrate.Trace:
    return calibrate.Trace(_workload(requests), (math.inf, 4.0))


def test_calibration_recovers_the_cost_of_a_synthetic_served_trace():
    """A "measured" trace simulated with known serving costs: the fit from the kernels-only profile finds costs
    that hold that trace within 15% on every target and 5% on capacity."""
    truth = Calibration(step_s=2e-4, token_s=1.5e-4, request_s=1e-3, front_end_s=4e-3)
    measured, cal, again = fit_synthetic_trace(_trace(), truth)
    for row in cal.fit["rows"]:
        assert row["calibrated"] == pytest.approx(row["measured"], rel=0.15), row
    assert "per token" in calibrate.format_calibration(cal)
    assert cal.prompt_step_s == 0.0  # a CPU's profile: no floor for steps holding prompt tokens
    assert calibrate.default_rates("cpu") == (math.inf, 8.0) and 64.0 in calibrate.default_rates("cuda")
    # the fitted profile's simulation of the same trace agrees with the "measurement"
    assert again["summary"]["request_throughput"] == pytest.approx(
        measured[0]["summary"]["request_throughput"], rel=0.05
    )


def test_a_profile_calibrates_from_a_served_results_file(tmp_path, capsys):
    """`afd profile --calibrate-from R.json`: a served run of none R=1 ("measured" here by simulating tiny with known
    serving costs, in afd bench serve's JSON shape) fits the profile's calibration, which then holds that run; a
    file of another server, or no results file, is refused in one sentence (exit 2)."""
    from dataclasses import replace

    from helpers.cli import main_exit

    from afd.planning.profile import load_profile
    from afd.planning.simulator import simulate

    truth = Calibration(step_s=2e-4, token_s=1.5e-4, request_s=1e-3, prompt_step_s=6e-3)
    trace, d = _trace(), Deployment("none", max_num_seqs=32, max_num_batched_tokens=512)
    measured = simulate(d, tiny_shapes(), cpu_profile(truth), trace.workload, list(trace.rates), 100)
    rates = ["inf" if math.isinf(r) else r for r in trace.rates]
    raw = {"workload": trace.workload.describe() | {"rates": rates},
           "results": [{"name": "none R=1", "runs": measured["runs"],
                        "step_limits": {"max_num_seqs": d.max_num_seqs,
                                        "max_num_batched_tokens": d.max_num_batched_tokens}}]}  # fmt: skip
    results, base, out = tmp_path / "r.json", tmp_path / "base.json", tmp_path / "p.json"
    results.write_text(json.dumps(raw))
    gpu = cpu_profile()  # its parts, as measured on a GPU: the fit then has a floor for steps holding prompt tokens
    replace(gpu, machine={**gpu.machine, "device": "1x NVIDIA H200"}).save(base)
    code, _ = main_exit(capsys, "profile", "--calibrate-from", str(results), "--profile", str(base), "-o", str(out))
    assert code == 0
    fitted = load_profile(out)
    assert fitted.parts == load_profile(base).parts and fitted.calibration.prompt_step_s > 0
    for row in fitted.calibration.fit["rows"]:
        assert row["calibrated"] == pytest.approx(row["measured"], rel=0.15), row
    # afd simulate --compare simulates under the limits the measured server ran with, unless flags say otherwise
    sim_out = tmp_path / "sim.json"
    for flags, budget in (([], d.max_num_batched_tokens), (["--max-num-batched-tokens", "64"], 64)):
        code, err = main_exit(capsys, "simulate", "--model", "tiny", "--profile", str(out), "--compare", str(results),
                              "--tolerance", "100", "--json", str(sim_out), *flags)  # fmt: skip
        assert code == 0, err
        assert json.loads(sim_out.read_text())["results"][0]["deployment"]["max_num_batched_tokens"] == budget
    raw["results"][0]["name"] = "async A=1,F=1"
    results.write_text(json.dumps(raw))
    for bad, why in ((str(results), "needs a run of `none` R=1"), (str(tmp_path / "missing.json"), "not a readable")):
        code, err = main_exit(capsys, "profile", "--calibrate-from", bad, "--profile", str(base), "-o", str(out))
        assert code == 2 and len(err.strip().splitlines()) == 1 and why in err, err


def test_a_joint_fit_holds_two_workloads_no_worse_than_either_workloads_own_fit(monkeypatch):
    """Two served traces (short and long prompts) "measured" with the same known serving costs: the joint fit,
    searched from each workload's own fit, holds the pair at least as well as either of those does, labels its rows
    by workload, and holds every target within 15% (the truth is one set of costs)."""
    monkeypatch.setattr(calibrate, "SEARCH_EVALS", 240)
    alone: list[Calibration] = []  # each workload's own fit, as the joint fit makes them
    fit_one = calibrate.fit_calibration
    monkeypatch.setattr(calibrate, "fit_calibration", lambda *a: alone.append(fit_one(*a)) or alone[-1])
    truth = Calibration(step_s=2e-4, token_s=1.5e-4, request_s=1e-3, front_end_s=4e-3)
    s, d = tiny_shapes(), Deployment("none")
    uneven = Workload("uneven", 24, long_len=128, short_len=16, max_tokens=8, seed=4)
    served = []
    for trace in (_trace(24), calibrate.Trace(uneven, (math.inf, 4.0))):
        lens = [len(x) for x in trace.workload.prompts(100)]
        runs = [simulate_rate(d, s, cpu_profile(truth), trace.workload, lens, r) for r in trace.rates]
        served.append(calibrate.ServedRun(d, trace, runs))
    joint = calibrate.fit_calibration_jointly(cpu_profile(), s, served, 100)

    def pair_loss(cal: Calibration) -> float:
        params = {n: getattr(cal, n) for n in calibrate.CPU_PARAMS}
        total = 0.0
        for r in served:
            lens = [len(x) for x in r.trace.workload.prompts(100)]
            sim = calibrate.simulated_targets(cpu_profile(), s, d, r.trace, lens, params)
            total += calibrate.loss(calibrate.targets_of(r.runs), sim)
        return total

    assert len(alone) == 2
    assert joint.fit["loss"] == pytest.approx(pair_loss(joint))
    assert joint.fit["loss"] <= min(pair_loss(c) for c in alone) + 1e-12
    assert {row["workload"] for row in joint.fit["rows"]} == {"1: mixed", "2: uneven"}
    for row in joint.fit["rows"]:
        assert row["calibrated"] == pytest.approx(row["measured"], rel=0.15), row
    assert "(2: uneven)" in calibrate.format_calibration(joint)


def test_calibration_finds_a_front_end_queue():
    """A "measured" trace whose first tokens wait in a front-end queue: the fit holds every target within 15%
    and gives the queue a cost."""
    trace = calibrate.Trace(_workload(), (math.inf, 4.0))
    truth = Calibration(token_s=1.5e-4, request_s=5e-4, arrival_s=4e-3, front_end_s=2e-3)
    measured, cal, again = fit_synthetic_trace(trace, truth)
    for row in cal.fit["rows"]:
        assert row["calibrated"] == pytest.approx(row["measured"], rel=0.15), row
    assert cal.arrival_s > 0
    assert "front end's queue" in calibrate.format_calibration(cal)
    assert again["summary"]["ttft_p50_s"] == pytest.approx(measured[0]["summary"]["ttft_p50_s"], rel=0.15)
