"""The `afd` command line. It only builds validated objects and calls the library.

Bad input is one sentence on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence

from afd.config import ConfigError, parse_config
from afd.topology import SyncTopology

EXIT_USAGE = 2


class UsageError(Exception):
    """Bad input from the user: printed as one sentence, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"afd: error: {message}\n")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return value


# ---------------------------------------------------------------- afd topology
def describe_topology(topo: SyncTopology, num_tokens: int | None) -> str:
    lines = [
        f"{topo.num_attention}A{topo.num_ffn}F: {topo.num_groups} sync group(s), G = min(A, F)",
        "world ranks (FFN first): "
        + " ".join(f"F{f}={topo.world_rank('ffn', f)}" for f in range(topo.num_ffn))
        + " "
        + " ".join(f"A{a}={topo.world_rank('attention', a)}" for a in range(topo.num_attention)),
    ]
    for g in topo.groups:
        ffn = ", ".join(f"F{f}" for f in g.ffn_ranks)
        attn = ", ".join(f"A{a}" for a in g.attn_ranks)
        hub = f"hub {'F' if g.hub_role == 'ffn' else 'A'}"
        hub += str(g.ffn_ranks[0] if g.hub_role == "ffn" else g.attn_ranks[0])
        lines.append(f"  group {g.index}: [{attn}] <-> [{ffn}]   ({hub})")
    if num_tokens is not None:
        lines.append(f"split of {num_tokens} tokens per attention rank:")
        for a in range(topo.num_attention):
            members = topo.group("attention", a).ffn_ranks
            parts = ", ".join(f"F{f}: {n}" for f, n in zip(members, topo.splits(a, num_tokens), strict=True))
            lines.append(f"  A{a} -> {parts}")
    return "\n".join(lines)


def cmd_topology(args: argparse.Namespace) -> int:
    topo = SyncTopology(args.attention, args.ffn)
    if args.json:
        print(json.dumps(topo.to_json(args.tokens)))
    else:
        print(describe_topology(topo, args.tokens))
    return 0


# ---------------------------------------------------------------- afd config
def cmd_config(args: argparse.Namespace) -> int:
    print(json.dumps(parse_config(args.source).to_dict(), indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="afd", description="Attention-FFN disaggregated serving of DeepSeek-V2/V3 MoE models.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("topology", help="show the p2p sync groups and token splits of an A:F layout")
    p.add_argument("--attention", type=positive_int, required=True, help="number of attention ranks (A)")
    p.add_argument("--ffn", type=positive_int, required=True, help="number of FFN ranks (F)")
    p.add_argument("--tokens", type=non_negative_int, help="tokens per attention rank, to show the splits")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_topology)

    p = sub.add_parser("config", help="validate an AFD config and print it resolved (starts nothing)")
    p.add_argument("source", help="a JSON file or a JSON object")
    p.set_defaults(func=cmd_config)
    for register in EXTRA_COMMANDS:
        register(sub)
    return parser


EXTRA_COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = []


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    try:
        return args.func(args)
    except (UsageError, ConfigError) as exc:
        print(f"afd: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
