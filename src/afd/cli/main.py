"""The `afd` command line. It only builds validated objects and calls the library.

Bad input is one sentence on stderr and exit status 2, never a traceback. A signal (Ctrl-C, SIGTERM,
SIGHUP) ends any command with one line and exit status 128 + the signal number, as shells expect.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from afd.cli import bench as cli_bench
from afd.cli import serve as cli_serve
from afd.cli.args import (
    add_model_arguments,
    add_run_arguments,
    add_skip_resource_check,
    cache_options,
    check_resources,
    launch_config,
    run_spec,
    sampling_params,
    shared_experts_keys,
)
from afd.cli.input import (
    UsageError,
    batched_tokens,
    check_cache_fits,
    check_prompts,
    choice_list,
    connector_list,
    non_negative_int,
    port_number,
    positive_int,
    rank_count,
    read_prompts,
    size_list,
)
from afd.config import InputError, parse_config
from afd.distributed import signals
from afd.runtime.link import LinkAddress, parse_address
from afd.topology import SyncTopology

if TYPE_CHECKING:
    pass

EXIT_USAGE = 2


class _HelpFormatter(argparse.HelpFormatter):
    """Every flag's help ends with its default, when it has one worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        hidden = default is None or default is False or default == argparse.SUPPRESS  # 0 is shown, False is not
        if action.option_strings and "%(default)" not in text and not hidden:
            text += " (default: %(default)s)"
        return text


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"afd: error: {message}\n")


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


# ---------------------------------------------------------------- afd generate
def run_generate(args: argparse.Namespace) -> tuple[list, dict]:
    prompts = read_prompts(args)
    model_config = check_prompts(args.model, prompts, args.device, args.max_new_tokens)
    check_cache_fits(args, prompts)
    shared_experts_keys(args.connector, args.shared_experts)  # refused in one sentence before anything starts
    if args.connector == "none":
        if getattr(args, "launch", False):
            raise UsageError("afd launch needs --connector p2p or --connector async")
        if (args.attention, args.ffn) != (1, 1):
            raise UsageError("--attention/--ffn need a connector; pass --connector p2p or --connector async")
        check_resources(
            args,
            model_config,
            connector="none",
            prompts=prompts,
            max_new_tokens=args.max_new_tokens,
            gate_on_attention=not args.gate_on_ffn,
        )
        from afd.engine.generate import generate

        signals.raise_if_signalled()
        outputs = generate(
            args.model,
            prompts,
            max_new_tokens=args.max_new_tokens,
            dtype=args.dtype,
            device=args.device,
            seed=args.seed,
            prompt_logprobs=args.prompt_logprobs,
            gate_on_attention=not args.gate_on_ffn,
            max_num_batched_tokens=args.max_num_batched_tokens,
            cache=cache_options(args),
            sampling=sampling_params(args),
            enforce_eager=args.enforce_eager,
        )
        return outputs, {}
    from afd.runtime.launch import launch

    config = launch_config(
        args.config,
        args.connector,
        port=args.port,
        shared_experts=args.shared_experts,
        num_attention_ranks=args.attention,
        num_ffn_ranks=args.ffn,
        compute_gate_on_attention=not args.gate_on_ffn,
    )
    check_resources(
        args,
        model_config,
        connector=args.connector,
        num_attention=args.attention,
        num_ffn=args.ffn,
        prompts=prompts,
        max_new_tokens=args.max_new_tokens,
        gate_on_attention=not args.gate_on_ffn,
    )
    signals.raise_if_signalled()
    return launch(config, run_spec(args, prompts, timeout_s=args.timeout), prompts)


def output_json(output, with_prompt_logprobs: bool) -> dict:
    """The public output object; `prompt_logprobs` only when it was asked for."""
    out = output.to_json()
    if not with_prompt_logprobs:
        out.pop("prompt_logprobs")
    return out


