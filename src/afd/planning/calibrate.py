"""The calibration stage of `afd profile`: a short real served trace against the simulator on the fitted parts.

The parts measure afd's kernels and engine steps alone. A served replica spends more: the engine loop between
steps, streaming and detokenizing every token, the HTTP front end parsing and tokenizing each request — on a small
CPU host all of it on the same cores as the steps. `afd profile` starts `afd serve --connector none --replicas 1`
through `afd bench serve`'s harness, sends a short trace, and fits what the simulator must add to hold it
(`Calibration`: per step, per token streamed, per request admitted, per request held; the front end's own time per
request, which queues arrivals one at a time before the engine; latency before the first token) by a pattern
search over the simulated trace. The fit's residuals are kept in the profile.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from afd.bench.workload import Workload
from afd.planning.costs import Shapes
from afd.planning.profile import Calibration, Profile

logger = logging.getLogger(__name__)

PARAMS = ("step_s", "token_s", "request_s", "held_s", "arrival_s", "front_end_s", "prompt_step_s")
# `prompt_step_s` is a GPU's: a step there is launched from the host and runs on the device after, so a small step
# holding prompt tokens lasts its launches; on a CPU the host runs the step itself, and the parts already hold it
CPU_PARAMS = tuple(p for p in PARAMS if p != "prompt_step_s")
# what the fit holds the simulated trace to, per rate
TARGETS = ("request_throughput", "ttft_p50_s", "tpot_p50_s", "e2e_p50_s")
DEFAULT_REQUESTS = 128
# at capacity, where steps hold many prompts; on a GPU a middle rate, where most steps hold one small prompt beside
# the decodes (what `prompt_step_s` is seen in); a low one
GPU_RATES, CPU_RATES = (math.inf, 64.0, 8.0), (math.inf, 8.0)
SEARCH_EVALS = 1200  # simulations the pattern search may run


def default_rates(device: str) -> tuple[float, ...]:
    """The calibration trace's rates on `device` ("cuda" or "cpu")."""
    return GPU_RATES if device == "cuda" else CPU_RATES


@dataclass(frozen=True)
class Trace:
    """The served calibration trace: the workload (mixed lengths, its own seed) and the rates it is sent at."""

    workload: Workload
    rates: tuple[float, ...]


def calibration_trace(requests: int = DEFAULT_REQUESTS, rates: tuple[float, ...] = CPU_RATES) -> Trace:
    """Mixed prompt lengths (median 32, capped at 256), 32 tokens out, seed 1: short enough for a CPU, varied
    enough that steps of every kind (prefill, mixed, decode at small and large batches) occur."""
    w = Workload("mixed", requests, long_len=256, short_len=32, max_tokens=32, seed=1, warmups=8)
    return Trace(w, tuple(rates))


def targets_of(runs: list[dict]) -> dict[tuple[str, str], float]:
    """(rate, metric) → measured value for each calibration target a run has (positive values only)."""
    out = {}
    for run in runs:
        for metric in TARGETS:
            v = run["summary"].get(metric)
            if v:
                out[(str(run["rate"]), metric)] = float(v)
    return out


def stream_cost(runs: list[dict]) -> float:
    """`Calibration.stream_s` from served runs' stages: the slope of the first token's front-to-written time (p50)
    against the streams open (Little's law: request rate x E2E p50) over the runs at finite rates, never negative;
    0 where fewer than two such runs report the stage. Why measured rather than searched: the cost shows only where
    many streams are open, a small share of the trace's TTFT that a search trades against the front end's queue;
    the stage times it directly (on one H200, 0.03-0.05 ms a stream, from 0.25 ms at 8/s to 7 ms with ~160 open)."""
    points = []
    for run in runs:
        s = run["summary"]
        written = s.get("ttft_stages_p50_s", {}).get("front_to_written")
        if math.isfinite(float(run["rate"])) and written is not None and s.get("e2e_p50_s"):
            points.append((s["request_throughput"] * s["e2e_p50_s"], written))
    if len(points) < 2:
        return 0.0
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    return max(sum((x - mx) * (y - my) for x, y in points) / var, 0.0) if var > 0 else 0.0


def loss(measured: dict[tuple[str, str], float], simulated: dict[tuple[str, str], float]) -> float:
    """Sum of squared log ratios simulated / measured over the measured targets (a missing one counts as 10×)."""
    total = 0.0
    for key, m in measured.items():
        s = simulated.get(key)
        total += math.log(s / m) ** 2 if s and s > 0 else math.log(10.0) ** 2
    return total


