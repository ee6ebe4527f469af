"""`afd simulate`, `afd plan` and `afd profile`: a deployment simulated, the deployments of N GPUs ranked, a machine
profiled (afd.planning; docs/planning.md)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from afd.cli.input import UsageError, non_negative_int, positive_int, positive_seconds, rate_list
from afd.runtime.limits import machine_defaults

if TYPE_CHECKING:
    from afd.planning.profile import Profile

WORKLOAD_KINDS = ("uniform", "uneven", "mixed")


def _add_workload(p: argparse.ArgumentParser, requests: int) -> None:
    p.add_argument("--model", default="deepseek-v2-lite", help="a preset or a checkpoint directory (its config.json)")
    p.add_argument("--weights", choices=["bfloat16", "fp8", "float32"], help="weight format (default: the model's)")
    p.add_argument(
        "--profile",
        help="a profile JSON file or a shipped one by name (default: h200-MODEL where afd ships one, else h200)",
    )
    p.add_argument("--workload", choices=WORKLOAD_KINDS, default="mixed", help="as afd bench serve's")
    p.add_argument("--trace", help="a JSONL trace instead of --workload (afd bench serve's format)")
    p.add_argument("--requests", type=positive_int, default=requests, help="requests per rate")
    p.add_argument("--long-len", type=positive_int, default=1024, help="long prompt length (tokens)")
    p.add_argument("--short-len", type=positive_int, default=64, help="short prompt length (tokens)")
    p.add_argument("--long-fraction", type=float, default=0.25, help="share of long prompts (uneven)")
    p.add_argument("--max-tokens", type=positive_int, default=64, help="tokens generated per request")
    p.add_argument("--bench-seed", type=non_negative_int, default=0, help="seed of the prompts and arrivals")
    p.add_argument(
        "--max-num-seqs",
        type=positive_int,
        help="sequences a replica runs at once (default: a --compare file's server's, else afd serve's default on "
        "the profile's machine: 1,024 on a GPU of 70 GiB or more, else 256)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=positive_int,
        help="token budget of one step (default: a --compare file's server's, else afd serve's default on the "
        "profile's machine: 8,192 on a GPU of 70 GiB or more, else 2,048)",
    )
    p.add_argument("--gpus-per-node", type=positive_int, default=8, help="GPUs per node (NVLink inside)")
    p.add_argument("--inter-node-gbps", type=float, default=400.0, help="bandwidth per GPU between nodes (Gb/s)")
    p.add_argument("--inter-node-latency-us", type=float, default=10.0, help="latency between nodes (µs)")
    p.add_argument("--slo-ttft", type=positive_seconds, default=5.0, help="p90 TTFT bound (s)")
    p.add_argument("--json", help="write the results (JSON) to this file")


def add_planning_parsers(sub) -> None:
    """Register `simulate`, `plan` and `profile` under `afd`'s sub-commands."""
    p = sub.add_parser("simulate", help="simulate afd serving a workload on a profiled machine (bench serve's report)")
    _add_workload(p, 1000)
    p.add_argument(
        "--connector",
        choices=["none", "p2p", "async", "ep"],
        default="none",
        help="none: whole replicas; p2p, async: AFD groups; ep: data-parallel attention with expert-parallel MoE",
    )
    p.add_argument("--attention", type=positive_int, default=1, help="attention ranks per group (ep: GPUs)")
    p.add_argument("--ffn", type=positive_int, default=1, help="FFN ranks per group")
    p.add_argument("--replicas", type=positive_int, default=1, help="none: replicas; p2p/async: groups")
    p.add_argument("--ubatches", type=positive_int, default=1, help="micro-batches (async, ep)")
    p.add_argument("--colocated", action="store_true", help="a group's A and F ranks share max(A, F) GPUs")
    p.add_argument("--ubatch-decode", action="store_true", help="micro-batch decode steps too (a prediction)")
    p.add_argument("--rates", type=rate_list, default=[math.inf], help="arrival rates (req/s, inf: all at once)")
    p.add_argument(
        "--compare", metavar="RESULTS.json", help="an afd bench serve --json file: its workload, rates, errors"
    )
    p.add_argument("--tolerance", type=float, default=0.15, help="with --compare: exit 1 beyond this relative error")
    p.set_defaults(func=cmd_simulate, starts_ranks=False)

    p = sub.add_parser("plan", help="rank the deployments of N GPUs by SLO-compliant output tokens/s per GPU")
    _add_workload(p, 1000)
    p.add_argument("--gpus", type=positive_int, required=True, help="GPUs to deploy on")
    p.add_argument("--slo-tpot", type=positive_seconds, default=0.05, help="p50 time per output token bound (s)")
    p.add_argument("--ubatch-decode", action="store_true", help="micro-batch decode steps too (a prediction)")
    p.add_argument(
        "--decode-only",
        action="store_true",
        help="plan a decode cluster whose prompts are prefilled elsewhere: score each deployment's steady state, every "
        "replica at the largest batch its cache holds and --slo-tpot allows, sequences at the workload's mean prompt "
        "plus half its output (no TTFT)",
    )
    p.set_defaults(func=cmd_plan, starts_ranks=False)

    p = sub.add_parser("profile", help="measure this machine's step parts with afd's own code and fit a profile")
    p.add_argument("--model", default="tiny", help="a preset (tiny on CPU, deepseek-v2-lite on GPU)")
    p.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="the weights' and compute dtype"
    )
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the parts are measured")
    p.add_argument(
        "--quantization",
        choices=["fp8"],
        help="measure with the weights quantized at load (afd serve's --quantization): the profile of FP8 weights",
    )
    p.add_argument("--no-exchange", action="store_true", help="leave the p2p / async round trips out")
    p.add_argument(
        "--no-calibration",
        action="store_true",
        help="skip serving the calibration trace (the profile then carries no serving cost beyond its parts)",
    )
    p.add_argument(
        "--calibration-requests", type=positive_int, default=128, help="requests of the calibration trace per rate"
    )
    p.add_argument(
        "--calibration-rates",
        type=rate_list,
        default=None,
        help="rates of the calibration trace (req/s) (default: inf, 64, 8 on a GPU; inf, 8 on a CPU)",
    )
    p.add_argument(
        "--calibrate-from",
        metavar="RESULTS.json",
        nargs="+",
        help="measure nothing: fit --profile's calibration to these afd bench serve --json runs of none R=1 (several "
        "workloads, fitted at once, pin the costs down better than one)",
    )
    p.add_argument(
        "--refit",
        metavar="PROFILE.json",
        help="measure nothing: fit this profile's parts and calibration again from the rows it keeps (after a "
        "change to how afd models a part)",
    )
    p.add_argument("--profile", default="h200", help="with --calibrate-from: the profile whose parts stand")
    p.add_argument("--output", "-o", required=True, help="the profile JSON to write")
    p.set_defaults(func=cmd_profile, starts_ranks=False)


