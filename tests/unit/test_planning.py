"""afd.planning without processes: the cost arithmetic, the profile fit, the simulator's rules, the closed-form
ratio against a sweep of the simulator (three regimes), the compare against a bench results dict."""

from __future__ import annotations

import math
import statistics
from dataclasses import replace

import pytest

from afd.bench.workload import Workload
from afd.model.weights import load_model_config
from afd.planning import costs, plan, ratio
from afd.planning.compare import beyond, errors, format_errors, step_metrics, workload_of
from afd.planning.deployment import Deployment, DeploymentError, memory_of
from afd.planning.profile import Calibration, Part, Profile, fit_part, load_profile
from afd.planning.simulator import simulate, simulate_rate


def _shapes(model: str = "deepseek-v2-lite", fmt: str = "bfloat16") -> costs.Shapes:
    return costs.shapes_of(load_model_config(model), fmt)


def test_presets_have_the_released_sizes():
    assert _shapes("deepseek-v2").total_weight_bytes() / 2 == pytest.approx(236e9, rel=0.01)
    assert _shapes("deepseek-v3", "fp8").total_weight_bytes() == pytest.approx(671e9, rel=0.01)


def test_part_and_fit_recover_a_linear_model():
    truth = Part(fixed_s=2e-5, bandwidth_Bps=1e12, peak_flops=5e14)
    rows = [(b, f, truth.time(b, f)) for b, f in ((1e6, 1e9), (1e8, 1e10), (5e8, 1e12), (1e9, 3e12))]
    fit = fit_part(rows)
    assert fit.fixed_s == pytest.approx(2e-5, rel=1e-6)
    assert fit.bandwidth_Bps == pytest.approx(1e12, rel=1e-6)
    assert fit.peak_flops == pytest.approx(5e14, rel=1e-6)


def test_experts_touched_and_destinations():
    assert costs.experts_touched(64, 64, 6, 1) == pytest.approx(6)
    assert costs.experts_touched(64, 64, 6, 10_000) == pytest.approx(64)
    assert costs.destinations_per_token(64, 6, 1) == pytest.approx(1.0)
    assert costs.destinations_per_token(64, 6, 2) == pytest.approx(1.98, abs=0.01)  # architecture.md's d


def test_routed_experts_past_the_kernels_bound_take_the_grouped_part():
    """The engine's MoE leaves its decode kernels past `FUSED_MOE_MAX_PAIRS` (token, k) pairs (16-bit experts for
    the grouped GEMM, FP8 ones for their row tiles, both bound by the matmuls): a profile with a grouped part prices
    those steps by it, one without keeps one part for every size."""
    from afd.buckets import path_rows
    from afd.model.moe import FUSED_MOE_MAX_PAIRS

    s, fp8 = _shapes(), _shapes(fmt="fp8")
    kernels, grouped = Part(fixed_s=1e-3), Part(fixed_s=5e-3)
    p = Profile({}, {"routed_experts": kernels, "routed_experts_grouped": grouped})
    last = 512  # the most tokens whose pairs the kernels take at top-6: the engine counts rows by `path_rows`
    assert costs.kernel_max_pairs() == FUSED_MOE_MAX_PAIRS and path_rows(last + 1) * s.topk > FUSED_MOE_MAX_PAIRS
    assert costs.routed_pass_s(p, s, last, s.num_experts) == pytest.approx(1e-3)
    assert costs.routed_pass_s(p, s, last + 1, s.num_experts) == pytest.approx(5e-3)
    assert costs.routed_pass_s(p, fp8, last + 1, fp8.num_experts) == pytest.approx(5e-3)
    one = Profile({}, {"routed_experts": kernels})
    assert costs.routed_pass_s(one, s, 10 * last, s.num_experts) == pytest.approx(1e-3)
    # a step replays its graph's bucket (a 641-token prompt step the 768-token one, a 300-sequence decode step the
    # 320 one), and the bucket never changes the path: a 500-token step padded to 512 stays on the kernels, a
    # 600-token one padded to 640 on the grouped GEMM
    assert costs.graph_tokens(641, True, 8192, 1024) == 768 and costs.graph_tokens(300, False, 8192, 1024) == 320
    assert costs.graph_tokens(9000, True, 8192, 1024) == 9000  # past the largest bucket: as it is
    for tokens, price in ((500, 1e-3), (600, 5e-3)):
        bucket = costs.graph_tokens(tokens, True, 8192, 1024)
        assert costs.routed_pass_s(p, s, tokens, s.num_experts, bucket) == pytest.approx(price), tokens


