"""A simulation held against a measurement: the workload and rates of an `afd bench serve` results JSON, the
per-metric relative error of the simulated runs against the measured ones."""

from __future__ import annotations

import math

from afd.bench.workload import Workload

METRICS = ("request_throughput", "output_tok_s", "ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "e2e_p50_s")
# shown beside the metrics, not judged by the tolerance: where a gap comes from (the steps' own cost, or their number)
STEP_METRICS = ("steps_per_replica", "mean_step_s", "prompt_step_share", "mean_prompt_step_s", "mean_decode_step_s")


def step_metrics(summary: dict) -> dict[str, float]:
    """Steps per replica and their mean time, from a run's `steps` (a server's StepClock, or the simulator's);
    where the run split them, the share of steps holding a prompt token and the mean time of those and of the
    others (decode steps)."""
    steps = summary.get("steps") or {}
    count = steps.get("count")
    if not count:
        return {}
    out = {"steps_per_replica": count / max(1, steps.get("replicas", 1)), "mean_step_s": steps["device_s"] / count}
    if "prompt_count" not in steps:  # a results file from before the split
        return out
    prompt, prompt_s = steps["prompt_count"], steps["prompt_device_s"]
    out["prompt_step_share"] = prompt / count
    if prompt:
        out["mean_prompt_step_s"] = prompt_s / prompt
    if count > prompt:
        out["mean_decode_step_s"] = (steps["device_s"] - prompt_s) / (count - prompt)
    return out


def workload_of(raw: dict) -> tuple[Workload, list[float]]:
    """The `Workload` and rates an `afd bench serve --json` file was measured with (generated workloads only)."""
    w = dict(raw["workload"])
    if w.get("kind") == "trace":
        raise ValueError("a results file measured on a trace: simulate it with --trace instead")
    rates = [math.inf if r == "inf" else float(r) for r in w.pop("rates")]
    w.pop("timed", None)
    return Workload(**{k: v for k, v in w.items() if k in Workload.__dataclass_fields__}), rates


def server_of(name: str) -> tuple[str, dict[str, int]]:
    """`afd bench serve`'s server label (`none R=2`, `async A=2,F=1,U=2`, `async+sa A=1,F=1`) -> (connector,
    {"R"|"A"|"F"|"U": n})."""
    connector, _, keys = name.partition(" ")
    pairs = (k.partition("=") for k in keys.split(",") if k)
    return connector.partition("+")[0], {k: int(v) for k, _, v in pairs}


def result_for(raw: dict, connector: str, attention: int, ffn: int, replicas: int, ubatches: int) -> dict:
    """The server of a results file that ran the simulated deployment (the only one, when it holds one); a
    ValueError naming those it holds when none did."""
    results = raw["results"]
    if len(results) == 1:
        return results[0]
    want = {"R": replicas} if connector == "none" else {"A": attention, "F": ffn, "U": ubatches}
    for result in results:
        got_connector, keys = server_of(result["name"])
        if got_connector == connector and all(keys.get(k, 1) == v for k, v in want.items()):
            return result
    names = ", ".join(r["name"] for r in results)
    raise ValueError(f"it holds {names}, none of them the simulated {connector} deployment")


def errors(measured: dict, simulated: dict) -> list[dict]:
    """One row per (rate, metric): measured, simulated, relative error (None where either is missing)."""
    rows = []
    sim_runs = {str(r["rate"]): r["summary"] for r in simulated["runs"]}
    for run in measured["runs"]:
        sim = sim_runs.get(str(math.inf if run["rate"] == "inf" else float(run["rate"])))
        if sim is None:
            continue
        m_steps, s_steps = step_metrics(run["summary"]), step_metrics(sim)
        for metric in METRICS + STEP_METRICS:
            judged = metric in METRICS
            m = run["summary"].get(metric) if judged else m_steps.get(metric)
            s = sim.get(metric) if judged else s_steps.get(metric)
            if not judged and m is None:
                continue  # a server that did not time its steps (CPU)
            err = abs(s - m) / m if m and s is not None else None
            rows.append({"rate": run["rate"], "metric": metric, "measured": m, "simulated": s, "error": err,
                         "judged": judged})  # fmt: skip
    return rows


def beyond(rows: list[dict], tolerance: float) -> bool:
    """Whether a judged metric's error exceeds `tolerance`."""
    return any(r["judged"] and r["error"] is not None and r["error"] > tolerance for r in rows)


def format_errors(rows: list[dict], tolerance: float) -> str:
    lines = [f"{'rate':>6} {'metric':<20} {'measured':>12} {'simulated':>12} {'error':>8}"]
    for r in rows:
        err = "-" if r["error"] is None else f"{r['error'] * 100:.1f}%"
        flag = " !" if r["judged"] and r["error"] is not None and r["error"] > tolerance else ""
        flag = flag if r["judged"] else "   (not judged: where the gap comes from)"
        m = "-" if r["measured"] is None else f"{r['measured']:.4g}"
        s = "-" if r["simulated"] is None else f"{r['simulated']:.4g}"
        lines.append(f"{r['rate']!s:>6} {r['metric']:<20} {m:>12} {s:>12} {err:>8}{flag}")
    judged = [r["error"] for r in rows if r["judged"] and r["error"] is not None]
    within = sum(err <= tolerance for err in judged)
    worst = max(judged, default=0.0)
    lines.append(
        f"{within} of {len(judged)} judged metrics within {tolerance * 100:g}%; worst error {worst * 100:.1f}%"
    )
    return "\n".join(lines)
