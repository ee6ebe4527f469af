"""Plot `afd plan --json` files: output tokens/s per GPU against the GPU count, the best AFD layout beside the best
non-AFD one for each model and weight format (`afd.planning.plan.plot_plans`). Needs matplotlib (afd[bench]).

    python scripts/plot_plans.py OUT.png PLAN.json [PLAN.json ...]
"""

from __future__ import annotations

import argparse
import json

from afd.planning.plan import plot_plans


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="the PNG to write")
    p.add_argument("plans", nargs="+", help="afd plan --json files")
    args = p.parse_args()
    plot_plans([json.load(open(path)) for path in args.plans], args.out)


if __name__ == "__main__":
    main()
