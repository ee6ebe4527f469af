"""The `afd` command line. It only builds validated objects and calls the library.

Bad input is one sentence on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from afd.config import ConfigError, parse_config
from afd.runtime.launch import LaunchError, RunSpec
from afd.topology import SyncTopology

EXIT_USAGE = 2


class UsageError(Exception):
    """Bad input from the user: printed as one sentence, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"afd: error: {message}\n")


def int_at_least(minimum: int, what: str):
    """An argparse type: an integer >= minimum, or one sentence saying what was expected."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"expected a {what} integer, got {text!r}")
        return value

    return parse


positive_int = int_at_least(1, "positive")
non_negative_int = int_at_least(0, "non-negative")


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
def parse_prompt_ids(text: str) -> list[list[int]]:
    """`"1,2,3;4,5"` -> `[[1, 2, 3], [4, 5]]`."""
    prompts = []
    for i, chunk in enumerate(text.split(";")):
        try:
            ids = [int(t) for t in chunk.split(",") if t.strip()]
        except ValueError:
            raise UsageError(f"--prompt-ids must be integers separated by ',' and ';', got {chunk.strip()!r}") from None
        if not ids:
            raise UsageError(f"prompt {i} in --prompt-ids is empty; every prompt needs at least one token id")
        prompts.append(ids)
    return prompts


def read_prompts_file(path: str) -> list[list[int]]:
    """One `{"prompt_ids": [...]}` per line."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise UsageError(f"cannot read prompts file {path!r} ({exc.strerror or type(exc).__name__})") from None
    prompts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            ids = json.loads(line)["prompt_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise TypeError
        except (json.JSONDecodeError, KeyError, TypeError):
            raise UsageError(f"line {n} of {path!r} is not a JSON object with a list of integer prompt_ids") from None
        if not ids:
            raise UsageError(f"line {n} of {path!r} has an empty prompt; every prompt needs at least one token id")
        prompts.append(ids)
    if not prompts:
        raise UsageError(f"prompts file {path!r} holds no prompt")
    return prompts


def check_prompts(model: str, prompts: list[list[int]], device: str) -> None:
    """Fail before anything starts: unknown model, ids outside the vocabulary, no CUDA."""
    from afd.weights import load_model_config

    try:
        config = load_model_config(model)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    for prompt in prompts:
        bad = [t for t in prompt if not 0 <= t < config.vocab_size]
        if bad:
            raise UsageError(f"token id {bad[0]} is outside the vocabulary [0, {config.vocab_size}) of {model!r}")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda was given but no CUDA device is visible; use --device cpu")


def add_model_arguments(p: argparse.ArgumentParser, *, prompts_required: bool) -> None:
    """The model, its numerics and the prompts: shared by `generate`, `launch` and `worker`."""
    p.add_argument("--model", required=True, help="checkpoint directory or preset (tiny, deepseek-v2-lite)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--seed", type=non_negative_int, default=0, help="seed of preset weights")
    p.add_argument("--max-new-tokens", type=non_negative_int, default=16)
    p.add_argument("--prompt-logprobs", action="store_true", help="also score every prompt token")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=2048)
    source = p.add_mutually_exclusive_group(required=prompts_required)
    source.add_argument("--prompt-ids", help='prompts as token ids, e.g. "1,2,3;4,5,6,7"')
    source.add_argument("--prompts-file", help='JSONL, one {"prompt_ids": [...]} per line')


