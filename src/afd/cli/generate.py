"""`afd generate`, `afd launch` and `afd demo`: generation in one process or through a connector, and the
single-process reference beside every connector."""

from __future__ import annotations

import argparse
import json
import sys

from afd import env
from afd.cli.args import (
    add_run_arguments,
    add_skip_resource_check,
    cache_options,
    check_launched_runs,
    check_resources,
    launch_config,
    run_spec,
    sampling_params,
    shared_experts_keys,
)
from afd.cli.input import (
    UsageError,
    check_cache_fits,
    check_prompts,
    connector_list,
    positive_int,
    rank_count,
    read_prompts,
)
from afd.cli.nodes import add_node_arguments, check_node_flags, is_multi_node, node_spec
from afd.distributed import signals


def add_generate_parsers(sub) -> None:
    """Register `generate` and `launch` under `afd`'s sub-commands."""
    p = sub.add_parser("generate", help="generation (greedy by default), in one process or through a connector")
    add_run_arguments(p)
    p.set_defaults(func=cmd_generate)
    p = sub.add_parser("launch", help="start a whole topology (with --nnodes: this host's share) and gather outputs")
    add_run_arguments(p)
    add_node_arguments(p)
    p.set_defaults(func=cmd_generate, launch=True, starts_ranks=True)


def run_generate(args: argparse.Namespace) -> tuple[list, dict] | None:
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
            quantization=args.quantization,
        )
        return outputs, {}
    from afd.runtime.launch import launch

    world_size = args.attention + args.ffn
    if getattr(args, "launch", False):
        check_node_flags(args, world_size)
    config = launch_config(
        args.config,
        args.connector,
        port=args.port or getattr(args, "master_port", None),
        shared_experts=args.shared_experts,
        num_attention_ranks=args.attention,
        num_ffn_ranks=args.ffn,
        compute_gate_on_attention=not args.gate_on_ffn,
    )
    if getattr(args, "master_addr", None):
        config = config.replace(host=args.master_addr)
    if is_multi_node(args):  # this host's share: the memory check of a whole world on one host does not apply
        from afd.runtime.nodes import launch_node

        signals.raise_if_signalled()
        node = node_spec(args, config.host, config.port, world_size)
        return launch_node(config, run_spec(args, prompts, timeout_s=args.timeout), prompts, node, env.secret())
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
    run = run_generate(args)
    if run is None:  # a node K > 0 of a run over several hosts: node 0 prints the run's outputs
        return 0
    outputs, _ = run
    if args.json:
        print(json.dumps({"outputs": [output_json(o, args.prompt_logprobs) for o in outputs]}))
    else:
        for i, out in enumerate(outputs):
            print(f"[{i}] {out.prompt_ids} -> {out.token_ids}")
    return 0


def add_demo_parser(sub) -> None:
    """Register `demo` under `afd`'s sub-commands."""
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
