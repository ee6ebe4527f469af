"""Two `afd bench step --json` results side by side (`afd.bench.step_compare`): per decode point the graph ms of
each, their ratio, and the second run's floor and graph/floor; per prefill point the ms of each and their ratio.
`afd bench step --quantization fp8` prints the same table for its own two runs.

    python3 scripts/compare_steps.py BASE.json OTHER.json
"""
# ruff: noqa: T201  (a script that prints its results)

from __future__ import annotations

import argparse
import json
from pathlib import Path

from afd.bench.step_compare import format_step_comparison


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", type=Path)
    parser.add_argument("other", type=Path)
    args = parser.parse_args()
    print(format_step_comparison(json.loads(args.base.read_text()), json.loads(args.other.read_text())))


if __name__ == "__main__":
    main()