def run_spec(args: argparse.Namespace, prompts: list[list[int]], **extra) -> RunSpec:
    """What every rank of a run agrees on; the token budget always fits the longest prompt."""
    return RunSpec(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        prompt_logprobs=args.prompt_logprobs,
        max_num_batched_tokens=max([args.max_num_batched_tokens, *(len(p) for p in prompts)]),
        **extra,
    )


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """Flags shared by `generate` and `launch`."""
    add_model_arguments(p, prompts_required=True)
    p.add_argument("--connector", default="none", choices=["none", "p2p", "async"], help="none: one process")
    p.add_argument("--attention", type=positive_int, default=1, help="attention ranks (A)")
    p.add_argument("--ffn", type=positive_int, default=1, help="FFN ranks (F)")
    p.add_argument("--gate-on-ffn", action="store_true", help="run the MoE gate on the FFN side (p2p only)")
    p.add_argument("--config", help="AFD config (file or JSON) for host, port and connector_extra_config")
    p.add_argument("--port", type=positive_int, help="rendezvous port (default: a free one)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before the whole run is given up")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run_generate(args: argparse.Namespace) -> tuple[list, dict]:
    prompts = parse_prompt_ids(args.prompt_ids) if args.prompt_ids else read_prompts_file(args.prompts_file)
    check_prompts(args.model, prompts, args.device)
    if args.connector == "none":
        if getattr(args, "launch", False):
            raise UsageError("afd launch needs --connector p2p or --connector async")
        if (args.attention, args.ffn) != (1, 1):
            raise UsageError("--attention/--ffn need a connector; pass --connector p2p or --connector async")
        from afd.engine import generate

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
        )
        return outputs, {}
    from afd.runtime.launch import free_port, launch

    if args.device == "cuda":
        import torch

        from afd.topology import gpu_placement

        try:
            gpu_placement(args.connector, args.attention, args.ffn, torch.cuda.device_count())
        except ValueError as exc:
            raise UsageError(str(exc)) from None

    base = parse_config(args.config) if args.config else parse_config({})
    config = base.replace(
        connector=args.connector,
        num_attention_ranks=args.attention,
        num_ffn_ranks=args.ffn,
        compute_gate_on_attention=not args.gate_on_ffn,
        port=args.port or (base.port if args.config else free_port(base.host)),
        connector_extra_config=base.to_dict()["connector_extra_config"] if base.connector == args.connector else {},
    )
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
def read_worker_prompts(args: argparse.Namespace) -> list[list[int]]:
    """A replica may legitimately get no prompt, so an empty prompts file is fine here."""
    if args.prompt_ids:
        return parse_prompt_ids(args.prompt_ids)
    if args.prompts_file:
        if Path(args.prompts_file).is_file() and not Path(args.prompts_file).read_text().strip():
            return []
        return read_prompts_file(args.prompts_file)
    return []


def cmd_worker(args: argparse.Namespace) -> int:
    from afd.runtime.worker import RankJob, exit_now, run_rank

    config = parse_config(args.config) if args.config else parse_config({})
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
    size = config.num_attention_ranks if role == "attention" else config.num_ffn_ranks
    if args.rank >= size:
        raise UsageError(f"--rank {args.rank} is out of range for {size} {role} rank(s)")
    prompts = read_worker_prompts(args)
    if prompts and role != "attention":
        raise UsageError("prompts go to attention ranks; an FFN rank takes none")
    check_prompts(args.model, prompts, args.device)
    job = RankJob(
        config=config,
        role=role,
        role_rank=args.rank,
        spec=run_spec(args, prompts),
        prompts=tuple(tuple(p) for p in prompts),
        output_path=Path(args.output) if args.output else None,
        run_token=args.run_token,
        local_host=args.bind_host,
    )
    try:
        code = run_rank(job)
    except BaseException as exc:  # a rank's failure: one line naming it, then leave without teardown
        logging.getLogger("afd.worker").error("%s rank %d: error: %s", role, args.rank, exc)
        exit_now(1)
    exit_now(code)
    return code


def add_worker_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="AFD config (file or JSON); the flags below override its keys")
    p.add_argument("--role", choices=["attention", "ffn"], help="this rank's role (overrides the config's)")
    p.add_argument("--rank", type=non_negative_int, required=True, help="role rank")
    p.add_argument("--connector", choices=["p2p", "async"])
    p.add_argument("--attention", type=positive_int, help="num_attention_ranks")
    p.add_argument("--ffn", type=positive_int, help="num_ffn_ranks")
    p.add_argument("--host", help="host of the world store")
    p.add_argument("--port", type=positive_int, help="port of the world store")
    add_model_arguments(p, prompts_required=False)  # prompts: attention ranks only, this replica's
    p.add_argument("--output", help="attention ranks: write this replica's outputs (JSON) here")
    p.add_argument("--bind-host", help="the address this rank binds to (default: derived from the config's host)")
    p.add_argument("--run-token", default="afd", help="names this run's shared resources (set by afd launch)")


