"""`afd worker`: start one rank by hand (e.g. on another host), as `afd launch` and `afd serve` start theirs."""

from __future__ import annotations

import argparse
import logging
import signal
from pathlib import Path

from afd.cli.args import add_model_arguments, run_spec
from afd.cli.input import (
    UsageError,
    check_cache_fits,
    check_prompts,
    non_negative_int,
    port_number,
    positive_int,
    rank_count,
    read_prompts,
)
from afd.config import parse_config
from afd.distributed import signals
from afd.runtime.link import LinkAddress, parse_address


def add_worker_parser(sub) -> None:
    """Register `worker` under `afd`'s sub-commands."""
    p = sub.add_parser("worker", help="start one rank (by hand, e.g. on another host)")
    add_worker_arguments(p)
    p.set_defaults(func=cmd_worker)


def cmd_worker(args: argparse.Namespace) -> int:
    from afd.runtime.worker import RankJob, exit_now, run_rank

    config = parse_config(args.config if args.config else {}, default_connector=args.connector or "p2p")
    overrides = {
        "connector": args.connector,
        "num_attention_ranks": args.attention,
        "num_ffn_ranks": args.ffn,
        "host": args.host,
        "port": args.port,
    }
    changes = {k: v for k, v in overrides.items() if v is not None}
    if "connector" in changes and changes["connector"] != config.connector:
        changes["connector_extra_config"] = {}  # the other connector's extra keys do not apply
    config = config.replace(**changes) if changes else config
    role = args.role or config.role
    if role is None:
        raise UsageError("the rank's role is unknown; pass --role attention or --role ffn (or set role in the config)")
    size = {"attention": config.num_attention_ranks, "ffn": config.num_ffn_ranks, "replica": args.replicas}[role]
    if args.rank >= size:
        raise UsageError(f"--rank {args.rank} is out of range for {size} {role} rank(s)")
    prompts = read_prompts(args, allow_empty=True)  # a replica may legitimately get no prompt
    if prompts and role == "ffn":
        raise UsageError("prompts go to attention ranks; an FFN rank takes none")
    if prompts and args.serve_address:
        raise UsageError("a rank serving a front end (--serve-address) takes its requests from it, not prompts")
    rejoins = role == "attention" and config.connector == "async" and args.device == "cpu" and args.serve_address
    if args.rejoin and not rejoins:
        raise UsageError("--rejoin restarts a server's async attention rank on CPU (--serve-address); not this rank")
    dtype_given = args.dtype is not None  # an FFN rank without it takes the attention side's at rendezvous
    args.dtype = args.dtype or "float32"
    check_prompts(args.model, prompts, args.device, args.max_new_tokens)
    check_cache_fits(args, prompts)
    job = RankJob(
        config=config,
        role=role,
        role_rank=args.rank,
        spec=run_spec(args, prompts, max_model_len=args.max_model_len, busy_poll=args.busy_poll),
        prompts=tuple(tuple(p) for p in prompts),
        output_path=Path(args.output) if args.output else None,
        run_token=args.run_token,
        local_host=args.bind_host,
        device_index=worker_gpu(args),
        serve_address=args.serve_address,
        num_replicas=args.replicas,
        launcher_pid=args.launcher_pid,
        dtype_given=dtype_given,
        generation=args.rejoin or 0,
    )
    name = f"{role} rank {args.rank}"
    log = logging.getLogger("afd.worker")
    args.signal_watchdog.configure(
        signals.WORKER_SIGNAL_GRACE_S, lambda line: log.warning("%s: %s", name, line), exit_now
    )
    signals.raise_if_signalled()
    try:
        code = run_rank(job)
    except BaseException as exc:  # a rank's failure: one line naming it, then leave without teardown
        signum = getattr(exc, "signum", signal.SIGINT) if isinstance(exc, KeyboardInterrupt) else signals.last_signal()
        if signum is not None:  # also when cleanup turned the interrupt into another error
            log.warning("%s: interrupted by %s", name, signals.signal_name(signum))
            exit_now(128 + signum)
        log.error("%s: error: %s", name, exc)
        exit_now(getattr(exc, "exit_status", 1))  # 2: refused at rendezvous (another run's store, port taken)
    exit_now(code)
    return code


def worker_gpu(args: argparse.Namespace) -> int | None:
    """The local GPU of a CUDA rank, checked before it starts (torchrun's conventions); None on CPU."""
    if args.device != "cuda":
        return None
    import torch

    from afd import env
    from afd.topology import local_gpu_index

    try:
        return local_gpu_index(args.device_index, env.local_rank(), env.visible_devices(), torch.cuda.device_count())
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def serve_address(text: str) -> LinkAddress:
    """`--serve-address HOST:PORT` (an IPv6 host in brackets), a Unix socket path, or @NAME (an abstract one)."""
    try:
        return parse_address(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_worker_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="AFD config (file or JSON); the flags below override its keys")
    p.add_argument(
        "--role",
        choices=["attention", "ffn", "replica"],
        help="this rank's role (overrides the config's); replica: the whole model in one process (connector none)",
    )
    p.add_argument("--rank", type=non_negative_int, required=True, help="role rank")
    p.add_argument("--replicas", type=rank_count, default=1, help="--role replica: replicas of the run")
    p.add_argument(
        "--serve-address",
        type=serve_address,
        help="HOST:PORT, socket path or @NAME (abstract socket) of an afd serve front end: attention ranks and "
        "replicas serve its requests instead of a prompts file (set by afd serve; the link is keyed with AFD_SECRET)",
    )
    p.add_argument("--max-model-len", type=positive_int, help="positions a request may take (default: the model's)")
    p.add_argument(
        "--busy-poll", action="store_true", help="with --serve-address: poll the link without sleeping while idle"
    )
    p.add_argument("--connector", choices=["p2p", "async"], help="overrides the config's connector")
    p.add_argument("--attention", type=rank_count, help="num_attention_ranks (overrides the config's)")
    p.add_argument("--ffn", type=rank_count, help="num_ffn_ranks (overrides the config's)")
    p.add_argument("--host", help="host of the world store (overrides the config's)")
    p.add_argument("--port", type=port_number, help="port of the world store (overrides the config's)")
    add_model_arguments(p, prompts_required=False)  # prompts: attention ranks only, this replica's
    for action in p._actions:  # an FFN rank's dtype comes from the attention side unless given
        if action.dest == "dtype":
            action.default = None
            action.help = (
                "weights dtype (default: float32; an FFN rank takes the attention ranks' dtype at rendezvous, and "
                "refuses to start when given another one)"
            )
    p.add_argument("--output", help="attention ranks: write this replica's outputs (JSON) here")
    p.add_argument("--bind-host", help="the address this rank binds to (default: derived from the config's host)")
    p.add_argument(
        "--device-index",
        type=non_negative_int,
        help="CUDA: this rank's local GPU (default: LOCAL_RANK, else the only visible GPU; afd launch sets it)",
    )
    p.add_argument("--run-token", default="afd", help="names this run's shared resources (set by afd launch)")
    p.add_argument(
        "--rejoin",
        type=positive_int,
        metavar="GENERATION",
        help="an async attention replica on CPU restarted alone: join the running world as this restart (set by "
        "afd serve)",
    )
    p.add_argument(
        "--launcher-pid",
        type=positive_int,
        help="the afd launch or afd serve that started this rank (set by them): the rank is a client of its world "
        "store and stops when it is gone",
    )
