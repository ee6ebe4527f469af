"""The arguments several `afd` commands share (model, run, cache, sampling, resource check) and what they
build: a `RunSpec`, `SamplingParams`, `CacheOptions`, and the refusal of a run this machine cannot hold."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING

from afd.cli.input import (
    UsageError,
    batched_tokens,
    block_size,
    max_num_seqs,
    memory_fraction,
    non_negative_int,
    port_number,
    positive_int,
    positive_seconds,
    rank_count,
    sampling_value,
    strict_int,
)
from afd.runtime.limits import DEFAULT_MAX_NUM_SEQS, SMALL_BUDGET

if TYPE_CHECKING:
    from afd.config import AFDConfig
    from afd.runtime.spec import RunSpec


def check_resources(
    args: argparse.Namespace,
    model_config,
    *,
    connector: str,
    num_attention: int = 1,
    num_ffn: int = 1,
    prompts: Sequence[Sequence[int]] = (),
    max_new_tokens: int = 0,
    gate_on_attention: bool = True,
) -> None:
    """Refuse a run this machine cannot hold (a topology the visible GPUs cannot place; processes per core,
    host and GPU memory), with the numbers, before anything starts; `--skip-resource-check` skips the second."""
    placement = None
    if args.device == "cuda" and connector != "none":
        import torch

        from afd.topology import gpu_placement

        try:
            placement = gpu_placement(connector, num_attention, num_ffn, torch.cuda.device_count())
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    if args.skip_resource_check:
        return
    from afd.runtime import resources

    model_config = model_config.with_quantization(getattr(args, "quantization", None))

    needs = resources.run_needs(
        model_config,
        dtype=getattr(args, "dtype", "float32"),
        device=args.device,
        connector=connector,
        num_attention=num_attention,
        num_ffn=num_ffn,
        gate_on_attention=gate_on_attention,
        prompt_lengths=[len(p) for p in prompts],
        max_new_tokens=max_new_tokens,
        placement=placement,
    )
    problem = resources.check(needs, resources.probe_machine(gpus=args.device == "cuda"))
    if problem:
        raise UsageError(
            f"{problem}; use fewer ranks, a smaller model or --dtype, or pass --skip-resource-check to start anyway"
        )


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


def add_model_arguments(p: argparse.ArgumentParser, *, prompts_required: bool) -> None:
    """The model, its numerics and the prompts: shared by `generate`, `launch` and `worker`."""
    p.add_argument("--model", required=True, help="checkpoint directory (config.json + *.safetensors) or preset")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="weights dtype")
    add_quantization_flag(p)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the ranks compute")
    p.add_argument("--seed", type=non_negative_int, default=0, help="seed of preset weights")
    p.add_argument(
        "--max-new-tokens",
        type=non_negative_int,
        default=16,
        help="tokens generated per prompt (prompt + new tokens must fit the model's positions)",
    )
    p.add_argument("--prompt-logprobs", action="store_true", help="also score every prompt token")
    p.add_argument(
        "--temperature",
        type=sampling_value("temperature", float),
        default=0.0,
        help="sampling temperature of every request; 0 is greedy, else at least 0.01",
    )
    p.add_argument(
        "--top-p",
        type=sampling_value("top_p", float),
        default=1.0,
        help="keep the most likely tokens up to this probability mass, in (0, 1]; 1 keeps all",
    )
    p.add_argument(
        "--top-k",
        type=sampling_value("top_k", strict_int),
        default=0,
        help="keep the k most likely tokens; 0 keeps all (vLLM's -1 is 0 here)",
    )
    p.add_argument(
        "--sampling-seed",
        type=sampling_value("seed", strict_int),
        help="seed of every request's sampling: the same seed and prompt give the same tokens in any batch "
        "(default: fresh randomness; --seed is the preset weights')",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=batched_tokens,
        default=SMALL_BUDGET,
        help="token budget of one engine step, as in vLLM; longer prompts are prefilled in chunks over several steps",
    )
    p.add_argument("--block-size", type=block_size, default=16, help="tokens per KV-cache block")
    p.add_argument(
        "--gpu-memory-utilization",
        type=memory_fraction,
        default=0.9,
        help="fraction of a GPU's memory an engine may use for weights, activations and its KV cache, as in vLLM "
        "(afd launch divides it among the ranks that share a GPU)",
    )
    p.add_argument(
        "--num-gpu-blocks-override",
        type=positive_int,
        help="KV-cache blocks per engine, instead of sizing the cache from memory (any device)",
    )
    p.add_argument(
        "--max-num-seqs", type=max_num_seqs, default=DEFAULT_MAX_NUM_SEQS, help="sequences an engine runs at once"
    )
    source = p.add_mutually_exclusive_group(required=prompts_required)
    source.add_argument("--prompt-ids", help="prompts as token ids, e.g. \"1,2,3;4,5,6,7\" (',' ids, ';' prompts)")
    source.add_argument("--prompts-file", help='JSONL file, one {"prompt_ids": [...]} per line')


def add_quantization_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--quantization",
        choices=["fp8"],
        help="fp8: every attention/MLP linear as block-scaled FP8 (DeepSeek-V3's format, 128x128 blocks), quantized "
        "at load from a 16/32-bit checkpoint or preset; --dtype stays the compute dtype (default: the checkpoint's "
        "own format; an FP8 checkpoint loads as FP8 either way)",
    )


def run_spec(args: argparse.Namespace, prompts: list[list[int]], **extra) -> RunSpec:
    """What every rank of a run agrees on; the token budget is the per-step budget as given (chunked prefill
    splits longer prompts), so it also bounds every exchange (the async window is sized by it)."""
    from afd.runtime.spec import RunSpec

    return RunSpec(
        model=args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        device=args.device,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        prompt_logprobs=args.prompt_logprobs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        cache=cache_options(args),
        sampling=sampling_params(args),
        **extra,
    )


def sampling_params(args: argparse.Namespace):
    """The sampling flags of generate, launch and worker (each already checked by its argparse type)."""
    from afd.engine.sampling import SamplingParams

    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.sampling_seed)


def cache_options(args: argparse.Namespace):
    """The KV-cache flags of generate, launch and worker (demo and bench take the defaults)."""
    from afd.model.kv_cache import CacheOptions

    if not hasattr(args, "block_size"):
        return CacheOptions()
    return CacheOptions(
        block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        num_blocks=args.num_gpu_blocks_override,
        max_num_seqs=args.max_num_seqs,
    )


def add_skip_resource_check(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--skip-resource-check",
        action="store_true",
        help="start even when the run looks too large for this machine (processes per core, memory)",
    )


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """Flags shared by `generate` and `launch`."""
    add_model_arguments(p, prompts_required=True)
    p.add_argument(
        "--connector", default="none", choices=["none", "p2p", "async"], help="none: the single-process reference"
    )
    p.add_argument("--attention", type=rank_count, default=1, help="attention ranks (A)")
    p.add_argument("--ffn", type=rank_count, default=1, help="FFN ranks (F)")
    p.add_argument("--gate-on-ffn", action="store_true", help="run the MoE gate on the FFN side (p2p only)")
    add_shared_experts_flag(p)
    p.add_argument("--config", help="AFD config (file or JSON) for host, port and connector_extra_config")
    p.add_argument("--port", type=port_number, help="rendezvous port (default: a free one, or the config's)")
    p.add_argument("--timeout", type=positive_seconds, default=600.0, help="seconds before the whole run is given up")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no CUDA graphs (as in vLLM); graphs are used only by the single-process engine on CUDA bf16 decode",
    )
    add_skip_resource_check(p)


def add_shared_experts_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--shared-experts",
        choices=["ffn", "attention"],
        help="where the shared experts run (default: the config's, else attention with --connector async and ffn "
        "otherwise); attention (async only): on each attention rank, between a layer's send and its recv, while the "
        "FFN ranks compute the routed experts",
    )


def shared_experts_keys(connector: str, where: str | None) -> dict:
    """The `connector_extra_config` keys `--shared-experts` sets (none when it was not given); UsageError for a
    connector that cannot run them on its attention side."""
    if where == "attention" and connector != "async":
        raise UsageError(
            f"--shared-experts attention needs --connector async (connector {connector} runs the shared experts "
            "on its FFN side)"
        )
    return {"shared_experts_on_attention": where == "attention"} if where and connector == "async" else {}


def launch_config(
    source: str | None,
    connector: str,
    *,
    port: int | None = None,
    shared_experts: str | None = None,
    num_ubatches: int = 1,
    **changes: object,
) -> AFDConfig:
    """The AFD config of a launch: `--config` (a file or JSON; one that names no connector is read as `connector`'s)
    under the command line's choices (`shared_experts`: `--shared-experts`; when neither it nor the config says,
    the connector's command-line default, `config.default_shared_experts`; `num_ubatches` > 1: the connector's
    micro-batching, `config.ubatch_keys`). A config written for the other
    connector keeps none of its extra keys; the rendezvous port is `port`, else the config's when one was given,
    else a free one."""
    from afd.config import default_shared_experts, given_extra_keys, parse_config, ubatch_keys
    from afd.runtime.launch import free_port

    base = parse_config(source if source else {}, default_connector=connector)
    same_connector = base.connector == connector
    extra = base.to_dict()["connector_extra_config"] if same_connector else {}
    given = given_extra_keys(source) if source and same_connector else set()
    if shared_experts is None and "shared_experts_on_attention" not in given:
        shared_experts = default_shared_experts(connector)
    extra |= shared_experts_keys(connector, shared_experts)
    if num_ubatches > 1:
        extra |= ubatch_keys(connector, num_ubatches)
        if "ring_depth" not in given:
            extra.pop("ring_depth", None)  # unless the config sets it, it follows the micro-batches in flight
    port = port or (base.port if source else free_port(base.host))
    return base.replace(connector=connector, connector_extra_config=extra, port=port, **changes)