def _setup(args: argparse.Namespace):
    """(shapes, profile, workload, weight format) of the flags; UsageError in one sentence otherwise."""
    from dataclasses import replace

    from afd.bench.workload import TraceError, Workload, load_trace
    from afd.model.weights import load_model_config
    from afd.planning import costs
    from afd.planning.profile import Link, ProfileError, checkpoint_weights, default_profile, load_profile

    try:
        config = load_model_config(args.model)
        shipped = checkpoint_weights(args.model)
        weights = args.weights or ("fp8" if shipped == "fp8" else None)  # 16/32-bit: the profile's format, below
        profile = load_profile(args.profile or default_profile(args.model, weights))
    except (ValueError, ProfileError) as exc:
        raise UsageError(str(exc)) from None
    weights = weights or profile.dtype
    link = Link(profile.link.intra_node_Bps, args.inter_node_gbps * 1e9 / 8, args.inter_node_latency_us * 1e-6)
    profile = replace(profile, link=link)
    if args.trace:
        try:
            trace = load_trace(args.trace)
        except TraceError as exc:
            raise UsageError(str(exc)) from None
        workload = Workload("trace", len(trace), seed=args.bench_seed, trace=trace)
    else:
        workload = Workload(args.workload, args.requests, args.long_len, args.short_len, args.long_fraction)
        workload = replace(workload, max_tokens=args.max_tokens, seed=args.bench_seed)
    return costs.shapes_of(config, weights), profile, workload, weights


