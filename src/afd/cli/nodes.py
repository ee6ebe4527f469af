"""`afd launch --nnodes N --node-rank K --master-addr HOST --master-port PORT`: one command per host, as torchrun.

Only builds and checks the node's place (`afd.runtime.nodes.NodeSpec`); every refusal is one sentence, exit 2."""

from __future__ import annotations

import argparse

from afd import env
from afd.cli.input import UsageError, non_negative_int, port_number, positive_int


def add_node_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of a run over several hosts (torchrun's names)."""
    p.add_argument("--nnodes", type=positive_int, default=1, help="hosts of the run, each running this command")
    p.add_argument("--node-rank", type=non_negative_int, default=0, help="this host's place, 0 to --nnodes - 1")
    p.add_argument(
        "--nproc-per-node",
        type=positive_int,
        help="ranks per host (default: the world's A + F over --nnodes); node K starts world ranks K*P to K*P+P-1",
    )
    p.add_argument(
        "--master-addr",
        help="node 0's address: it hosts the world store there (default: the config's host, 127.0.0.1)",
    )
    p.add_argument("--master-port", type=port_number, help="the world store's port on node 0 (the same on every node)")


def is_multi_node(args: argparse.Namespace) -> bool:
    return getattr(args, "nnodes", 1) > 1


def check_node_flags(args: argparse.Namespace, world_size: int) -> None:
    """Refuse, in one sentence, a node command that cannot be part of a run (before anything starts)."""
    from afd.runtime.nodes import split_problem

    if args.port is not None and args.master_port is not None:
        raise UsageError("--port and --master-port both name the world store's port; pass --master-port alone")
    problem = split_problem(args.nnodes, args.node_rank, args.nproc_per_node, world_size)
    if problem:
        raise UsageError(problem)
    if args.nnodes > 1 and args.master_port is None:
        raise UsageError(f"--nnodes {args.nnodes} needs --master-port, the world store's port on node 0")
    if args.nnodes > 1 and not env.secret():
        raise UsageError(
            f"--nnodes {args.nnodes} needs AFD_SECRET in the environment, the same value on every node "
            "(e.g. export AFD_SECRET=$(openssl rand -hex 16))"
        )


def node_spec(args: argparse.Namespace, host: str, port: int, world_size: int):
    """This host's `NodeSpec` (the store at `host:port`, from --master-addr/--master-port or the config)."""
    from afd.runtime.nodes import NodeSpec

    return NodeSpec(
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        nproc_per_node=args.nproc_per_node or world_size // args.nnodes,
        master_addr=host,
        master_port=port,
    )
