"""`afd bench` and its sub-commands: connectors side by side (`afd bench`), the engine step (`step`) and one
layer's exchange (`exchange`), each beside its floor; `serve` comes from `afd.cli.serve`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from afd.cli import serve as cli_serve
from afd.cli.args import add_quantization_flag, add_skip_resource_check, check_launched_runs
from afd.cli.input import (
    UsageError,
    batched_tokens,
    check_prompts,
    choice_list,
    connector_list,
    positive_int,
    prefill_list,
    rank_count,
    size_list,
)
from afd.config import InputError, parse_config
from afd.distributed import signals


def add_bench_parser(sub) -> None:
    """Register `bench` under `afd`'s sub-commands, with `step`, `exchange` and `serve` under it."""
    p = sub.add_parser("bench", help="connectors side by side on an uneven request mix, plus numerics")
    p.add_argument("--model", default="tiny", help="checkpoint directory or preset")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="weights dtype")
    add_quantization_flag(p)
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
    steps = p.add_subparsers(dest="bench_command", parser_class=type(p), metavar="{step,exchange,serve}")
    _add_step_parsers(steps)
    cli_serve.add_bench_serve_parser(steps)


def mixed_list(text: str) -> list[tuple[int, int]]:
    """An argparse type: comma-separated DxC pairs (D decodes beside a C-token chunk), or one sentence."""
    pairs = []
    for item in text.split(","):
        d, _, c = item.strip().lower().partition("x")
        if not all(t.isascii() and t.isdigit() and 0 < len(t) <= 9 and int(t) > 0 for t in (d, c)):
            raise argparse.ArgumentTypeError(
                f"--mixed takes DxC pairs (D decodes beside a C-token chunk) separated by ',' (e.g. 256x1792), "
                f"got {text!r}"
            )
        pairs.append((int(d), int(c)))
    return pairs


def _add_step_parsers(steps) -> None:
    """Register `step` and `exchange` under `afd bench`'s sub-commands."""
    s = steps.add_parser("step", help="the reference engine's step time beside its memory-bound floor")
    s.add_argument("--model", default="tiny", help="checkpoint directory or preset")
    s.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="weights dtype")
    add_quantization_flag(s)
    s.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the engine computes")
    s.add_argument("--batch", type=size_list("--batch"), default="1,8", help="decode batch sizes, comma-separated")
    s.add_argument("--context", type=size_list("--context"), default="512", help="cached tokens per sequence")
    s.add_argument(
        "--prefill", type=prefill_list, default="8x1024", help="prefills BxC (B prompts of C tokens), comma-separated"
    )
    s.add_argument(
        "--contexts",
        type=size_list("--contexts"),
        help="also a ragged decode row per --batch: sequences alternating between these contexts (e.g. 512,3584), "
        "beside a uniform batch at their mean context (the same total context)",
    )
    s.add_argument(
        "--mixed",
        type=mixed_list,
        default=[],
        help="also a mixed step per --context: D decodes beside a fresh C-token prompt chunk (DxC, e.g. 256x1792; "
        "comma-separated), beside the D-decode step and the C-token prefill step timed alone and their sum",
    )
    s.add_argument(
        "--steps", type=positive_int, default=10, help="timed steps per point (their mean; isolated: their median)"
    )
    s.add_argument("--json", help="also write the raw result (JSON) to this file")
    s.set_defaults(func=cmd_bench_step, starts_ranks=False)
    s = steps.add_parser("exchange", help="one layer's exchange round trip (no-op FFN) beside a copy of its bytes")
    s.add_argument("--model", default="tiny", help="checkpoint directory or preset (only its shapes are used)")
    s.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="hidden dtype")
    s.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the two ranks run")
    s.add_argument("--tokens", type=size_list("--tokens"), default="1,8,64,512,4096", help="tokens, comma-separated")
    s.add_argument("--connectors", type=connector_list, default="p2p,async", help="connectors to run, in order")
    s.add_argument("--iters", type=positive_int, default=50, help="timed round trips per point")
    s.add_argument(
        "--layers",
        type=positive_int,
        default=1,
        help="exchanges per timed pass, layers 0..N-1 in order as in a forward pass (times are per layer); the "
        "model's MoE layer count shows what a decode step pays",
    )
    s.add_argument(
        "--graph",
        action="store_true",
        help="CUDA: capture each async pass in one CUDA graph, exchanges included, as async 1A1F decode steps are "
        "captured, and time its replays (p2p rows stay eager)",
    )
    s.add_argument(
        "--stress",
        type=positive_int,
        metavar="N",
        help="instead: N async round trips of random sizes (up to the largest --tokens) through an echo FFN, "
        "failing unless every reply equals its request (ordering under load); with --graph through captured passes",
    )
    s.add_argument("--json", help="also write the raw result (JSON) to this file")
    s.set_defaults(func=cmd_bench_exchange, starts_ranks=False)


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
        quantization=args.quantization,
        progress=lambda msg: print(f"[afd bench] {msg}", file=sys.stderr, flush=True),
    )
    return _report(format_bench(result), result, args.json)