def pattern_search(
    evaluate: Callable[[dict[str, float]], float],
    start: dict[str, float],
    scales: dict[str, float],
    *,
    max_evals: int = SEARCH_EVALS,
) -> tuple[dict[str, float], float]:
    """Minimize `evaluate` over non-negative parameters: every parameter multiplied and divided by a factor (a zero
    one tried at its scale, a non-zero one at zero too), the best move of the round kept, the factor shrunk when
    none helps. Pure; deterministic."""
    best, best_loss = dict(start), evaluate(start)
    evals, factor = 1, 8.0
    while evals < max_evals and factor > 1.01:
        moves = []
        for name, v in best.items():
            values = [v * factor, v / factor, 0.0] if v > 0 else [scales[name], scales[name] / factor]
            moves += [{**best, name: c} for c in values]
        scored = []
        for trial in moves:
            if evals >= max_evals:
                break
            scored.append((evaluate(trial), trial))
            evals += 1
        value, trial = min(scored, key=lambda x: x[0], default=(math.inf, best))
        if value < best_loss - 1e-12:
            best, best_loss = trial, value
        else:
            factor = math.sqrt(factor)
    return best, best_loss


def simulated_targets(
    profile: Profile, s: Shapes, deployment, trace: Trace, prompt_lens: list[int], cal: dict[str, float]
) -> dict[tuple[str, str], float]:
    """The calibration targets of the trace simulated on `profile` with calibration `cal`."""
    from afd.planning.simulator import simulate_rate

    p = replace(profile, calibration=Calibration(**cal))
    runs = [simulate_rate(deployment, s, p, trace.workload, prompt_lens, rate) for rate in trace.rates]
    return targets_of(runs)


