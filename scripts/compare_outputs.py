"""Compare `afd generate --json` outputs against a reference one: greedy tokens and max |Δ logprob|.

    python scripts/compare_outputs.py REF.json OTHER.json [OTHER.json ...]

Exit status 0 only if every file's tokens equal the reference's and every logprob is within 1e-4.
"""

import json
import sys


def load(path: str) -> list[dict]:
    with open(path) as f:
        return json.load(f)["outputs"]


def main(ref_path: str, *others: str) -> int:
    ref = load(ref_path)
    ok = True
    for path in others:
        try:
            got = load(path)
        except (OSError, json.JSONDecodeError, KeyError) as exc:
            print(f"{path}: no output ({exc})")
            ok = False
            continue
        same = [g["token_ids"] == r["token_ids"] for g, r in zip(got, ref, strict=True)]
        diffs = [
            abs(a - b)
            for g, r in zip(got, ref, strict=True)
            for key in ("logprobs", "prompt_logprobs")
            for a, b in zip(g.get(key) or [], r.get(key) or [], strict=True)
            if a is not None
        ]
        worst = max(diffs, default=0.0)
        match = all(same) and worst <= 1e-4
        ok &= match
        verdict = "OK" if match else "FAIL"
        print(f"{path}: tokens equal {sum(same)}/{len(same)}, max |Δ logprob| {worst:.2e} -> {verdict}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:]))