def cmd_bench_step(args: argparse.Namespace) -> int:
    from afd.bench.step import format_bench_step, run_bench_step

    ragged = args.contexts or []
    if ragged and len(set(ragged)) < 2:
        raise UsageError(f"--contexts takes at least two different contexts to alternate between, got {ragged}")
    if ragged and max(args.batch) < len(ragged):
        raise UsageError(
            f"--contexts alternates between {len(ragged)} contexts: it needs a --batch of at least {len(ragged)} "
            f"sequences, got {','.join(map(str, args.batch))}"
        )
    longest = max([*args.context, *ragged, *(c for _, c in args.prefill), *(c for _, c in args.mixed)])
    check_prompts(args.model, [[0] * longest], args.device, args.steps + 4)  # the decode steps go past the context

    def bench(quantization: str | None) -> dict:
        return run_bench_step(
            model=args.model,
            dtype=args.dtype,
            device=args.device,
            batches=args.batch,
            contexts=args.context,
            prefills=args.prefill,
            ragged=ragged or None,
            mixed=args.mixed,
            steps=args.steps,
            quantization=quantization,
            progress=lambda msg: print(f"[afd bench step] {msg}", file=sys.stderr, flush=True),
        )

    if not args.quantization:
        result = bench(None)
        return _report(format_bench_step(result), result, args.json)
    from afd.bench.harness import release_device_memory
    from afd.bench.step_compare import format_step_comparison

    baseline = bench(None)  # the same weights unquantized, so the quantized rows have their peer in one run
    release_device_memory(args.device)  # the first model, its cache and graphs, before the second loads
    result = {**bench(args.quantization), "baseline": baseline}
    return _report(format_bench_step(result) + "\n\n" + format_step_comparison(baseline, result), result, args.json)


def cmd_bench_exchange(args: argparse.Namespace) -> int:
    from afd.bench.exchange import format_bench_exchange, run_bench_exchange

    check_prompts(args.model, [[0]], args.device)  # a known model; CUDA where asked
    if args.graph and args.device != "cuda":
        raise UsageError("--graph captures CUDA graphs: it needs --device cuda")
    if args.stress:
        from afd.bench.exchange import run_exchange_stress

        result = run_exchange_stress(
            model=args.model,
            dtype=args.dtype,
            device=args.device,
            round_trips=args.stress,
            max_tokens=max(args.tokens),
            graph=args.graph,
        )
        how = ", captured passes" if args.graph else ""
        summary = (
            f"async ordering stress{how}: {result['round_trips']} round trips ({result['messages']} messages, T up to "
            f"{result['max_tokens']}) in {result['seconds']:.1f}s, {result['mismatches']} mismatches"
        )
        return _report(summary, result, args.json)
    result = run_bench_exchange(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        tokens=args.tokens,
        connectors=args.connectors,
        iters=args.iters,
        layers=args.layers,
        graph=args.graph,
        progress=lambda msg: print(f"[afd bench exchange] {msg}", file=sys.stderr, flush=True),
    )
    return _report(format_bench_exchange(result), result, args.json)


def _report(text: str, result: dict, json_path: str | None) -> int:
    """Print a bench's table; write its raw result where `--json` asks."""
    print(text)
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2))
    return 0