def cmd_generate(args: argparse.Namespace) -> int:
    outputs, _ = run_generate(args)
    if args.json:
        print(json.dumps({"outputs": [output_json(o, args.prompt_logprobs) for o in outputs]}))
    else:
        for i, out in enumerate(outputs):
            print(f"[{i}] {out.prompt_ids} -> {out.token_ids}")
    return 0


# ---------------------------------------------------------------- afd worker
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
    check_prompts(args.model, prompts, args.device, args.max_new_tokens)
    check_cache_fits(args, prompts)
    job = RankJob(
        config=config,
        role=role,
        role_rank=args.rank,
        spec=run_spec(args, prompts, max_model_len=args.max_model_len),
        prompts=tuple(tuple(p) for p in prompts),
        output_path=Path(args.output) if args.output else None,
        run_token=args.run_token,
        local_host=args.bind_host,
        device_index=worker_gpu(args),
        serve_address=args.serve_address,
        num_replicas=args.replicas,
    )
    name = f"{role} rank {args.rank}"
    log = logging.getLogger("afd.worker")
    watchdog.configure(signals.WORKER_SIGNAL_GRACE_S, lambda line: log.warning("%s: %s", name, line), exit_now)
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
    p.add_argument("--connector", choices=["p2p", "async"], help="overrides the config's connector")
    p.add_argument("--attention", type=rank_count, help="num_attention_ranks (overrides the config's)")
    p.add_argument("--ffn", type=rank_count, help="num_ffn_ranks (overrides the config's)")
    p.add_argument("--host", help="host of the world store (overrides the config's)")
    p.add_argument("--port", type=port_number, help="port of the world store (overrides the config's)")
    add_model_arguments(p, prompts_required=False)  # prompts: attention ranks only, this replica's
    p.add_argument("--output", help="attention ranks: write this replica's outputs (JSON) here")
    p.add_argument("--bind-host", help="the address this rank binds to (default: derived from the config's host)")
    p.add_argument(
        "--device-index",
        type=non_negative_int,
        help="CUDA: this rank's local GPU (default: LOCAL_RANK, else the only visible GPU; afd launch sets it)",
    )
    p.add_argument("--run-token", default="afd", help="names this run's shared resources (set by afd launch)")


# ---------------------------------------------------------------- afd demo
def check_launched_runs(args: argparse.Namespace, model_config, connectors: tuple[str, ...], **lengths) -> None:
    """The demo and the bench run the single-process reference and then each connector: check them all."""
    check_resources(args, model_config, connector="none", **lengths)
    for connector in connectors:
        check_resources(
            args,
            model_config,
            connector=connector,
            num_attention=args.attention,
            num_ffn=args.ffn,
            **lengths,
        )


def cmd_demo(args: argparse.Namespace) -> int:
    from afd.bench.demo import DEMO_LENGTHS, format_table, run_demo

    model_config = check_prompts(args.model, [[0] * n for n in DEMO_LENGTHS], args.device, args.max_new_tokens)
    check_launched_runs(
        args,
        model_config,
        args.connectors,
        prompts=[[0] * n for n in DEMO_LENGTHS],
        max_new_tokens=args.max_new_tokens,
    )

    def progress(msg: str) -> None:
        print(f"[afd demo] {msg}", file=sys.stderr, flush=True)

    signals.raise_if_signalled()
    reference, runs, ok = run_demo(
        model=args.model,
        num_attn=args.attention,
        num_ffn=args.ffn,
        max_new_tokens=args.max_new_tokens,
        device=args.device,
        connectors=args.connectors,
        progress=progress,
    )
    print(format_table(reference, runs))
    print("every connector matches the reference" if ok else "MISMATCH: a connector differs from the reference")
    return 0 if ok else 1


