"""The profile's serving costs without processes: the per-row step fit, the calibration field (and older profiles
without it), the serving cost arithmetic, the simulator adding it, and the search on a known minimum (the search
run whole on synthetic traces: tests/e2e/test_planning_calibration_search.py)."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import replace

import pytest
from helpers.planning import cpu_profile, tiny_shapes

from afd.bench.workload import Workload
from afd.model.weights import load_model_config
from afd.planning import calibrate, costs
from afd.planning.deployment import Deployment, StepCosts, StepLoad
from afd.planning.fitting import format_residuals, refit_profile
from afd.planning.profile import Calibration, Part, Profile, fit_part, load_profile, relative_errors
from afd.planning.simulator import simulate_rate


def test_fit_with_a_per_row_cost_recovers_batch_and_context():
    truth = Part(fixed_s=1e-3, bandwidth_Bps=1e9, per_item_s=5e-5)
    shapes = [(b, ctx) for b in (1, 4, 16, 64, 256) for ctx in (32, 256)]
    rows = [(1e6 + ctx * b * 100.0, 0.0, truth.time(1e6 + ctx * b * 100.0, 0.0, b)) for b, ctx in shapes]
    items = [float(b) for b, _ in shapes]
    for relative in (False, True):
        fit = fit_part(rows, items=items, relative=relative)
        assert max(relative_errors(fit, rows, items)) < 1e-6
        assert fit.per_item_s == pytest.approx(5e-5, rel=1e-4)
    text = format_residuals("attention_decode", [f"b{b} c{c}" for b, c in shapes], fit, rows, items)
    assert "b256 c256" in text and "worst 0.0%" in text


def test_fit_recovers_a_core_slower_than_the_linears_per_cached_token(tmp_path):
    """Decode rows whose cached tokens cost more than one peak for every FLOP prices (MLA's core beside the linears):
    the context column takes the difference, which bytes and FLOPs alone could not (V3's layers at 4K: -13 to -18%);
    a profile saved before the column existed loads with it at zero."""
    s = costs.shapes_of(load_model_config("deepseek-v3"), "bfloat16")
    truth = Part(bandwidth_Bps=2.4e12, peak_flops=8e14, per_context_s=1.3e-8)
    shapes = [(b, c) for b in (1, 8, 64, 256) for c in (512, 2048, 4096)]
    ctx = [float(b * (c + 1)) for b, c in shapes]
    rows = []
    for (b, _), t in zip(shapes, ctx, strict=True):
        nbytes, flops = costs.decode_bytes(s, t), costs.decode_flops(s, b, t)
        rows.append((nbytes, flops, truth.time(nbytes, flops, 0.0, t)))
    # bytes, FLOPs and cached tokens: three columns over constant, batch and context, so one solution
    fit = fit_part(rows, fixed=False, context=ctx, relative=True)
    assert fit.per_context_s == pytest.approx(1.3e-8, rel=1e-3) and max(relative_errors(fit, rows, None, ctx)) < 1e-6
    assert fit.peak_flops == pytest.approx(8e14, rel=1e-3)
    without = fit_part(rows, items=[float(b) for b, _ in shapes], relative=True)
    assert max(relative_errors(without, rows)) > 0.05
    old = cpu_profile().to_json()
    for part in old["parts"].values():
        part.pop("per_context_s")
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    assert all(part.per_context_s == 0.0 for part in load_profile(str(path)).parts.values())


def test_relative_fit_weighs_short_rows():
    # one outlier among long rows must not swamp the short rows' fit when errors are relative
    rows = [(0.0, 0.0, 1e-3 + n * 1e-5) for n in (1, 2, 4, 8)] + [(0.0, 0.0, 2.0)]
    items = [1.0, 2.0, 4.0, 8.0, 100.0]
    fit = fit_part(rows, items=items, relative=True)
    assert max(relative_errors(fit, rows[:4], items[:4])) < 0.5


def test_older_profiles_load_with_zero_calibration(tmp_path, caplog):
    old = cpu_profile().to_json()
    del old["calibration"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    with caplog.at_level(logging.INFO, logger="afd.planning.profile"):
        p = load_profile(path)
    assert p.calibration == Calibration() and not p.calibration.active
    assert "no calibration" in caplog.text
    cal = Calibration(step_s=1e-4, token_s=2e-5, request_s=3e-4, front_end_s=1e-3, fit={"loss": 0.1})
    cpu_profile(cal).save(tmp_path / "new.json")
    assert load_profile(tmp_path / "new.json").calibration == cal
    assert load_profile("h200").calibration.token_s == 0.0


def test_serving_cost_arithmetic():
    cal = Calibration(step_s=1e-3, token_s=1e-4, request_s=5e-3)
    assert costs.serving_s(cal, 0, 0) == 0.0
    assert costs.serving_s(cal, 10, 0) == pytest.approx(2e-3)
    assert costs.serving_s(cal, 3, 2) == pytest.approx(1e-3 + 3e-4 + 1e-2)
    s, d = tiny_shapes(), Deployment("none")
    load = StepLoad(batch=8, ctx=800, prefill=64, pairs=2080, seqs=10, emitted=9, admitted=2)
    plain = StepCosts(d, s, cpu_profile()).replica_step(load)
    with_cal = StepCosts(d, s, cpu_profile(cal)).replica_step(load)
    assert with_cal - plain == pytest.approx(costs.serving_s(cal, 9, 2))
    # a step holding prompt tokens lasts at least `prompt_step_s`; a pure decode step is not held to it
    floor = Calibration(prompt_step_s=0.5)
    assert StepCosts(d, s, cpu_profile(floor)).replica_step(load) == 0.5
    decode = StepLoad(batch=8, ctx=800, prefill=0, pairs=0, seqs=8, emitted=8, admitted=0)
    assert StepCosts(d, s, cpu_profile(floor)).replica_step(decode) == StepCosts(d, s, cpu_profile()).replica_step(
        decode
    )
    p2p = StepCosts(Deployment("p2p", 2, 1), s, cpu_profile(floor))
    assert p2p.wave([load, decode]) == 0.5 and p2p.wave([decode, decode]) < 0.5


def test_attention_step_counts_rows_and_prompt_tokens():
    s, p = tiny_shapes(), cpu_profile()
    one = costs.attention_step_s(p, s, 1, 100, 0, 0)
    assert costs.attention_step_s(p, s, 11, 100, 0, 0) - one == pytest.approx(10 * 2e-5)
    assert costs.attention_step_s(p, s, 1, 100, 50, 0) - one == pytest.approx(50 * 1e-5)


def _trace(requests: int = 40) -> calibrate.Trace:
    w = Workload("mixed", requests, long_len=128, short_len=16, max_tokens=8, seed=3)
    return calibrate.Trace(w, (math.inf, 4.0))


def test_simulator_streams_tokens_and_admits_requests_at_their_cost():
    s, d, trace = tiny_shapes(), Deployment("none"), _trace()
    lens = [len(x) for x in trace.workload.prompts(100)]
    base = simulate_rate(d, s, cpu_profile(), trace.workload, lens, math.inf)["summary"]
    slow = simulate_rate(d, s, cpu_profile(Calibration(token_s=1e-3)), trace.workload, lens, math.inf)["summary"]
    # every token costs 1 ms more: at least 40 × 8 tokens' worth of wall time more
    assert slow["wall_s"] - base["wall_s"] >= 0.3
    late = simulate_rate(d, s, cpu_profile(Calibration(front_end_s=0.5)), trace.workload, lens, 4.0)["summary"]
    early = simulate_rate(d, s, cpu_profile(), trace.workload, lens, 4.0)["summary"]
    assert late["ttft_p50_s"] - early["ttft_p50_s"] == pytest.approx(0.5, abs=1e-6)


def test_a_first_token_waits_for_the_streams_open_at_its_step():
    """`Calibration.stream_s` per sequence running when a first token comes out: at 4/s on the tiny trace few streams
    are open, at capacity many, so the same cost moves TTFT more there; the last token's write waits as well."""
    s, d, trace = tiny_shapes(), Deployment("none"), _trace()
    lens = [len(x) for x in trace.workload.prompts(100)]
    for rate in (4.0, math.inf):
        base = simulate_rate(d, s, cpu_profile(), trace.workload, lens, rate)["summary"]
        slow = simulate_rate(d, s, cpu_profile(Calibration(stream_s=1e-3)), trace.workload, lens, rate)["summary"]
        added = slow["ttft_p50_s"] - base["ttft_p50_s"]
        assert 1e-3 <= added <= 1e-3 * len(lens), (rate, added)  # its own stream at least, every stream at most
        # the last token waits too, so the time per output token between them stays
        assert slow["e2e_p50_s"] > base["e2e_p50_s"] and slow["tpot_p50_s"] == pytest.approx(
            base["tpot_p50_s"], rel=0.1
        )
        if rate == 4.0:
            few = added
    assert added > 2 * few


def test_stream_cost_is_the_write_stage_slope_against_streams_open():
    """The slope of the first token's front-to-written p50 against rate x E2E p50 over the finite rates (the run at
    capacity left out); 0 with fewer than two such runs or a negative slope."""

    def run(rate: float, rps: float, e2e: float, written: float) -> dict:
        stages = {"front_to_written": written}
        return {"rate": rate, "summary": {"request_throughput": rps, "e2e_p50_s": e2e, "ttft_stages_p50_s": stages}}

    runs = [
        run(math.inf, 250.0, 0.5, 0.003),
        run(64.0, 50.0, 0.4, 0.0002 + 20 * 4e-5),
        run(8.0, 8.0, 0.25, 0.0002 + 2 * 4e-5),
    ]
    assert calibrate.stream_cost(runs) == pytest.approx(4e-5)
    assert calibrate.stream_cost(runs[:2]) == 0.0
    assert calibrate.stream_cost([run(64.0, 50.0, 0.4, 1e-4), run(8.0, 8.0, 0.25, 1e-3)]) == 0.0
    no_stages = [
        {"rate": r["rate"], "summary": {k: v for k, v in r["summary"].items() if "stages" not in k}} for r in runs
    ]
    assert calibrate.stream_cost(no_stages) == 0.0


def test_pattern_search_finds_a_known_minimum():
    target = {"a": 3e-4, "b": 0.0, "c": 2.0}

    def f(x: dict[str, float]) -> float:
        return sum((x[k] - v) ** 2 / (v or 1e-4) ** 2 for k, v in target.items())

    best, value = calibrate.pattern_search(f, {"a": 1e-4, "b": 0.0, "c": 0.0}, {"a": 1e-4, "b": 1e-4, "c": 1.0},
                                           max_evals=400)  # fmt: skip
    assert best["b"] == 0.0
    assert best["a"] == pytest.approx(3e-4, rel=0.05) and best["c"] == pytest.approx(2.0, rel=0.05)
    assert value < 0.01


def test_targets_and_loss():
    runs = [{"rate": math.inf, "summary": {"request_throughput": 10.0, "ttft_p50_s": 0.5, "tpot_p50_s": None}}]
    t = calibrate.targets_of(runs)
    assert t == {("inf", "request_throughput"): 10.0, ("inf", "ttft_p50_s"): 0.5}
    assert calibrate.loss(t, t) == 0.0
    assert calibrate.loss(t, {("inf", "request_throughput"): 10.0 * math.e, ("inf", "ttft_p50_s"): 0.5}) == (
        pytest.approx(1.0)
    )


def test_a_profile_on_one_gpu_measures_async_alone_and_names_what_it_assumed(monkeypatch):
    """p2p's exchange needs a GPU per rank: on one GPU `afd profile` measures async's round trip only, and takes it
    for p2p's under `machine.assumed` (it once started p2p's two NCCL ranks on one device and failed). The parts
    come from stand-ins here; on two GPUs both connectors are asked for. Prompt steps of a fixed cost plus one per
    token keep a fixed cost and a FLOP rate in the prefill part (FLOPs, not tokens: it carries to other shapes)."""
    import afd.planning.measure as measure

    asked: list[tuple[str, ...]] = []
    rows = [(b * 1e6, b * 1e9, 1e-4 + b * 1e-6, int(b)) for b in (1.0, 8.0, 64.0, 512.0)]
    step = {
        "decode": [{"batch": b, "context": c, "graph_ms": 5.0 + b / 100 + c / 1000, "eager_ms": 9.0}
                   for b in (1, 8, 64) for c in (512, 2048)],
        "prefill": [{"batch": b, "context": c, "tokens": b * c, "ms": 100.0 + b * c / 20}
                    for b, c in ((1, 512), (1, 2048), (8, 1024))],
        "mixed": [{"decodes": d, "context": 512, "chunk": c, "mixed_ms": 5.0 + d / 100 + 0.512 + 100.0 + c / 20}
                  for d, c in ((64, 256), (64, 1024))],
    }  # fmt: skip

    def exchange(**kwargs):
        asked.append(kwargs["connectors"])
        slower = {"p2p": 10.0, "async": 0.0}  # µs more per round trip
        return {"rows": [{"connector": c, "bytes": t * 4096, "p50_us": 20 + slower[c] + t / 10}
                         for c in kwargs["connectors"] for t in kwargs["tokens"]]}  # fmt: skip

    monkeypatch.setattr(measure, "_expert_rows", lambda *args: (rows, [r[:3] for r in rows]))
    monkeypatch.setattr(measure, "run_bench_step", lambda **kwargs: step)
    monkeypatch.setattr(measure, "run_bench_exchange", exchange)
    monkeypatch.setattr(measure, "device_name", lambda device: "1x a test GPU")
    monkeypatch.setattr(measure.torch.cuda, "get_device_properties", lambda i: type("P", (), {"total_memory": 80e9}))
    for gpus, connectors in ((1, ("async",)), (2, ("p2p", "async"))):
        monkeypatch.setattr(measure.torch.cuda, "device_count", lambda gpus=gpus: gpus)
        said: list[str] = []
        p = measure.measure_profile("deepseek-v2-lite", "bfloat16", "cuda", calibrate=False, say=said.append)
        assert asked[-1] == connectors
        prompt = p.parts["prefill"]  # steps of a fixed cost plus one per token: the fit carries both
        assert prompt.fixed_s > 0 and prompt.peak_flops and prompt.per_item_s == 0
        fit = next(line for line in said if line.startswith("prefill fit"))  # mixed steps fitted too
        assert "1024 beside 64 at 512" in fit and "prefill 8 x 1024" in fit
        if gpus == 1:
            assert p.parts["exchange_p2p"] == p.parts["exchange_async"] and "exchange_p2p" in p.machine["assumed"]
        else:
            assert "assumed" not in p.machine and p.parts["exchange_p2p"] != p.parts["exchange_async"]
        # the rows it was fitted to travel with it, and fit again to the same parts
        again = Profile.from_json(json.loads(json.dumps(p.to_json())))
        assert again.measured == p.measured and set(p.measured["parts"]) >= {"routed", "decode", "prefill", "mixed"}
        assert refit_profile(again, say=said.append).parts == p.parts


def test_refit_fits_a_profile_again_from_its_rows_and_refuses_one_without(tmp_path, capsys):
    """`afd profile --refit P.json -o OUT.json`: OUT's parts are what this code fits to the rows P keeps, whatever
    P's parts say (here, one changed by hand); a profile without rows (the shipped published one) is refused in one
    sentence, exit 2, and nothing is written."""
    from helpers.cli import main_exit

    from afd.planning.fitting import Measured

    rows = [[b * 1e6, b * 1e9, 1e-4 + b * 1e-6, b] for b in (1.0, 8.0, 64.0)]
    decode = [{"batch": b, "context": c, "seconds": 5e-3 + b * 1e-5 + c * 1e-6} for b in (1, 8, 64) for c in (32, 256)]
    shapes = ((1, 32), (4, 64), (8, 128))
    prefill = [{"batch": b, "context": c, "tokens": b * c, "seconds": 1e-2 + b * c * 5e-5} for b, c in shapes]
    costs_us = (("p2p", 2e-5), ("async", 1e-5))
    exchange = {name: [[4096.0 * t, cost + t * 1e-8] for t in (1, 8, 64)] for name, cost in costs_us}
    measured = Measured("cpu", rows, [r[:3] for r in rows], decode, prefill, [], exchange)
    profile = load_profile("h200-published")
    changed = {**profile.parts, "prefill": Part(fixed_s=1.0)}
    path = tmp_path / "p.json"
    replace(profile, parts=changed, measured={"parts": measured.to_json()}, calibration=Calibration()).save(path)
    code, err = main_exit(capsys, "profile", "--refit", str(path), "-o", str(tmp_path / "out.json"))
    assert code == 0, err
    out = load_profile(str(tmp_path / "out.json"))
    from afd.model.weights import load_model_config
    from afd.planning.costs import shapes_of
    from afd.planning.fitting import fit_parts

    parts, assumed = fit_parts(measured, shapes_of(load_model_config("deepseek-v2-lite"), "bfloat16"))
    assert out.parts == parts and assumed == {} and out.part("prefill").fixed_s != 1.0
    code, err = main_exit(capsys, "profile", "--refit", "h200-published", "-o", str(tmp_path / "none.json"))
    assert code == 2 and "keeps no measured rows" in err and err.count("\n") == 1
    assert not (tmp_path / "none.json").exists()


def test_a_profile_with_fp8_weights_measures_them_quantized_and_prices_fp8_bytes(monkeypatch):
    """`afd profile --quantization fp8`: the experts and the steps are measured with the weights quantized at load
    (what `afd serve --quantization fp8` runs), and the profile's bytes and format are FP8's."""
    from afd.planning import measure

    seen = []
    for name in ("load_ffn_model", "run_bench_step"):
        real = getattr(measure, name)

        def spy(*args, real=real, name=name, **kwargs):
            seen.append((name, kwargs.get("quantization")))
            return real(*args, **kwargs)

        monkeypatch.setattr(measure, name, spy)
    p = measure.measure_profile("tiny", "float32", "cpu", exchange=False, calibrate=False, quantization="fp8")
    assert {q for _, q in seen} == {"fp8"} and {n for n, _ in seen} == {"load_ffn_model", "run_bench_step"}
    assert p.dtype == "fp8" and p.source.endswith("--quantization fp8")
    s = costs.shapes_of(load_model_config("tiny"), "fp8")
    assert {row[0] for row in p.measured["parts"]["shared"]} == {s.shared_params * costs.WEIGHT_BYTES["fp8"]}
