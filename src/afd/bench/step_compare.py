"""Two `afd bench step` results side by side: a 16-bit model and the same model in FP8 (`afd bench step
--quantization fp8` runs both), or any two saved `--json` results (`scripts/compare_steps.py`). Per decode point the
graph ms of each, their ratio, and the second's floor and graph/floor; per prefill point the ms of each and their
ratio. Points are matched by (batch, context)."""

from __future__ import annotations

from afd.bench.step import ms_text


def _label(result: dict) -> str:
    return f"{result['dtype']}{'+fp8' if result.get('fp8_weights') else ''}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or a == 0 else f"{b / a:.2f}x"


def format_step_comparison(base: dict, other: dict) -> str:
    """The side-by-side table of two bench-step results, `other` against `base`."""
    a, b = _label(base), _label(other)
    lines = [
        f"{base['model']} on {base['device']}: {a} (base) vs {b}",
        f"{'decode':<8} {'batch':>5} {'context':>7} {a + ' ms':>12} {b + ' ms':>12} {'ratio':>7} "
        f"{b + ' floor':>14} {'graph/floor':>11}",
    ]
    theirs = {(r["batch"], r["context"]): r for r in other["decode"]}
    for r in base["decode"]:
        o = theirs.get((r["batch"], r["context"]))
        if o is None:
            continue
        over = "-" if o.get("graph_over_floor") is None else f"{o['graph_over_floor']:.2f}x"
        mine, yours = r["graph_ms"] or r["eager_ms"], o["graph_ms"] or o["eager_ms"]  # eager where no graphs (CPU)
        lines.append(
            f"{'':<8} {r['batch']:>5} {r['context']:>7} {ms_text(mine):>12} {ms_text(yours):>12} "
            f"{_ratio(mine, yours):>7} {ms_text(o['floor_ms']):>14} {over:>11}"
        )
    theirs = {(r["batch"], r["context"]): r for r in other["prefill"]}
    if base["prefill"]:
        lines.append(f"{'prefill':<8} {'batch':>5} {'context':>7} {a + ' ms':>12} {b + ' ms':>12} {'ratio':>7}")
    for r in base["prefill"]:
        o = theirs.get((r["batch"], r["context"]))
        if o is not None:
            lines.append(
                f"{'':<8} {r['batch']:>5} {r['context']:>7} {ms_text(r['ms']):>12} {ms_text(o['ms']):>12} "
                f"{_ratio(r['ms'], o['ms']):>7}"
            )
    return "\n".join(lines)
