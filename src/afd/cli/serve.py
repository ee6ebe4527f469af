"""`afd serve` and `afd bench serve`: their flags, checks and handlers (registered by `afd.cli.main`).

Everything is checked before anything starts: bad flags, an unknown model, a port in use are one
sentence and exit status 2, with no rank started and nothing left behind.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import urllib.parse
from dataclasses import replace
from pathlib import Path

from afd.bench.workload import WORKLOADS
from afd.cli.args import (
    add_quantization_flag,
    add_shared_experts_flag,
    check_resources,
    launch_config,
    shared_experts_keys,
)
from afd.cli.chaos import add_chaos_arguments, cmd_bench_chaos
from afd.cli.input import (
    UsageError,
    batched_tokens,
    block_size,
    check_prompts,
    compare_list,
    max_num_seqs,
    memory_fraction,
    non_negative_int,
    port_number,
    positive_int,
    positive_seconds,
    rank_count,
    rate_list,
)
from afd.cli.limits import Shape, add_profile_flag, apply_step_limits, compare_with_limits
from afd.serve import MAX_PROMPTS_PER_REQUEST


# ---------------------------------------------------------------- afd serve
def add_server_arguments(p: argparse.ArgumentParser, default_model: str | None = None) -> None:
    """What a server is made of (shared by `serve` and `bench serve`, which starts servers)."""
    p.add_argument(
        "--model",
        required=default_model is None,
        default=default_model,
        help="checkpoint directory (config.json + *.safetensors) or preset",
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="weights dtype")
    add_quantization_flag(p)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the ranks compute")
    p.add_argument("--seed", type=non_negative_int, default=0, help="seed of preset weights")
    p.add_argument(
        "--max-num-seqs",
        type=max_num_seqs,
        help="sequences a replica runs at once (default: 1024 on a GPU of 70 GiB or more whose KV cache holds that "
        "many, else 256)",
    )
    p.add_argument("--busy-poll", action="store_true", help="the front end and idle replicas poll without sleeping")
    p.add_argument(
        "--max-model-len",
        type=positive_int,
        help="prompt + generated tokens of one request (default: the model's max_position_embeddings)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=batched_tokens,
        help="token budget of one engine step; longer prompts are prefilled in chunks (default: --profile's pick, "
        "else 8192 on a GPU of 70 GiB or more, 2048 below that and on CPU)",
    )
    add_profile_flag(p)
    p.add_argument(
        "--gpu-memory-utilization",
        type=memory_fraction,
        default=0.9,
        help="fraction of a GPU an engine may use (divided among ranks that share a GPU)",
    )
    p.add_argument("--block-size", type=block_size, default=16, help="tokens per KV-cache block")
    p.add_argument("--num-gpu-blocks-override", type=positive_int, help="KV-cache blocks per replica (any device)")
    p.add_argument("--config", help="AFD config (file or JSON) for connector_extra_config and the store's host")
    p.add_argument("--skip-resource-check", action="store_true", help="start even when the run looks too large")
    p.add_argument(
        "--startup-timeout", type=positive_seconds, default=600.0, help="seconds every replica has to load and connect"
    )


def add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server over engine replicas")
    add_server_arguments(p)
    p.add_argument(
        "--connector",
        default="none",
        choices=["none", "p2p", "async"],
        help="none: --replicas whole-model replicas (data parallel); p2p/async: --attention A --ffn F",
    )
    p.add_argument("--attention", type=rank_count, default=1, help="attention ranks (A), one replica each")
    p.add_argument("--ffn", type=rank_count, default=1, help="FFN ranks (F)")
    p.add_argument("--replicas", type=rank_count, help="connector none: whole-model replicas (default 1)")
    p.add_argument("--gate-on-ffn", action="store_true", help="run the MoE gate on the FFN side (p2p only)")
    add_shared_experts_flag(p)
    p.add_argument(
        "--ubatches",
        type=positive_int,
        help="p2p/async: micro-batches a prefill or mixed step runs in, in ping-pong, so attention and FFN ranks "
        "overlap (1: off; all-decode steps replayed from CUDA graphs are not split; default: async: --profile's "
        "pick, else 1)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address the HTTP server listens on")
    p.add_argument("--port", type=port_number, default=8000, help="HTTP port")
    p.add_argument("--served-model-name", help="the model name clients send and /v1/models lists (default: --model)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 routes (default: AFD_API_KEY)")
    p.add_argument(
        "--max-waiting",
        type=non_negative_int,
        default=1024,
        help="prompts that may wait for a replica (each prompt of a request counts); a request that would make "
        "more wait gets 429",
    )
    p.add_argument(
        "--max-prompts-per-request",
        type=positive_int,
        default=MAX_PROMPTS_PER_REQUEST,
        help="prompts one /v1/completions request may carry; more is a 400 (default: one replica's running batch "
        "at vLLM's default --max-num-seqs)",
    )
    p.add_argument(
        "--max-restarts",
        type=non_negative_int,
        default=5,
        help="a replica (or world) whose ranks die this many times within --restart-window is not restarted again; "
        "0: never restart",
    )
    p.add_argument(
        "--restart-window", type=positive_seconds, default=60.0, help="seconds over which --max-restarts counts"
    )
    p.set_defaults(func=cmd_serve, starts_ranks=True)


def build_plan(args: argparse.Namespace):
    """The checked `ServePlan` of the flags (UsageError in one sentence otherwise)."""
    from afd import env
    from afd.serve.healing import HealPolicy
    from afd.serve.run import ServePlan
    from afd.serve.state import ServeOptions
    from afd.serve.tokenizer import TokenizerError, load_tokenizer

    model_config = check_prompts(args.model, [], args.device)
    limit = model_config.max_position_embeddings
    if args.max_model_len is not None and args.max_model_len > limit:
        raise UsageError(f"--max-model-len {args.max_model_len} is more than the {limit} positions of {args.model!r}")
    shared_experts_keys(args.connector, args.shared_experts)
    if args.connector == "none":
        if (args.attention, args.ffn) != (1, 1) or args.gate_on_ffn or args.ubatches not in (None, 1):
            raise UsageError(
                "--attention, --ffn, --gate-on-ffn and --ubatches need --connector p2p or async; none takes --replicas"
            )
        replicas, config = args.replicas or 1, None
        limits = apply_step_limits(args, model_config, Shape(replicas=replicas)).describe(ubatches=False)
    else:
        if args.replicas is not None and args.replicas != args.attention:
            raise UsageError(
                f"with --connector {args.connector} the replicas are the attention ranks; "
                "leave --replicas out or make it equal to --attention"
            )
        shape = Shape(args.connector, args.attention, args.ffn, args.attention, not args.gate_on_ffn)
        limits = apply_step_limits(args, model_config, shape, ubatches=args.ubatches).describe()
        config = launch_config(
            args.config,
            args.connector,
            shared_experts=args.shared_experts,
            num_ubatches=args.ubatches,
            num_attention_ranks=args.attention,
            num_ffn_ranks=args.ffn,
            compute_gate_on_attention=not args.gate_on_ffn,
        )
        replicas = args.attention
    _check_resources(args, model_config)
    try:
        tokenizer = load_tokenizer(args.model, model_config.vocab_size)
    except TokenizerError as exc:
        raise UsageError(str(exc)) from None
    spec = run_spec(args, args.max_model_len)
    options = ServeOptions(
        model_name=args.served_model_name or args.model,
        api_key=args.api_key or env.api_key(),
        max_waiting=args.max_waiting,
        max_prompts_per_request=args.max_prompts_per_request,
        busy_poll=args.busy_poll,
    )
    heal = HealPolicy(max_restarts=args.max_restarts, window_s=args.restart_window)
    return ServePlan(
        spec, config, replicas, args.host, args.port, options, tokenizer, args.startup_timeout, heal, limits
    )


def run_spec(args: argparse.Namespace, max_model_len: int | None):
    """The `RunSpec` of the server flags (`add_server_arguments`): what every replica of the server is built from."""
    from afd.model.kv_cache import CacheOptions
    from afd.runtime.spec import RunSpec

    cache = CacheOptions(
        block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        num_blocks=args.num_gpu_blocks_override,
        max_num_seqs=args.max_num_seqs,
    )
    return RunSpec(
        model=args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        device=args.device,
        seed=args.seed,
        max_num_batched_tokens=args.max_num_batched_tokens,
        cache=cache,
        max_model_len=max_model_len,
        busy_poll=args.busy_poll,
    )


def _check_resources(args: argparse.Namespace, model_config) -> None:
    if args.connector == "none":
        check_resources(args, model_config, connector="none")
        return
    check_resources(
        args,
        model_config,
        connector=args.connector,
        num_attention=args.attention,
        num_ffn=args.ffn,
        gate_on_attention=not args.gate_on_ffn,
    )


def require_packages(command: str, extra: str, names: tuple[str, ...]) -> None:
    """UsageError (exit 2) naming what to install when a package of `names` is missing."""
    from afd.serve import missing_packages

    missing = missing_packages(names)
    if missing:
        raise UsageError(f"{command} needs {', '.join(missing)}: pip install 'afd[{extra}]'")


def cmd_serve(args: argparse.Namespace) -> int:
    from afd.distributed import signals
    from afd.serve import STACK

    require_packages("afd serve", "serve", STACK)
    from afd.serve.run import DRAIN_BUDGET_S, ServeError, run_server

    plan = build_plan(args)
    watchdog = args.signal_watchdog
    watchdog.grace_s = max(watchdog.grace_s, DRAIN_BUDGET_S)  # a graceful stop may take the drain and more
    signals.raise_if_signalled()
    try:
        return run_server(plan, lambda line: print(line, flush=True))
    except ServeError as exc:
        if exc.exit_status == 2:
            raise UsageError(str(exc)) from None
        print(f"afd: error: {exc}", file=sys.stderr)
        return exc.exit_status


# ---------------------------------------------------------------- afd bench serve
DEFAULT_RATES, DEFAULT_OVERHEAD_RATES = [4.0], [1.0]


def add_bench_serve_parser(steps) -> None:
    s = steps.add_parser("serve", help="online load through the HTTP API: TTFT, TPOT, throughput, SLO-compliant rate")
    add_server_arguments(s, default_model="tiny")
    target = s.add_mutually_exclusive_group()
    target.add_argument(
        "--compare",
        type=compare_list,
        default="none:R=1",
        help="servers to start and measure in turn, e.g. none:R=2,async:A=2,F=2,async:A=1,F=1,U=2 (U: --ubatches; "
        "async+sa / async+sf: async with --shared-experts attention / ffn; plain async runs them where it does by "
        "default, on the attention ranks)",
    )
    target.add_argument("--url", help="measure a running server instead (e.g. http://127.0.0.1:8000)")
    target.add_argument(
        "--overhead",
        action="store_true",
        help="what the HTTP front end adds to TTFT: the same requests through afd serve --connector none "
        "--replicas 1, then straight into one replica engine in this process (default --rates 1)",
    )
    s.add_argument("--api-key", help="the key of the server at --url (default: AFD_API_KEY)")
    s.add_argument(
        "--workload",
        choices=WORKLOADS,
        help="uniform: lengths uniform between --short-len and --long-len; uneven (default): --long-len with "
        "probability --long-fraction, else --short-len; mixed: lognormal lengths, median --short-len, capped at "
        "--long-len",
    )
    s.add_argument(
        "--trace",
        help='a JSONL file of requests instead of --workload, one {"prompt_len", "max_tokens", "arrival_s"?} per '
        "line; without arrival_s, Poisson arrivals at --rates",
    )
    s.add_argument("--requests", type=positive_int, default=64, help="requests per rate")
    s.add_argument(
        "--rates",
        "--rate",
        dest="rates",
        type=rate_list,
        help="Poisson arrival rates (requests/s, inf: all at once), comma-separated (default 4; 1 with --overhead)",
    )
    s.add_argument("--long-len", type=positive_int, default=1024, help="long prompt length (tokens)")
    s.add_argument("--short-len", type=positive_int, default=32, help="short prompt length (tokens)")
    s.add_argument("--long-fraction", type=_fraction, default=0.25, help="share of long prompts (uneven)")
    s.add_argument("--max-tokens", type=positive_int, default=64, help="tokens generated per request")
    s.add_argument("--slo-ttft", type=positive_seconds, default=5.0, help="p90 TTFT bound of the SLO-compliant rate")
    s.add_argument("--bench-seed", type=non_negative_int, default=0, help="seed of the prompts and arrivals")
    s.add_argument(
        "--warmups",
        type=non_negative_int,
        default=8,
        help="untimed requests before each server's timed runs: the workload's first N, sent at once (a server's "
        "first requests of a new shape pay one-time costs: kernels compiled, graphs captured)",
    )
    s.add_argument("--json", help="also write the raw results (JSON) to this file")
    s.add_argument("--plot", metavar="FILE.png", help="latency vs rate per server config (matplotlib, afd[bench])")
    add_chaos_arguments(s)
    s.set_defaults(func=cmd_bench_serve, starts_ranks=False)


def _fraction(text: str) -> float:
    """An argparse type: a fraction in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction between 0 and 1, got {text!r}")
    return value