# ---------------------------------------------------------------- afd bench
def cmd_bench(args: argparse.Namespace) -> int:
    from afd.bench.offline import Workload, format_bench, run_bench
    from afd.config import ubatch_keys

    workload = Workload(args.requests, args.long_len, args.short_len, args.max_new_tokens)
    for connector in args.connectors:  # what a connector's config would refuse, refused here, before any rank starts
        for m in args.ubatches:
            try:
                parse_config({"connector": connector, "connector_extra_config": ubatch_keys(connector, m)})
            except InputError as exc:
                raise UsageError(f"--ubatches {m}: {exc}") from None
    prompts = [[0] * len(p) for p in workload.prompts(1, args.attention)]
    # scoring feeds prompt + continuation back in and asks for one more token
    model_config = check_prompts(args.model, prompts, args.device, args.max_new_tokens + (0 if args.no_score else 1))
    check_launched_runs(args, model_config, args.connectors, prompts=prompts, max_new_tokens=args.max_new_tokens + 1)
    signals.raise_if_signalled()
    result = run_bench(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        num_attn=args.attention,
        num_ffn=args.ffn,
        connectors=args.connectors,
        workload=workload,
        score=not args.no_score,
        ubatches=tuple(args.ubatches),
        max_num_batched_tokens=args.max_num_batched_tokens,
        repeat=args.repeat,
        shared_experts=tuple(args.shared_experts) if args.shared_experts else None,
        progress=lambda msg: print(f"[afd bench] {msg}", file=sys.stderr, flush=True),
    )
    print(format_bench(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="afd", description="Attention-FFN disaggregated serving of DeepSeek-V2/V3 MoE models.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level (every rank's log lines)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("topology", help="show the p2p sync groups and token splits of an A:F layout")
    p.add_argument("--attention", type=rank_count, required=True, help="number of attention ranks (A)")
    p.add_argument("--ffn", type=rank_count, required=True, help="number of FFN ranks (F)")
    p.add_argument("--tokens", type=non_negative_int, help="tokens per attention rank, to show the splits")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_topology)

    p = sub.add_parser("config", help="validate an AFD config and print it resolved (starts nothing)")
    p.add_argument("source", help="a JSON file or a JSON object")
    p.set_defaults(func=cmd_config)
    p = sub.add_parser("generate", help="generation (greedy by default), in one process or through a connector")
    add_run_arguments(p)
    p.set_defaults(func=cmd_generate)
    p = sub.add_parser("launch", help="start a whole topology on this host and gather the outputs")
    add_run_arguments(p)
    p.set_defaults(func=cmd_generate, launch=True, starts_ranks=True)

    p = sub.add_parser("worker", help="start one rank (by hand, e.g. on another host)")
    add_worker_arguments(p)
    p.set_defaults(func=cmd_worker)
    cli_serve.add_serve_parser(sub)
    p = sub.add_parser("demo", help="the embedded end-to-end check: reference vs every connector, on CPU")
    p.add_argument("--model", default="tiny", help="checkpoint directory or preset")
    p.add_argument("--attention", type=rank_count, default=2, help="attention ranks (A) of each connector run")
    p.add_argument("--ffn", type=rank_count, default=2, help="FFN ranks (F) of each connector run")
    p.add_argument("--max-new-tokens", type=positive_int, default=8, help="tokens generated per prompt")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the ranks compute")
    p.add_argument(
        "--connectors", type=connector_list, default="p2p,async", help="comma-separated connectors to run, in order"
    )
    add_skip_resource_check(p)
    p.set_defaults(func=cmd_demo, starts_ranks=True)
    p = sub.add_parser("bench", help="connectors side by side on an uneven request mix, plus numerics")
    p.add_argument("--model", default="tiny", help="checkpoint directory or preset")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="weights dtype")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the ranks compute")
    p.add_argument("--attention", type=rank_count, default=2, help="attention ranks (A)")
    p.add_argument("--ffn", type=rank_count, default=2, help="FFN ranks (F)")
    p.add_argument(
        "--connectors", type=connector_list, default="p2p,async", help="comma-separated connectors to run, in order"
    )
    p.add_argument("--requests", type=positive_int, default=8, help="prompts per replica")
    p.add_argument("--long-len", type=positive_int, default=1024, help="prompt length on replica 0")
    p.add_argument("--short-len", type=positive_int, default=32, help="prompt length on the other replicas")
    p.add_argument("--max-new-tokens", type=positive_int, default=32, help="tokens generated per prompt")
    p.add_argument(
        "--ubatches",
        type=size_list("--ubatches"),
        default="1",
        help="micro-batch counts to run each connector with, comma-separated (1: off)",
    )
    p.add_argument(
        "--repeat",
        type=positive_int,
        default=1,
        help="launch every configuration this many times, in rounds; each row is the median launch (a single "
        "prefill step varies by +-20%% between launches on a GPU)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=batched_tokens,
        help="token budget of one engine step (default: max(2048, 2 x --long-len)); a larger one prefills in fewer, "
        "larger steps",
    )
    p.add_argument(
        "--shared-experts",
        type=choice_list("--shared-experts", ("ffn", "attention")),
        help="where the shared experts run, comma-separated to compare: ffn, attention (async only: on the attention "
        "rank between send and recv; rows labelled +sa); default: each connector's own (async: attention)",
    )
    p.add_argument("--no-score", action="store_true", help="skip the numerics comparison")
    p.add_argument("--json", help="also write the raw result (JSON) to this file")
    add_skip_resource_check(p)
    p.set_defaults(func=cmd_bench, starts_ranks=True)
    # `afd bench step`: a sub-command of bench; `afd bench` without it keeps its flags and behaviour
    steps = p.add_subparsers(dest="bench_command", parser_class=_Parser, metavar="{step,exchange,serve}")
    cli_bench.add_bench_parsers(steps)
    cli_serve.add_bench_serve_parser(steps)
    return parser


