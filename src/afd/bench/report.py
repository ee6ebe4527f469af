"""What `afd bench serve` shows: the table, the SLO-compliant throughput, the raw JSON and the plot.

`results` throughout: one dict per server config (or the engine alone), `{"name", "runs"}`, with one run
per rate, `{"rate", "summary", "requests"}` (`afd.bench.serve_client`).
"""

from __future__ import annotations

import math
from pathlib import Path

from afd.bench.serve_client import QUANTILES, format_rate

PLOT_PANELS = (("ttft", "TTFT"), ("tpot", "time per output token"), ("e2e", "end-to-end latency"))
# A capacity run (rate inf) shorter than this is a warning, not a ranking: 64 requests, about a second of load on
# an H200 pair, gave the same servers up to ±25% apart between runs (docs/performance.md); 512 did not.
SHORT_CAPACITY_RUN_S = 5.0


def short_capacity_note(results: list[dict]) -> str | None:
    """One line when a run at rate inf lasted under `SHORT_CAPACITY_RUN_S` (None otherwise)."""
    walls = [r["summary"].get("wall_s") for res in results for r in res["runs"] if math.isinf(r["rate"])]
    walls = [w for w in walls if w is not None]
    if not walls or min(walls) >= SHORT_CAPACITY_RUN_S:
        return None
    return (
        f"note: the shortest run at rate inf lasted {min(walls):.1f} s; capacity measured over so short a load can "
        f"differ by tens of percent between identical runs: raise --requests until each lasts "
        f"{SHORT_CAPACITY_RUN_S:g} s or more before ranking servers"
    )


def slo_throughput(runs: list[dict], slo_ttft_s: float) -> float | None:
    """The highest rate whose p90 TTFT is within the SLO and whose every request succeeded; None if none is."""
    good = [r["rate"] for r in runs if r["summary"]["errors"] == 0 and r["summary"]["ttft_p90_s"] <= slo_ttft_s]
    return max(good) if good else None


def slo_summary(runs: list[dict], slo_ttft_s: float) -> dict:
    """The SLO-compliant rate and what was measured at it (requests/s and output tokens/s served)."""
    best = slo_throughput(runs, slo_ttft_s)
    at = next((r["summary"] for r in runs if r["rate"] == best), None) if best is not None else None
    return {
        "slo_ttft_s": slo_ttft_s,
        "rate": best,
        "request_throughput": at["request_throughput"] if at else None,
        "output_tok_s": at["output_tok_s"] if at else None,
    }


def strict_json(value):
    """`value` with infinite floats (the rate `inf`) as the string "inf": JSON has no infinity."""
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [strict_json(v) for v in value]
    return value


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}ms"


LATENCY_COLUMNS = [(name, q) for name in ("ttft", "tpot", "e2e") for q in QUANTILES]


def format_table(results: list[dict], slo_ttft_s: float) -> str:
    """One row per (server config, rate), then the SLO-compliant throughput of each config."""
    latency = "".join(f" {f'{n.upper()} p{q}' if q == QUANTILES[0] else f'p{q}':>8}" for n, q in LATENCY_COLUMNS)
    head = f"{'server':<18} {'rate':>8} {'ok':>5} {'err':>4} {'req/s':>7} {'out tok/s':>10}{latency}"
    lines = [head, "-" * len(head)]
    for res in results:
        for run in res["runs"]:
            s = run["summary"]
            cells = "".join(f" {_ms(s[f'{n}_p{q}_s']):>8}" for n, q in LATENCY_COLUMNS)
            lines.append(
                f"{res['name']:<18} {format_rate(run['rate']):>8} {s['completed']:>5} {s['errors']:>4} "
                f"{s['request_throughput']:>7.2f} {s['output_tok_s']:>10.1f}{cells}"
            )
    lines.append("-" * len(head))
    for res in results:
        slo = slo_summary(res["runs"], slo_ttft_s)
        if slo["rate"] is None:
            text = f"none of the rates (p90 TTFT over {slo_ttft_s:g} s, or errors)"
        else:
            text = (
                f"{format_rate(slo['rate'])} ({slo['request_throughput']:.2f} req/s, "
                f"{slo['output_tok_s']:.1f} output tok/s served)"
            )
        lines.append(f"{res['name']}: SLO-compliant throughput (p90 TTFT <= {slo_ttft_s:g} s): {text}")
    lines += steps_lines(results)
    note = short_capacity_note(results)
    return "\n".join([*lines, note] if note else lines)


def steps_lines(results: list[dict]) -> list[str]:
    """Per run whose server timed its steps (CUDA): the wall time beside the device time of the steps it ran, per
    replica, their ratio (1.0: the device never waited between steps), and the part of the wall time the device
    idled between steps while the replica had work (the rest of the gap lies outside the engine: requests
    reaching it, answers leaving it)."""
    lines = []
    for res in results:
        for run in res["runs"]:
            steps, wall = run["summary"].get("steps"), run["summary"].get("wall_s")
            if not steps or not wall:
                continue
            per_replica = steps["device_s"] / max(1, steps["replicas"])
            idle = steps.get("idle_s", 0.0) / max(1, steps["replicas"])
            lines.append(
                f"{res['name']} at {format_rate(run['rate'])}: wall {wall:.2f} s, its {steps['count']} steps "
                f"{per_replica:.2f} s of device time per replica: wall/steps {wall / per_replica:.2f}x; the device "
                f"idled {idle:.2f} s between steps"
            )
    return lines


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed (it comes with the optional extra `afd[bench]`)."""


def require_matplotlib() -> None:
    """Raise PlotUnavailable, in one sentence, unless matplotlib can be imported (checked before any run)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotUnavailable("--plot needs matplotlib; install it with pip install 'afd[bench]'") from None


def pyplot():
    """matplotlib's pyplot drawing into files only (no display needed); PlotUnavailable without matplotlib."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_results(results: list[dict], path: str | Path, slo_ttft_s: float, title: str = "") -> None:
    """Latency against request rate, one line per server config: p50 (solid) and p90 (dashed) of TTFT, time per
    output token and end-to-end latency, with the TTFT SLO drawn. A rate of inf has no place on the axis and
    is left out."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(PLOT_PANELS), figsize=(5 * len(PLOT_PANELS), 4), squeeze=False)
    for ax, (key, label) in zip(axes[0], PLOT_PANELS, strict=True):
        for i, res in enumerate(results):
            runs = sorted((r for r in res["runs"] if math.isfinite(r["rate"])), key=lambda r: r["rate"])
            color = f"C{i % 10}"
            for q, style in ((50, "-"), (90, "--")):
                points = [(r["rate"], r["summary"][f"{key}_p{q}_s"]) for r in runs]
                points = [(x, y) for x, y in points if y is not None]
                if points:
                    xs, ys = zip(*points, strict=True)
                    ax.plot(xs, ys, style, marker="o", color=color, label=f"{res['name']} p{q}")
        if key == "ttft":
            ax.axhline(slo_ttft_s, color="grey", linestyle=":", label=f"SLO {slo_ttft_s:g} s")
        ax.set_ylim(bottom=0)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{label} (s)")
        ax.set_title(label)
        ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
