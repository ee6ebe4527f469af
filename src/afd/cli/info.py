"""`afd topology` and `afd config`: show a layout, validate a config; both start nothing."""

from __future__ import annotations

import argparse
import json

from afd.cli.input import non_negative_int, rank_count
from afd.config import parse_config
from afd.topology import SyncTopology


def add_info_parsers(sub) -> None:
    """Register `topology` and `config` under `afd`'s sub-commands."""
    p = sub.add_parser("topology", help="show the p2p sync groups and token splits of an A:F layout")
    p.add_argument("--attention", type=rank_count, required=True, help="number of attention ranks (A)")
    p.add_argument("--ffn", type=rank_count, required=True, help="number of FFN ranks (F)")
    p.add_argument("--tokens", type=non_negative_int, help="tokens per attention rank, to show the splits")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_topology)

    p = sub.add_parser("config", help="validate an AFD config and print it resolved (starts nothing)")
    p.add_argument("source", help="a JSON file or a JSON object")
    p.set_defaults(func=cmd_config)


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


def cmd_config(args: argparse.Namespace) -> int:
    print(json.dumps(parse_config(args.source).to_dict(), indent=2))
    return 0