def cmd_simulate(args: argparse.Namespace) -> int:
    from afd.bench.report import format_table, slo_summary, strict_json
    from afd.planning.compare import beyond, errors, format_errors, result_for, workload_of
    from afd.planning.deployment import Deployment, DeploymentError
    from afd.planning.simulator import simulate

    shapes, profile, workload, _ = _setup(args)
    if args.colocated and args.connector == "p2p" and profile.on_gpu:
        raise UsageError(
            "--colocated with p2p on a GPU profile: NCCL takes one GPU per rank, so p2p's ranks cannot share GPUs "
            "(async's can); leave --colocated out or use --connector async"
        )
    rates = args.rates
    measured = None
    if args.compare:
        raw = _read_results("--compare", args.compare)
        try:
            workload, rates = workload_of(raw)
            deployment = (args.connector, args.attention, args.ffn, args.replicas, args.ubatches)
            measured = result_for(raw, *deployment)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise UsageError(f"--compare {args.compare}: {exc}") from None
    max_num_seqs, budget = _step_limits(args, profile, measured)
    try:
        d = Deployment(
            args.connector, args.attention, args.ffn, args.replicas, args.ubatches, args.gpus_per_node,
            max_num_seqs, budget, colocated=args.colocated, ubatch_decode=args.ubatch_decode,
        )  # fmt: skip
        result = simulate(d, shapes, profile, workload, rates)
    except (DeploymentError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    result["slo"] = slo_summary(result["runs"], args.slo_ttft)
    print(format_table([result], args.slo_ttft))
    raw_out = {
        "workload": workload.describe() | {"rates": rates},
        "slo_ttft_s": args.slo_ttft,
        "simulated": {"profile": profile.source, "model": args.model},
        "results": [result],
    }
    status = 0
    if measured is not None:
        rows = errors(measured, result)
        print(format_errors(rows, args.tolerance))
        raw_out["errors"] = rows
        status = 1 if beyond(rows, args.tolerance) else 0
    if args.json:
        Path(args.json).write_text(json.dumps(strict_json(raw_out), indent=2, allow_nan=False))
    return status


def _step_limits(args: argparse.Namespace, profile: Profile, measured: dict | None = None) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens): the flags, else those the measured server ran with (its results'
    `step_limits`: simulated under other limits, a comparison would say nothing), else what `afd serve` takes by
    default on the profile's machine (a plan for H200s models the servers that would run there)."""
    limits = (measured or {}).get("step_limits") or {}
    budget, seqs = machine_defaults(profile.on_gpu, profile.gpu_memory_bytes)
    seqs = args.max_num_seqs or int(limits.get("max_num_seqs", seqs))
    return seqs, args.max_num_batched_tokens or int(limits.get("max_num_batched_tokens", budget))


def profile_line(profile: Profile, weights: str) -> str:
    """Which profile priced a plan, and where its weight format is not the plan's, that the plan's weights were
    priced at the other format's rates (their bytes are their own)."""
    line = f"profile: measured on {profile.machine.get('model')} in {profile.dtype} ({profile.source})"
    if profile.dtype != weights:
        line += (
            f"; the {weights} weights are priced at {profile.dtype}'s rates with their own bytes (a profile measured "
            f"in {weights} prices them at {weights}'s)"
        )
    return line