# ---------------------------------------------------------------- main
watchdog = signals.SignalWatchdog()  # the running command's; cmd_worker shortens its grace


def main(argv: Sequence[str] | None = None) -> int:
    global watchdog
    watchdog = signals.SignalWatchdog()
    previous = signals.install_handlers()
    watchdog.start()
    try:
        return _run(argv)
    except KeyboardInterrupt as exc:  # Ctrl-C, SIGTERM, SIGHUP: here or inside the launcher
        signum = int(getattr(exc, "signum", signal.SIGINT))
        print(f"afd: interrupted by {signals.signal_name(signum)}", file=sys.stderr)
        return 128 + signum
    except Exception:
        seen = signals.last_signal()
        if seen is None:
            raise
        # the interrupt hit an import and came out as another error (numpy: "cannot load module more than once")
        print(f"afd: interrupted by {signals.signal_name(seen)}", file=sys.stderr)
        return 128 + seen
    finally:
        watchdog.stop()
        signals.restore_handlers(previous)


def _run(argv: Sequence[str] | None) -> int:
    """The command itself. torch and the runtime are imported only in here, after the signal handlers are
    in place: a Ctrl-C during those seconds of imports is then one line too, not a traceback."""
    args = build_parser().parse_args(argv)
    args.signal_watchdog = watchdog  # the command's handler may lengthen its grace (a server's drain)
    logging.basicConfig(
        level=logging.INFO
        if args.verbose or args.command == "worker"
        else logging.WARNING,  # a rank logs like a server
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    if getattr(args, "starts_ranks", False):  # the ranks' zygote imports torch beside this process's own imports
        from afd.runtime.zygote import prestart

        prestart()
    try:
        return args.func(args)
    except (UsageError, InputError) as exc:
        print(f"afd: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as exc:
        launch = sys.modules.get("afd.runtime.launch")  # loaded whenever a LaunchError can have been raised
        if launch is None or not isinstance(exc, launch.LaunchError):
            raise
        print(f"afd: error: {exc}", file=sys.stderr)
        return getattr(exc, "exit_status", 1)