# ---------------------------------------------------------------- afd demo
def cmd_demo(args: argparse.Namespace) -> int:
    from afd.demo import format_table, run_demo

    def progress(msg: str) -> None:
        print(f"[afd demo] {msg}", file=sys.stderr, flush=True)

    reference, runs, ok = run_demo(
        model=args.model,
        num_attn=args.attention,
        num_ffn=args.ffn,
        max_new_tokens=args.max_new_tokens,
        progress=progress,
    )
    print(format_table(reference, runs))
    print("every connector matches the reference" if ok else "MISMATCH: a connector differs from the reference")
    return 0 if ok else 1


# ---------------------------------------------------------------- afd bench
def cmd_bench(args: argparse.Namespace) -> int:
    from afd.bench import Workload, format_bench, run_bench

    check_prompts(args.model, [], args.device)
    connectors = tuple(c for c in args.connectors.split(",") if c)
    bad = [c for c in connectors if c not in ("p2p", "async")]
    if bad or not connectors:
        raise UsageError(f"--connectors takes p2p and/or async separated by ',', got {args.connectors!r}")
    result = run_bench(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        num_attn=args.attention,
        num_ffn=args.ffn,
        connectors=connectors,
        workload=Workload(args.requests, args.long_len, args.short_len, args.max_new_tokens),
        score=not args.no_score,
        progress=lambda msg: print(f"[afd bench] {msg}", file=sys.stderr, flush=True),
    )
    print(format_bench(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
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
    p = sub.add_parser("generate", help="greedy generation, in one process or through a connector")
    add_run_arguments(p)
    p.set_defaults(func=cmd_generate)
    p = sub.add_parser("launch", help="start a whole topology on this host and gather the outputs")
    add_run_arguments(p)
    p.set_defaults(func=cmd_generate, launch=True)

    p = sub.add_parser("worker", help="start one rank (by hand, e.g. on another host)")
    add_worker_arguments(p)
    p.set_defaults(func=cmd_worker)
    p = sub.add_parser("demo", help="the embedded end-to-end check: reference vs every connector, on CPU")
    p.add_argument("--model", default="tiny")
    p.add_argument("--attention", type=positive_int, default=2)
    p.add_argument("--ffn", type=positive_int, default=2)
    p.add_argument("--max-new-tokens", type=positive_int, default=8)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--connectors", default="p2p,async", choices=["p2p,async", "p2p", "async", "async,p2p"])
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser("bench", help="connectors side by side on an uneven request mix, plus numerics")
    p.add_argument("--model", default="tiny")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--attention", type=positive_int, default=2)
    p.add_argument("--ffn", type=positive_int, default=2)
    p.add_argument("--connectors", default="p2p,async")
    p.add_argument("--requests", type=positive_int, default=8, help="prompts per replica")
    p.add_argument("--long-len", type=positive_int, default=1024, help="prompt length on replica 0")
    p.add_argument("--short-len", type=positive_int, default=32, help="prompt length on the other replicas")
    p.add_argument("--max-new-tokens", type=positive_int, default=32)
    p.add_argument("--no-score", action="store_true", help="skip the numerics comparison")
    p.add_argument("--json", help="also write the raw result here")
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO
        if args.verbose or args.command == "worker"
        else logging.WARNING,  # a rank logs like a server
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    try:
        return args.func(args)
    except (UsageError, ConfigError) as exc:
        print(f"afd: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except LaunchError as exc:
        print(f"afd: error: {exc}", file=sys.stderr)
        return 1