def fit_calibration(
    profile: Profile, s: Shapes, deployment, trace: Trace, measured_runs: list[dict], vocab_size: int
) -> Calibration:
    """The `Calibration` that makes the simulated trace closest to the measured one (`measured_runs`: `afd bench
    serve`'s runs of `trace`), starting from the excess wall time at the highest rate spread over its tokens."""
    prompt_lens = [len(x) for x in trace.workload.prompts(vocab_size)]
    measured = targets_of(measured_runs)
    if not measured:
        raise ValueError("the calibration trace measured nothing to fit")
    zero = dict.fromkeys(PARAMS if profile.on_gpu else CPU_PARAMS, 0.0)
    kernels = simulated_targets(profile, s, deployment, trace, prompt_lens, zero)
    streams = {"stream_s": stream_cost(measured_runs)}
    fastest = str(measured_runs[0]["rate"])
    tokens = sum(trace.workload.max_tokens_of())
    wall_m = trace.workload.num_requests / measured.get((fastest, "request_throughput"), math.inf)
    wall_s = trace.workload.num_requests / kernels.get((fastest, "request_throughput"), math.inf)
    start = {**zero, "token_s": max(wall_m - wall_s, 0.0) / tokens}
    tpot = max(measured.get((fastest, "tpot_p50_s"), 0.01), 1e-4)
    ttft = (
        min(v for (_, m), v in measured.items() if m == "ttft_p50_s")
        if any(m == "ttft_p50_s" for _, m in measured)
        else tpot
    )
    scales = {"step_s": tpot / 10, "token_s": tpot / 200, "request_s": tpot / 10, "held_s": tpot / 1000}
    scales["front_end_s"] = ttft / 4
    scales["prompt_step_s"] = tpot / 2
    # the front end's queue: the TTFT at the highest rate beyond the kernels', as if half the requests waited ahead
    half = max(trace.workload.num_requests / 2, 1.0)
    excess = max(measured.get((fastest, "ttft_p50_s"), 0.0) - kernels.get((fastest, "ttft_p50_s"), 0.0), 0.0)
    queue = excess / half
    scales["arrival_s"] = queue or tpot / 10

    def evaluate(cal: dict[str, float]) -> float:
        return loss(measured, simulated_targets(profile, s, deployment, trace, prompt_lens, cal | streams))

    # from the excess spread over the tokens, then over the steps' fixed cost, then per request: the best end
    starts = [start, {**zero, "step_s": start["token_s"] * 4}, {**zero, "request_s": start["token_s"] * 32}]
    starts.append({**zero, "held_s": start["token_s"] / 4})
    starts = [{**x, "arrival_s": queue / 2} for x in starts]  # the front end's queue taking part of the excess TTFT
    best, best_loss = min(
        (pattern_search(evaluate, x, scales, max_evals=SEARCH_EVALS // len(starts)) for x in starts),
        key=lambda r: r[1],
    )
    fitted = simulated_targets(profile, s, deployment, trace, prompt_lens, best | streams)
    rows = [
        {
            "rate": rate,
            "metric": metric,
            "measured": m,
            "kernels_only": kernels.get((rate, metric)),
            "calibrated": fitted.get((rate, metric)),
        }
        for (rate, metric), m in measured.items()
    ]
    fit = {
        "trace": trace.workload.describe() | {"rates": ["inf" if r == math.inf else r for r in trace.rates]},
        "server": "afd serve --connector none --replicas 1",
        "loss": best_loss,
        "rows": rows,
    }
    return Calibration(**best, **streams, fit=fit)


@dataclass(frozen=True)
class ServedRun:
    """One served run a calibration is fitted to: the deployment it ran on (`afd.planning.deployment.Deployment`),
    its trace, and `afd bench serve`'s runs of it (one per rate)."""

    deployment: object
    trace: Trace
    runs: list[dict]


# where a cost every single fit left at zero is tried first in a joint search
JOINT_SCALES = {"step_s": 1e-3, "token_s": 1e-5, "request_s": 1e-3, "held_s": 1e-6, "arrival_s": 1e-4,
                "front_end_s": 1e-2, "prompt_step_s": 1e-2}  # fmt: skip


def fit_calibration_jointly(profile: Profile, s: Shapes, served: list[ServedRun], vocab_size: int) -> Calibration:
    """The `Calibration` that holds several served runs at once (the sum of their losses): each run's own fit
    first (`fit_calibration`), then the search over the sum from each of their ends, the best kept. Why several:
    one workload does not pin the costs down (fits to short and to long prompts split the same excess between
    per-step, per-request and front-end costs differently), and why from their ends: searched from the usual
    starts, the sum settled where it held both worse than one workload's own fit does."""
    singles = [fit_calibration(profile, s, r.deployment, r.trace, r.runs, vocab_size) for r in served]
    if len(served) == 1:
        return singles[0]
    names = PARAMS if profile.on_gpu else CPU_PARAMS
    streams = {"stream_s": stream_cost([run for r in served for run in r.runs])}
    lens = [[len(x) for x in r.trace.workload.prompts(vocab_size)] for r in served]
    measured = [targets_of(r.runs) for r in served]

    def simulated(cal: dict[str, float]) -> list[dict[tuple[str, str], float]]:
        return [
            simulated_targets(profile, s, r.deployment, r.trace, n, cal | streams)
            for r, n in zip(served, lens, strict=True)
        ]

    def evaluate(cal: dict[str, float]) -> float:
        return sum(loss(m, sim) for m, sim in zip(measured, simulated(cal), strict=True))

    starts = [{n: getattr(c, n) for n in names} for c in singles]
    scales = {n: max(x[n] for x in starts) or JOINT_SCALES[n] for n in names}
    best, best_loss = min(
        (pattern_search(evaluate, x, scales, max_evals=SEARCH_EVALS // len(starts)) for x in starts),
        key=lambda r: r[1],
    )
    rows = []
    kernels = simulated(dict.fromkeys(names, 0.0))
    for i, (m_each, k_each, fitted) in enumerate(zip(measured, kernels, simulated(best), strict=True)):
        for (rate, metric), m in m_each.items():
            rows.append({"workload": f"{i + 1}: {served[i].trace.workload.kind}", "rate": rate, "metric": metric,
                         "measured": m, "kernels_only": k_each.get((rate, metric)),
                         "calibrated": fitted.get((rate, metric))})  # fmt: skip
    fit = {
        "trace": [
            r.trace.workload.describe() | {"rates": ["inf" if x == math.inf else x for x in r.trace.rates]}
            for r in served
        ],  # fmt: skip
        "server": "afd serve --connector none --replicas 1",
        "loss": best_loss,
        "rows": rows,
    }
    return Calibration(**best, **streams, fit=fit)


def calibrate_from_results(profile: Profile, raws: list[dict]) -> Profile:
    """`profile` with its calibration fitted to served runs of the user's own: `raws`, `afd bench serve --json`
    files of `none` R=1 on generated workloads (their rates, their server's token budget and sequence limit; several
    are fitted at once, `fit_calibration_jointly`). The profile's parts stay; what serving added on that machine and
    traffic is fitted as `afd profile` fits its trace."""
    from afd.model.weights import load_model_config
    from afd.planning.compare import workload_of
    from afd.planning.costs import shapes_of
    from afd.planning.deployment import Deployment
    from afd.runtime.limits import DEFAULT_MAX_NUM_SEQS, SMALL_BUDGET

    served = []
    for raw in raws:
        results = raw.get("results") or []
        server = results[0] if results else {}
        if server.get("name") != "none R=1":
            found = server.get("name", "no server")
            raise ValueError(
                f"a calibration needs a run of `none` R=1 (afd bench serve --compare none:R=1), not {found}"
            )
        workload, rates = workload_of(raw)
        limits = server.get("step_limits") or {}
        d = Deployment(
            "none",
            max_num_seqs=int(limits.get("max_num_seqs", DEFAULT_MAX_NUM_SEQS)),
            max_num_batched_tokens=int(limits.get("max_num_batched_tokens", SMALL_BUDGET)),
        )
        served.append(ServedRun(d, Trace(workload, tuple(rates)), server["runs"]))
    config = load_model_config(profile.machine.get("model", "deepseek-v2-lite"))
    cal = fit_calibration_jointly(profile, shapes_of(config, profile.dtype), served, config.vocab_size)
    files = "a served results file" if len(served) == 1 else f"{len(served)} served results files"
    return replace(profile, calibration=cal, source=profile.source + f" (calibrated against {files})")


def format_calibration(cal: Calibration) -> str:
    """The fitted costs, and per target measured / kernels-only / calibrated (the fit's residuals)."""
    lines = [
        f"calibration: {cal.step_s * 1e3:.3f} ms per step, {cal.token_s * 1e3:.3f} ms per token, "
        f"{cal.request_s * 1e3:.3f} ms per request, {cal.held_s * 1e6:.2f} µs per request held per step, "
        f"{cal.arrival_s * 1e3:.3f} ms per request in the front end's queue, "
        f"{cal.front_end_s * 1e3:.1f} ms before the first token, steps holding prompt tokens at least "
        f"{cal.prompt_step_s * 1e3:.2f} ms, {cal.stream_s * 1e6:.1f} µs per stream open before a first token",
        f"{'rate':>6} {'metric':<20} {'measured':>10} {'kernels':>10} {'calibrated':>10} {'error':>7}",
    ]
    for r in cal.fit.get("rows", []):
        k, c, m = r["kernels_only"], r["calibrated"], r["measured"]
        err = f"{abs(c - m) / m * 100:.1f}%" if c is not None else "-"
        ks = f"{k:.4g}" if k is not None else "-"
        cs = f"{c:.4g}" if c is not None else "-"
        where = f"  ({r['workload']})" if r.get("workload") else ""
        lines.append(f"{r['rate']!s:>6} {r['metric']:<20} {m:>10.4g} {ks:>10} {cs:>10} {err:>7}{where}")
    return "\n".join(lines)


def serve_trace(
    model: str,
    dtype: str,
    device: str,
    trace: Trace,
    deployment,
    vocab_size: int,
    max_model_len: int,
    timeout_s: float = 600.0,
    quantization: str | None = None,
) -> list[dict]:
    """Start `afd serve --connector none --replicas 1` with the deployment's step limits (the ones the fit
    simulates), send the trace at each rate through `afd bench serve`'s client, stop the server; its runs."""
    import sys

    from afd.bench.serve_client import Progress, bench_servers

    argv = ["--model", model, "--dtype", dtype, "--device", device, "--max-model-len", str(max_model_len)]
    argv += ["--max-num-seqs", str(deployment.max_num_seqs)]
    argv += ["--max-num-batched-tokens", str(deployment.max_num_batched_tokens)]
    argv += ["--quantization", quantization] if quantization else []
    results = bench_servers(
        [("none R=1", ["--connector", "none", "--replicas", "1"])],
        argv,
        trace.workload,
        list(trace.rates),
        Progress(sys.stderr),
        vocab_size=vocab_size,
        timeout_s=timeout_s,
    )
    return results[0]["runs"]