_SERVER_FLAGS = ("model", "dtype", "device", "seed", "max_num_seqs", "max_num_batched_tokens", "block_size")
_SERVER_FLAGS += ("quantization",)
_SERVER_FLAGS += ("gpu_memory_utilization", "num_gpu_blocks_override", "config", "startup_timeout")


def server_argv(args: argparse.Namespace, max_model_len: int) -> list[str]:
    """The `afd serve` flags of `add_server_arguments` as given to `bench serve` (the connector comes later)."""
    argv = ["--max-model-len", str(max_model_len)] + ["--skip-resource-check"] * args.skip_resource_check
    argv += ["--busy-poll"] * args.busy_poll
    for name in _SERVER_FLAGS:
        if getattr(args, name) is not None:
            argv += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    return argv


def bench_workload(args: argparse.Namespace, limit: int):
    """The checked `Workload` and rates of the flags (UsageError in one sentence otherwise)."""
    from afd.bench.serve_client import run_rates
    from afd.bench.workload import TraceError, Workload, load_trace

    if args.trace is not None and args.workload is not None:
        raise UsageError("pass --workload or --trace, not both")
    rates = args.rates or (DEFAULT_OVERHEAD_RATES if args.overhead else DEFAULT_RATES)
    if args.trace is None:
        if max(args.long_len, args.short_len) + args.max_tokens > limit:
            raise UsageError(
                f"--long-len {args.long_len} / --short-len {args.short_len} + --max-tokens {args.max_tokens} is more "
                f"than the {limit} positions a request may take; lower them"
            )
        workload = Workload(args.workload or "uneven", args.requests, args.long_len, args.short_len, args.long_fraction)
        return replace(workload, max_tokens=args.max_tokens, seed=args.bench_seed, warmups=args.warmups), rates
    try:
        trace = load_trace(args.trace)
    except TraceError as exc:
        raise UsageError(str(exc)) from None
    longest = max(range(len(trace)), key=lambda i: trace[i].prompt_len + trace[i].max_tokens)
    if trace[longest].prompt_len + trace[longest].max_tokens > limit:
        raise UsageError(
            f"trace {args.trace} request {longest + 1} takes {trace[longest].prompt_len} + "
            f"{trace[longest].max_tokens} positions, more than the {limit} a request may take"
        )
    workload = Workload("trace", len(trace), seed=args.bench_seed, trace=trace, warmups=args.warmups)
    if workload.timed and args.rates is not None:
        raise UsageError(f"trace {args.trace} has its own arrival times (arrival_s); leave --rates out")
    return workload, run_rates(workload, rates)


