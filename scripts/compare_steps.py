"""Two `afd bench step --json` results side by side (e.g. bf16 and `--quantization fp8` of the same model, from
`bash scripts/gpu_bench.sh step-fp8`): per decode point the graph ms of each, their ratio, and the second run's
floor and graph/floor; per prefill point the ms of each and their ratio.

    python3 scripts/compare_steps.py BASE.json OTHER.json
"""
# ruff: noqa: T201  (a script that prints its results)

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _label(result: dict) -> str:
    return f"{result['dtype']}{'+fp8' if result.get('fp8_weights') else ''}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or a == 0 else f"{b / a:.2f}x"


def compare(base: dict, other: dict) -> str:
    """The side-by-side table of two bench-step results (points matched by batch and context)."""
    a, b = _label(base), _label(other)
    lines = [f"{base['model']} on {base['device']}: {a} (base) vs {b}", f"{'decode':<8} {'batch':>5} {'context':>7} "
             f"{a + ' ms':>12} {b + ' ms':>12} {'ratio':>7} {b + ' floor':>14} {'graph/floor':>11}"]  # fmt: skip
    theirs = {(r["batch"], r["context"]): r for r in other["decode"]}
    for r in base["decode"]:
        o = theirs.get((r["batch"], r["context"]))
        if o is None:
            continue
        over = "-" if o.get("graph_over_floor") is None else f"{o['graph_over_floor']:.2f}x"
        lines.append(
            f"{'':<8} {r['batch']:>5} {r['context']:>7} {_ms(r['graph_ms']):>12} {_ms(o['graph_ms']):>12} "
            f"{_ratio(r['graph_ms'], o['graph_ms']):>7} {_ms(o['floor_ms']):>14} {over:>11}"
        )
    theirs = {(r["batch"], r["context"]): r for r in other["prefill"]}
    if base["prefill"]:
        lines.append(f"{'prefill':<8} {'batch':>5} {'context':>7} {a + ' ms':>12} {b + ' ms':>12} {'ratio':>7}")
    for r in base["prefill"]:
        o = theirs.get((r["batch"], r["context"]))
        if o is not None:
            lines.append(
                f"{'':<8} {r['batch']:>5} {r['context']:>7} {_ms(r['ms']):>12} {_ms(o['ms']):>12} "
                f"{_ratio(r['ms'], o['ms']):>7}"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", type=Path)
    parser.add_argument("other", type=Path)
    args = parser.parse_args()
    print(compare(json.loads(args.base.read_text()), json.loads(args.other.read_text())))


if __name__ == "__main__":
    main()