def cmd_plan(args: argparse.Namespace) -> int:
    from afd.bench.report import strict_json
    from afd.planning.deployment import Deployment, DeploymentError
    from afd.planning.plan import Slo, format_plan, plan

    shapes, profile, workload, weights = _setup(args)
    max_num_seqs, budget = _step_limits(args, profile)
    base = Deployment(
        "none", gpus_per_node=args.gpus_per_node, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
        ubatch_decode=args.ubatch_decode,
    )  # fmt: skip
    try:
        result = plan(args.gpus, shapes, profile, workload, Slo(args.slo_ttft, args.slo_tpot), base, args.decode_only)
    except (DeploymentError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    print(format_plan(result))
    print(profile_line(profile, weights))
    result = {"model": args.model, "weights": weights, "profile": profile.source, **result}
    if args.json:
        Path(args.json).write_text(json.dumps(strict_json(result), indent=2, allow_nan=False))
    return 0


def _read_results(flag: str, path: str) -> dict:
    """An `afd bench serve --json` results file, or a UsageError saying in one sentence why it is not one."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"{flag} {path}: not a readable results JSON ({exc})") from None
    if not isinstance(raw, dict) or not {"workload", "results"} <= raw.keys():
        raise UsageError(f"{flag} {path}: not an afd bench serve --json results file (it needs workload and results)")
    return raw


def _recalibrate(args: argparse.Namespace) -> int:
    """`afd profile --calibrate-from RESULTS.json ...`: the profile's parts, its calibration fitted to served runs."""
    from afd.planning.calibrate import calibrate_from_results, format_calibration
    from afd.planning.profile import ProfileError, load_profile

    raws = [_read_results("--calibrate-from", path) for path in args.calibrate_from]
    try:
        profile = calibrate_from_results(load_profile(args.profile), raws)
    except ProfileError as exc:
        raise UsageError(f"--profile {args.profile}: {exc}") from None
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise UsageError(f"--calibrate-from {' '.join(args.calibrate_from)}: {exc}") from None
    print(format_calibration(profile.calibration), file=sys.stderr)
    profile.save(args.output)
    print(f"wrote {args.output}")
    return 0


def _refit(args: argparse.Namespace) -> int:
    """`afd profile --refit P.json`: P's parts and calibration fitted again from the rows P keeps."""
    from afd.planning.fitting import refit_profile
    from afd.planning.profile import ProfileError, load_profile

    try:
        profile = refit_profile(load_profile(args.refit), say=lambda m: print(m, file=sys.stderr))
    except (ProfileError, ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"--refit {args.refit}: {exc}") from None
    profile.save(args.output)
    print(f"wrote {args.output}")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from afd.planning.measure import measure_profile

    if not Path(args.output).resolve().parent.is_dir():
        raise UsageError(f"--output {args.output}: the directory {Path(args.output).resolve().parent} does not exist")
    if args.calibrate_from and args.refit:
        raise UsageError("--refit and --calibrate-from are two different jobs: give one")
    if args.calibrate_from:
        return _recalibrate(args)
    if args.refit:
        return _refit(args)
    if args.device == "cuda" and args.dtype == "float32":
        args.dtype = "bfloat16"
    failures: tuple[type[BaseException], ...] = (TimeoutError,)
    if not args.no_calibration:  # the calibration serves a trace: afd serve and afd bench serve's client
        from afd.bench.serve_client import BenchError
        from afd.serve.run import ServeError

        failures += (ServeError, BenchError)
    from afd.planning.calibrate import default_rates

    rates = tuple(args.calibration_rates or default_rates(args.device))
    try:
        profile = measure_profile(
            args.model, args.dtype, args.device, exchange=not args.no_exchange, calibrate=not args.no_calibration,
            calibration_requests=args.calibration_requests, calibration_rates=rates, quantization=args.quantization,
            say=lambda m: print(m, file=sys.stderr),
        )  # fmt: skip
    except failures as exc:
        print(f"afd: error: the calibration trace failed: {exc}", file=sys.stderr)
        return 1
    profile.save(args.output)
    print(f"wrote {args.output}")
    return 0