BENCH_STACK = ("aiohttp", "tqdm")  # the `afd[bench]` extra (and matplotlib, for --plot)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from afd.serve import STACK

    require_packages("afd bench serve", "bench", BENCH_STACK)
    if not args.url:  # it starts servers
        require_packages("afd bench serve (which starts afd serve)", "serve", STACK)
    from afd import env
    from afd.bench.report import (
        PlotUnavailable,
        format_table,
        plot_results,
        require_matplotlib,
        slo_summary,
        strict_json,
    )
    from afd.bench.serve_client import BenchError, Progress, bench_servers, bench_url
    from afd.serve.run import ServeError

    model_config = check_prompts(args.model, [], args.device)
    limit = args.max_model_len or model_config.max_position_embeddings
    workload, rates = bench_workload(args, limit)
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path and not Path(path).resolve().parent.is_dir():
            raise UsageError(f"{flag} {path}: the directory {Path(path).resolve().parent} does not exist")
    if args.url:
        parts = urllib.parse.urlsplit(args.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UsageError(f"--url takes an http:// or https:// server address, got {args.url!r}")
    if args.plot:
        try:
            require_matplotlib()
        except PlotUnavailable as exc:
            raise UsageError(str(exc)) from None
    chosen = {}
    if args.url and args.profile:
        raise UsageError("--profile picks the step limits of the servers bench serve starts; leave it out with --url")
    if args.overhead:  # one none R=1 server, then its engine alone, with the same limits
        chosen["none R=1"] = apply_step_limits(args, model_config, Shape())
    elif not args.url:
        args.compare, chosen = compare_with_limits(args, model_config)
    progress = Progress(sys.stderr)
    for label, limits in chosen.items():  # every server's, once every one is known to be possible
        progress.note(f"{label}: {limits.describe(ubatches=not label.startswith('none'))}")
    if args.chaos:
        return cmd_bench_chaos(args, workload, rates, server_argv(args, limit), model_config.vocab_size)
    common = dict(vocab_size=model_config.vocab_size, timeout_s=args.startup_timeout)
    try:
        if args.url:
            key = args.api_key or env.api_key()
            url = args.url.rstrip("/")
            results = [
                {
                    "name": args.url,
                    "runs": bench_url(
                        url, workload, rates, api_key=key, progress=progress, busy_poll=args.busy_poll, **common
                    ),
                }
            ]
        elif args.overhead:
            from afd.bench.overhead import bench_overhead

            argv = server_argv(args, limit)
            results = bench_overhead(argv, run_spec(args, limit), workload, rates, progress, **common)
        else:
            results = bench_servers(args.compare, server_argv(args, limit), workload, rates, progress, **common)
    except (ServeError, BenchError, TimeoutError) as exc:
        print(f"afd: error: {exc}", file=sys.stderr)
        return 1
    print(format_table(results, args.slo_ttft))
    raw = {"workload": workload.describe() | {"rates": rates}, "slo_ttft_s": args.slo_ttft, "results": results}
    if args.trace:
        raw["workload"]["trace_file"] = args.trace
    for res in results:
        res["slo"] = slo_summary(res["runs"], args.slo_ttft)
        if res["name"] in chosen:
            res["step_limits"] = chosen[res["name"]].to_json()
    if args.overhead:
        from afd.bench.overhead import format_overhead, front_end_overhead

        raw["front_end_overhead"] = front_end_overhead(*results)
        print(format_overhead(raw["front_end_overhead"]))
    if args.json:
        Path(args.json).write_text(json.dumps(strict_json(raw), indent=2, allow_nan=False))
    if args.plot:
        plot_results(results, args.plot, args.slo_ttft, title=f"{args.model}, {workload.describe()['kind']} workload")
    return 0
