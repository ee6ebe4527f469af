"""The step limits of a server the command line starts (`afd serve`, `afd bench serve`): the flags given, else what
`--profile` picks for the model and topology (`afd.planning.recommend`), else the device's defaults
(`afd.runtime.limits.step_limits`); this module only gathers the numbers that rule needs."""

from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass

from afd.cli.input import UsageError
from afd.runtime.limits import StepLimits, Suggested, step_limits


def add_profile_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--profile",
        help="a machine profile (afd profile's JSON, or a shipped one by name: h200) measured on this device with "
        "this model: the token budget and (async) micro-batches afd plan ranks best for this topology, where "
        "--max-num-batched-tokens / --ubatches are not given",
    )


@dataclass(frozen=True)
class Shape:
    """A server's topology: `none` with `replicas` whole models, or p2p / async `attention`A`ffn`F."""

    connector: str = "none"
    attention: int = 1
    ffn: int = 1
    replicas: int = 1
    gate_on_attention: bool = True

    @property
    def name(self) -> str:
        if self.connector == "none":
            return f"none R={self.replicas}"
        return f"{self.connector} {self.attention}A{self.ffn}F"


@functools.cache
def _gpus() -> tuple[tuple[str, int], ...] | None:
    """(name, total bytes) per visible GPU, probed once per command."""
    from afd.runtime.resources import gpu_info

    info = gpu_info()
    return None if info is None else tuple(info)


def _ranks_on_first_gpu(shape: Shape, num_gpus: int) -> int:
    """Ranks sharing the GPU of the first replica (they divide its memory, as the launcher divides it)."""
    if shape.connector == "none":
        return len(range(0, shape.replicas, num_gpus))
    from afd.topology import gpu_placement

    try:
        placement = gpu_placement(shape.connector, shape.attention, shape.ffn, num_gpus)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    first = shape.ffn if shape.connector == "p2p" else 0  # attention rank 0's world rank (p2p: FFN ranks first)
    return placement.count(placement[first])


def _colocated(shape: Shape, device: str, num_gpus: int) -> bool:
    return device == "cuda" and shape.connector != "none" and num_gpus < shape.attention + shape.ffn


def resolve_step_limits(
    args: argparse.Namespace, model_config, shape: Shape, *, ubatches: int | None = None
) -> StepLimits:
    """The step limits of a server of `shape` started with `args` (server flags of `afd serve`); UsageError in one
    sentence for a profile of another device or model, or one under which the shape does not fit."""
    from afd.runtime.resources import replica_memory

    undecided = args.max_num_batched_tokens is None or args.max_num_seqs is None or getattr(args, "profile", None)
    gpus = _gpus() if args.device == "cuda" and undecided else None
    max_model_len = args.max_model_len or model_config.max_position_embeddings
    quantized = model_config.with_quantization(getattr(args, "quantization", None))
    memory = None
    if gpus:
        memory = replica_memory(
            quantized,
            dtype=args.dtype,
            device_bytes=gpus[0][1],
            gpu_memory_utilization=args.gpu_memory_utilization,
            whole_model=shape.connector == "none",
            ranks_on_gpu=_ranks_on_first_gpu(shape, len(gpus)),
            gate_on_attention=shape.gate_on_attention,
        )
    given = dict(max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs)
    base = step_limits(args.device, memory, **given, ubatches=ubatches, max_model_len=max_model_len)
    suggested = None
    if getattr(args, "profile", None):
        suggested = _suggest(args, quantized, shape, base, gpus, ubatches, max_model_len)
    return step_limits(
        args.device, memory, **given, ubatches=ubatches, suggested=suggested, max_model_len=max_model_len
    )


def _suggest(args, config, shape: Shape, base: StepLimits, gpus, ubatches: int | None, max_model_len: int) -> Suggested:
    """What `--profile` picks for `shape`, after checking that it is this device's and this model's."""
    from afd.planning import costs
    from afd.planning.deployment import Deployment, DeploymentError
    from afd.planning.profile import ProfileError, load_profile
    from afd.planning.recommend import Target, check_profile, recommend

    name = args.profile
    target = Target(args.device, gpus[0][0] if gpus else None, args.model, config)
    fmt = "fp8" if config.fp8_block is not None else args.dtype
    try:
        profile = load_profile(name)
        check_profile(profile, name, target)
        d = Deployment(
            shape.connector,
            shape.attention,
            shape.ffn,
            shape.replicas,
            max_num_seqs=base.max_num_seqs,
            colocated=_colocated(shape, args.device, len(gpus or ())),
        )
        return recommend(
            profile,
            costs.shapes_of(config, fmt),
            d,
            source=name,
            max_model_len=max_model_len,
            budget=args.max_num_batched_tokens,
            ubatches=ubatches,
        )
    except (ProfileError, DeploymentError) as exc:
        raise UsageError(f"--profile {exc}" if not str(exc).startswith("profile") else str(exc)) from None


def apply_step_limits(
    args: argparse.Namespace, model_config, shape: Shape, *, ubatches: int | None = None
) -> StepLimits:
    """Fill in the step limits the flags left out (`resolve_step_limits`) and return them."""
    limits = resolve_step_limits(args, model_config, shape, ubatches=ubatches)
    args.max_num_batched_tokens, args.max_num_seqs = limits.max_num_batched_tokens, limits.max_num_seqs
    if shape.connector != "none":
        args.ubatches = limits.ubatches
    return limits


def compare_with_limits(args: argparse.Namespace, model_config) -> tuple[list, dict[str, StepLimits]]:
    """`--compare`'s (label, flags) with each server's step limits made explicit (`apply_step_limits` per server,
    so each topology gets its own pick), and those limits per label."""
    out, chosen = [], {}
    for label, flags in args.compare:
        given = dict(zip(flags[::2], flags[1::2], strict=False))
        connector = given["--connector"]
        shape = Shape(
            connector,
            int(given.get("--attention", 1)),
            int(given.get("--ffn", 1)),
            int(given.get("--replicas", 1)),
        )
        ubatches = int(given["--ubatches"]) if "--ubatches" in given else None
        one = argparse.Namespace(**vars(args))  # each server decides from the flags as given
        chosen[label] = apply_step_limits(one, model_config, shape, ubatches=ubatches)
        extra = ["--max-num-batched-tokens", str(one.max_num_batched_tokens), "--max-num-seqs", str(one.max_num_seqs)]
        if connector != "none" and ubatches is None:
            extra += ["--ubatches", str(one.ubatches)]
        out.append((label, [*flags, *extra]))
    return out, chosen