def test_profile_fits_the_routed_experts_on_each_side_of_the_bound():
    """On a GPU `afd profile` fits one routed part per side of the kernels' bound from rows of (bytes, flops,
    seconds, tokens), with all experts and with half: each row is priced by its own side's part as measured, the
    grouped side's fixed cost found; on a CPU one part for every row."""
    from afd.planning.fitting import routed_parts as _routed_parts

    s = _shapes()
    bound_tokens = costs.kernel_max_pairs() // s.topk
    rows = []
    for local in (s.num_experts, s.num_experts // 2):
        for t in (1, 8, 64, 256, 2 * bound_tokens, 4 * bound_tokens, 8 * bound_tokens):
            nbytes = costs.experts_touched(local, s.num_experts, s.topk, t) * s.expert_params * s.weight_bytes
            flops = 2.0 * s.expert_params * t * s.topk * local / s.num_experts
            fixed = 2e-5 if t <= bound_tokens else 2e-4
            rows.append((nbytes, flops, fixed + nbytes / 4e12 + flops / 5e14, t))
    parts = _routed_parts(rows, s, "cuda")
    p = Profile({}, parts)
    for nbytes, flops, sec, t in rows:
        assert p.part(costs.routed_part(p, s, t)).time(nbytes, flops) == pytest.approx(sec, rel=1e-3)
    assert parts["routed_experts_grouped"].fixed_s == pytest.approx(2e-4, rel=1e-2)
    assert set(_routed_parts(rows, s, "cpu")) == {"routed_experts"}


def test_layer_cycle():
    assert costs.layer_cycle_s(1.0, 2.0, 0.5, 1) == 3.5
    assert costs.layer_cycle_s(1.0, 2.0, 0.5, 2) == 4.0  # the FFN does both micro-batches
    assert costs.layer_cycle_s(0.1, 0.1, 5.0, 2) == pytest.approx(5.2)  # one micro-batch's chain


def test_memory_refuses_what_does_not_fit():
    s = _shapes("deepseek-v3", "fp8")
    with pytest.raises(DeploymentError):
        memory_of(Deployment("none"), s, 149e9)
    with pytest.raises(DeploymentError):
        memory_of(Deployment("async", 4, 2), s, 149e9)
    assert memory_of(Deployment("async", 4, 8), s, 149e9).kv_tokens_per_replica > 100_000


def test_simulator_follows_the_scheduler_rules():
    # the parts alone: a calibration's front-end queue would spread the arrivals the waves are counted in
    p, s = replace(load_profile("h200"), calibration=Calibration()), _shapes()
    w = Workload("uniform", 50, long_len=100, short_len=100, max_tokens=10)
    run = simulate_rate(Deployment("none"), s, p, w, [100] * 50, math.inf)
    summary = run["summary"]
    assert summary["completed"] == 50 and summary["output_tokens"] == 500
    # every prompt fits the 2,048-token budget: 20 prompts per step, so the first tokens come in three waves
    ttfts = sorted(r["ttft_s"] for r in run["requests"])
    assert len({round(t, 9) for t in ttfts}) == 3


def test_simulator_10k_requests_fast():
    import time

    p, s = load_profile("h200"), _shapes()
    start = time.perf_counter()
    result = simulate(Deployment("async", 2, 1), s, p, Workload("mixed", 10_000, short_len=64), [math.inf])
    assert time.perf_counter() - start < 30
    assert result["runs"][0]["summary"]["completed"] == 10_000


def _linear_profile(attn_fixed: float, ffn_fixed: float, ffn_per_token: float, wire_per_token: float) -> Profile:
    """Every part linear in tokens: no bytes terms, a fixed cost and a per-token (FLOP) rate."""
    s = _shapes()
    layers = s.moe_layers
    per_row_flops = 2.0 * s.expert_params * s.topk
    parts = {
        "attention_decode": Part(fixed_s=attn_fixed * layers, peak_flops=2.0 * s.attention_side_params / 1e-6),
        "routed_experts": Part(fixed_s=ffn_fixed, peak_flops=per_row_flops / ffn_per_token),
        "exchange_async": Part(fixed_s=1e-6, bandwidth_Bps=costs.exchange_bytes(s, "async", 1, 1) / wire_per_token),
    }
    return Profile({"device": "synthetic"}, parts, gpu_memory_bytes=1e12)


REGIMES = {  # (attention fixed per layer, FFN fixed, FFN per token, wire per token), seconds
    "attention": (400e-6, 5e-6, 0.5e-6, 0.01e-6),
    "ffn": (40e-6, 300e-6, 0.2e-6, 0.01e-6),
    "communication": (40e-6, 2e-6, 0.02e-6, 3e-6),
}


@pytest.mark.parametrize("regime", sorted(REGIMES))
def test_closed_form_ratio_matches_a_simulator_sweep(regime):
    """With a synthetic linear profile the ratio the rule picks is within 10% of the simulator's best r (or its
    throughput within 10% of the best's where the curve is flat); `afd plan`'s search on 16 GPUs (the rule narrows
    each group's shapes, the simulator scores them: `plan.candidates`, `plan.score`) picks the best r itself."""
    p, s = _linear_profile(*REGIMES[regime]), _shapes()
    batch = 16
    w = Workload("uniform", 0, long_len=8, short_len=8, max_tokens=48)
    base = Deployment("async", max_num_seqs=batch)
    rule = ratio.optimal_ratio(p, s, "async", 1, batch, 32, r_max=16)
    per_gpu = {}
    for r in range(1, 17):
        d = Deployment("async", r, 1, max_num_seqs=batch)
        wr = Workload("uniform", 4 * r * batch, long_len=8, short_len=8, max_tokens=48)
        summary = simulate_rate(d, s, p, wr, [8] * wr.requests, math.inf)["summary"]
        per_gpu[r] = summary["output_tok_s"] / d.gpus
    best = max(per_gpu, key=per_gpu.get)
    picked = min(16, max(1, round(rule.r_star)))
    assert rule.bound == regime or regime == "attention"
    assert abs(picked - best) / best <= 0.1 or per_gpu[picked] >= 0.9 * per_gpu[best], (rule, best, per_gpu)
    load = Workload("uniform", 4 * 16 * batch, long_len=8, short_len=8, max_tokens=48)  # every replica saturated
    ctx = 8 + 48 // 2
    shapes = [d for d, _ in plan.candidates(16, s, p, base, ctx) if d.connector == "async" and d.ubatches == 1]
    unbounded = plan.Slo(ttft_p90_s=math.inf, tpot_p50_s=math.inf)
    scored = {d: plan.score(d, s, p, load, unbounded)["tokens_per_s_per_gpu"] for d in shapes}
    chosen = max(scored, key=scored.get)
    assert abs(chosen.attention / chosen.ffn - best) / best <= 0.1, (regime, chosen.name, best, scored)
    del w


def test_compare_reads_a_bench_results_file():
    raw = {
        "workload": {"kind": "mixed", "requests": 20, "long_len": 256, "short_len": 32, "long_fraction": 0.25,
                     "max_tokens": 8, "seed": 0, "warmups": 0, "rates": ["inf"]},
        "results": [{"name": "none R=1", "runs": [{"rate": "inf", "summary": {"request_throughput": 10.0}}]}],
    }  # fmt: skip
    workload, rates = workload_of(raw)
    assert workload.requests == 20 and rates == [math.inf]
    sim = {"runs": [{"rate": math.inf, "summary": {"request_throughput": 12.0}}]}
    rows = [r for r in errors(raw["results"][0], sim) if r["metric"] == "request_throughput"]
    assert rows[0]["error"] == pytest.approx(0.2)
    # steps beside the metrics, shown but not judged: 100 steps of 20 ms measured, 80 of 25 ms simulated
    raw["results"][0]["runs"][0]["summary"] = {
        "request_throughput": 10.0,
        "steps": {"count": 100, "device_s": 2.0, "replicas": 1},
    }
    sim["runs"][0]["summary"] = {"request_throughput": 10.0, "steps": {"count": 80, "device_s": 2.0, "replicas": 1}}
    rows = errors(raw["results"][0], sim)
    step = {r["metric"]: r for r in rows if not r["judged"]}
    assert step["mean_step_s"]["measured"] == pytest.approx(0.02)
    assert step["mean_step_s"]["error"] == pytest.approx(0.25)
    assert step["steps_per_replica"]["error"] == pytest.approx(0.2)
    assert not beyond(rows, 0.0)  # the judged metric is exact; the steps, 20-25% off, are not judged
    assert "(not judged" in format_errors(rows, 0.15)
    assert format_errors(rows, 0.15).endswith("1 of 1 judged metrics within 15%; worst error 0.0%")
    rows[0]["error"] = 0.2  # one judged metric beyond the tolerance: counted out
    assert format_errors(rows, 0.15).endswith("0 of 1 judged metrics within 15%; worst error 20.0%")
    # the simulator reports its steps in the server's terms
    from helpers.planning import cpu_profile, tiny_shapes

    d, shapes = Deployment("none"), tiny_shapes()
    w = Workload("mixed", 20, long_len=64, short_len=16, max_tokens=4, seed=0)
    summary = simulate_rate(d, shapes, cpu_profile(), w, [len(x) for x in w.prompts(100)], math.inf)["summary"]
    steps = summary["steps"]
    assert steps["count"] >= 4 and 0 < steps["device_s"] <= summary["wall_s"] + 1e-9
    # 20 prompts in a few steps, then 4 tokens each: both kinds of step, the prompt ones the longer
    assert 0 < steps["prompt_count"] < steps["count"] and 0 < steps["prompt_device_s"] < steps["device_s"]
    split = step_metrics(summary)
    assert split["mean_prompt_step_s"] > split["mean_decode_step_s"] > 0
    assert split["prompt_step_share"] == pytest.approx(steps["prompt_count"] / steps["count"])


def test_compare_splits_the_steps_into_prompt_and_decode_steps_where_both_runs_did():
    """100 steps of 20 ms measured, 25 of them holding a prompt token at 50 ms (the other 75 at 10 ms), against a
    simulation of 80 steps, 20 at 60 ms: the split is shown beside the totals; a results file from before the split
    shows the totals only."""
    measured = {
        "runs": [
            {
                "rate": "inf",
                "summary": {
                    "request_throughput": 10.0,
                    "steps": {
                        "count": 100,
                        "device_s": 2.0,
                        "replicas": 1,
                        "prompt_count": 25,
                        "prompt_device_s": 1.25,
                    },
                },
            }
        ]
    }
    sim = {"runs": [{"rate": math.inf, "summary": {"request_throughput": 10.0, "steps": {
        "count": 80, "device_s": 2.0, "replicas": 1, "prompt_count": 20, "prompt_device_s": 1.2}}}]}  # fmt: skip
    step = {r["metric"]: r for r in errors(measured, sim) if not r["judged"]}
    assert step["prompt_step_share"]["measured"] == pytest.approx(0.25)
    assert step["prompt_step_share"]["error"] == pytest.approx(0.0)
    assert step["mean_prompt_step_s"]["measured"] == pytest.approx(0.05)
    assert step["mean_prompt_step_s"]["simulated"] == pytest.approx(0.06)
    assert step["mean_decode_step_s"]["measured"] == pytest.approx(0.01)
    assert step["mean_decode_step_s"]["simulated"] == pytest.approx(0.8 / 60)
    del measured["runs"][0]["summary"]["steps"]["prompt_count"]
    assert {r["metric"] for r in errors(measured, sim) if not r["judged"]} == {"steps_per_replica", "mean_step_s"}


def test_compare_picks_the_server_that_ran_the_simulated_deployment():
    """A results file of several servers (`afd bench serve --compare none:R=1,async:A=1,F=1`): the simulation is
    held against the one that ran its deployment; a file without it is refused, naming what it holds."""
    from afd.planning.compare import result_for, server_of

    raw = {"results": [{"name": "none R=1"}, {"name": "async A=1,F=1"}, {"name": "async+sa A=2,F=1,U=2"}]}
    assert server_of("async+sa A=2,F=1,U=2") == ("async", {"A": 2, "F": 1, "U": 2})
    assert result_for(raw, "none", 1, 1, 1, 1)["name"] == "none R=1"
    assert result_for(raw, "async", 1, 1, 1, 1)["name"] == "async A=1,F=1"
    assert result_for(raw, "async", 2, 1, 1, 2)["name"] == "async+sa A=2,F=1,U=2"
    with pytest.raises(ValueError, match="holds none R=1, async A=1,F=1, async\\+sa A=2,F=1,U=2, none of them"):
        result_for(raw, "p2p", 1, 1, 1, 1)
    assert result_for({"results": [{"name": "anything"}]}, "p2p", 1, 1, 1, 1)["name"] == "anything"


def test_simulated_gpu_replica_admits_a_request_two_steps_on_as_overlapped_steps_do():
    """On a GPU profile a whole replica's step is scheduled when the one before starts (afd's overlapped steps):
    a request reaching a busy engine waits one step more for its first token than on CPU; one reaching an idle
    engine does not."""
    from dataclasses import replace

    from helpers.planning import cpu_profile, tiny_shapes

    class TwoArrivals(Workload):
        def arrivals(self, rate: float) -> list[float]:
            return [0.0, 0.0105]  # the second mid-way through the first request's decode steps

    w = TwoArrivals("uniform", 2, long_len=8, short_len=8, max_tokens=30)
    cpu = cpu_profile()
    gpu = replace(cpu, machine={**cpu.machine, "device": "1x NVIDIA H200"})
    assert gpu.on_gpu and not cpu.on_gpu
    runs = [simulate_rate(Deployment("none"), tiny_shapes(), p, w, [8, 8], math.inf)["requests"] for p in (cpu, gpu)]
    (first_cpu, second_cpu), (first_gpu, second_gpu) = runs
    step = statistics.median(first_cpu["itl_s"])  # one decode step of the first request alone
    assert first_gpu["ttft_s"] == first_cpu["ttft_s"]
    assert step * 0.5 < second_gpu["ttft_s"] - second_cpu["ttft_s"] < step * 2.5


def test_a_profile_on_a_models_layers_keeps_its_compute_parts_and_takes_the_rest_from_the_base():
    """`published.on_model_layers`: the measured profile's experts, attention and prefill parts; the base's
    exchange, launch and host parts, calibration, front end and link, each named in `machine.assumed`."""
    from afd.planning.profile import Link
    from afd.planning.published import COMPUTE_PARTS, on_model_layers

    measured = Profile({"model": "m-first-4-layers"}, {name: Part(fixed_s=1.0) for name in COMPUTE_PARTS},
                       "measured", calibration=Calibration())  # fmt: skip
    base_parts = {name: Part(fixed_s=2.0) for name in (*COMPUTE_PARTS, "exchange_async", "exchange_p2p", "host")}
    base = Profile({"model": "lite"}, base_parts, "base", front_end_s=3.0, link=Link(inter_node_Bps=1.0),
                   calibration=Calibration(request_s=4.0))  # fmt: skip
    got = on_model_layers(measured, base, "m")
    assert got.machine["model"] == "m" and got.source.startswith("measured")
    assert all(got.part(name).fixed_s == 1.0 for name in COMPUTE_PARTS)
    assert all(got.part(name).fixed_s == 2.0 for name in ("exchange_async", "exchange_p2p", "host"))
    assert (got.calibration.request_s, got.front_end_s, got.link.inter_node_Bps) == (4.0, 3.0, 1.0)
    assumed = got.machine["assumed"]
    assert set(assumed) == {"exchange_async", "exchange_p2p", "host", "calibration", "front_end_s", "link"}


@pytest.mark.parametrize("flag", ["--compare", "--calibrate-from"])
def test_a_file_that_is_no_bench_results_is_refused_in_one_sentence(tmp_path, capsys, flag):
    from helpers.cli import main_exit

    command = ["simulate", "--model", "tiny"] if flag == "--compare" else ["profile", "-o", str(tmp_path / "p.json")]
    for text, why in (("not json", "not a readable results JSON"), ('{"a": 1}', "not an afd bench serve --json")):
        path = tmp_path / "r.json"
        path.write_text(text)
        code, err = main_exit(capsys, *command, flag, str(path))
        assert code == 2 and err.strip().splitlines() == [err.strip()] and why in err, err
