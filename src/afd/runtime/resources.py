"""What a run needs against what this machine has, so that an impossible run is refused before it starts.

A run that does not fit does not fail cleanly: 128 ranks on 2 cores thrash for minutes, and a model
larger than the free memory is killed by the OOM killer long after loading began. The estimate here
is deliberately simple and pure (numbers in, one sentence out): weights per rank by role (counted
from the model's own modules built on the meta device, so it cannot drift from the model code), the
KV cache of the prompts a replica holds, and a fixed overhead per process for everything else.
`probe_machine` is the only function that looks at the machine.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from afd.model.attention_side import ModelConfig
from afd.runtime.limits import DEFAULT_MAX_NUM_SEQS, ReplicaMemory
from afd.topology import expert_ranges

log = logging.getLogger(__name__)

MiB = 1 << 20
GiB = 1 << 30
# The CPU tests run 8 ranks on 2 cores (5A3F, 4A4F) and pass; beyond 4 ranks per core every rank spends
# its time waiting for a core and bounded waits start to fire.
MAX_RANKS_PER_CORE = 4
# Host memory of a rank beyond its tensors: the interpreter, torch's libraries (a `tiny` rank measured
# ~310 MB resident, part of it shared libraries), gloo / shared-memory buffers, activations.
CPU_PROCESS_OVERHEAD = 256 * MiB
# On CUDA the host side also carries the CUDA runtime and NCCL / NVSHMEM host state.
CUDA_HOST_OVERHEAD = 1 * GiB
# GPU memory of a rank beyond its tensors: the CUDA context, NCCL buffers or the NVSHMEM heap, activations.
CUDA_DEVICE_OVERHEAD = 2 * GiB
MAX_RUNNING_SEQS = DEFAULT_MAX_NUM_SEQS  # the engine's max_num_seqs: at most this many KV caches at once
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GPU_PROBE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Machine:
    """What this machine offers: usable CPU cores, available host memory, free memory per visible GPU."""

    cpus: int
    mem_available: int | None  # bytes; None when unknown (then host memory is not checked)
    gpu_free: tuple[int, ...] | None = None  # bytes per GPU index; None when unknown or not asked for


@dataclass(frozen=True)
class RankNeed:
    """One process of the run: its role, host memory, and (on CUDA) its GPU and GPU memory."""

    role: str  # "attention", "ffn" or "single process"
    host_bytes: int
    gpu: int | None = None
    gpu_bytes: int = 0


def gb(n: int | float) -> str:
    return f"{n / 1e9:.1f} GB"


# ---------------------------------------------------------------- weights
def _is_gate(name: str) -> bool:
    """The router's tensors stay float32 whatever the model dtype (see `afd.model.weights`)."""
    return name.endswith((".gate.weight", ".gate.e_score_correction_bias"))


def _param_width(name: str, param, dtype: str) -> int:
    """Bytes per value of one parameter once loaded: FP8 weights (`afd.model.fp8`, the model built from a config
    with `fp8_block`) stay one byte and their block scales float32, as does the router; the rest takes `dtype`."""
    if param.element_size() == 1 and param.is_floating_point():
        return 1
    return 4 if _is_gate(name) or name.endswith("_scale_inv") else DTYPE_BYTES[dtype]


def _module_bytes(module, dtype: str) -> int:
    return sum(p.numel() * _param_width(n, p, dtype) for n, p in module.named_parameters())


def attention_weight_bytes(config: ModelConfig, dtype: str, *, gate_on_attention: bool = True) -> int:
    """Bytes of the attention side's weights (every attention rank holds all of them)."""
    import torch

    from afd.model.attention_side import AttentionModel
    from afd.model.fp8 import FP8Linear

    with torch.device("meta"):
        model = AttentionModel(config, gate_on_attention=gate_on_attention)
    total = _module_bytes(model, dtype)
    if config.tie_word_embeddings:
        total -= model.lm_head.weight.numel() * DTYPE_BYTES[dtype]
    for layer in model.layers:  # an FP8 kv_b_proj is also kept dequantized (`FP8Linear.keep_dense`)
        if isinstance(layer.self_attn.kv_b_proj, FP8Linear):
            total += layer.self_attn.kv_b_proj.weight.numel() * DTYPE_BYTES[dtype]
    return total


def ffn_weight_bytes(
    config: ModelConfig, dtype: str, *, num_experts: int | None = None, gate_on_attention: bool = True
) -> int:
    """Bytes of an FFN rank's weights holding `num_experts` routed experts (default all of them)."""
    import torch

    from afd.model.ffn_side import FFNModel

    n = config.n_routed_experts if num_experts is None else num_experts
    with torch.device("meta"):
        model = FFNModel(config, expert_range=(0, n), gate_on_attention=gate_on_attention)
    return _module_bytes(model, dtype)


def kv_bytes_per_token(config: ModelConfig, dtype: str) -> int:
    """The MLA cache keeps one latent of kv_lora_rank + qk_rope_head_dim values per layer and token."""
    return (config.kv_lora_rank + config.qk_rope_head_dim) * config.num_hidden_layers * DTYPE_BYTES[dtype]


def kv_cache_bytes(config: ModelConfig, dtype: str, prompt_lengths: list[int], max_new_tokens: int) -> int:
    """Upper bound of one replica's KV cache: the largest sequences that can run at once."""
    capacities = sorted((n + max(max_new_tokens - 1, 0) for n in prompt_lengths), reverse=True)
    return sum(capacities[:MAX_RUNNING_SEQS]) * kv_bytes_per_token(config, dtype)


# ---------------------------------------------------------------- a run
def world_roles(connector: str, num_attention: int, num_ffn: int) -> list[tuple[str, int]]:
    """(role, role rank) of each world rank: FFN ranks first for p2p, attention first for async (DESIGN §1)."""
    attention = [("attention", a) for a in range(num_attention)]
    ffn = [("ffn", f) for f in range(num_ffn)]
    return ffn + attention if connector == "p2p" else attention + ffn


def run_needs(
    config: ModelConfig,
    *,
    dtype: str,
    device: str,
    connector: str,
    num_attention: int = 1,
    num_ffn: int = 1,
    gate_on_attention: bool = True,
    prompt_lengths: Sequence[int] = (),
    max_new_tokens: int = 0,
    placement: list[int] | None = None,
) -> list[RankNeed]:
    """One RankNeed per process of the run. `connector` "none" is the single-process engine.

    `prompt_lengths` are in prompt order (prompt i goes to replica i % A); `placement` is the GPU of
    each world rank (CUDA only; default GPU 0 for every rank).
    """
    cuda = device == "cuda"
    overhead = CUDA_HOST_OVERHEAD if cuda else CPU_PROCESS_OVERHEAD
    lengths = list(prompt_lengths)

    def need(role: str, tensor_bytes: int, gpu: int) -> RankNeed:
        if cuda:  # weights and cache live on the GPU; the host keeps the process overhead
            return RankNeed(role, overhead, gpu, tensor_bytes + CUDA_DEVICE_OVERHEAD)
        return RankNeed(role, tensor_bytes + overhead)

    if connector == "none":
        weights = attention_weight_bytes(config, dtype, gate_on_attention=gate_on_attention)
        weights += ffn_weight_bytes(config, dtype, gate_on_attention=gate_on_attention)
        kv = kv_cache_bytes(config, dtype, lengths, max_new_tokens)
        return [need("single process", weights + kv, placement[0] if placement else 0)]

    attn_weights = attention_weight_bytes(config, dtype, gate_on_attention=gate_on_attention)
    ffn_weights = {
        n: ffn_weight_bytes(config, dtype, num_experts=n, gate_on_attention=gate_on_attention)
        for n in {len(r) for r in expert_ranges(config.n_routed_experts, num_ffn)}
    }
    experts = [len(r) for r in expert_ranges(config.n_routed_experts, num_ffn)]
    out = []
    for world_rank, (role, rank) in enumerate(world_roles(connector, num_attention, num_ffn)):
        gpu = placement[world_rank] if placement else 0
        if role == "attention":
            kv = kv_cache_bytes(config, dtype, lengths[rank::num_attention], max_new_tokens)
            out.append(need(role, attn_weights + kv, gpu))
        else:
            out.append(need(role, ffn_weights[experts[rank]], gpu))
    return out


def _describe(ranks: list[RankNeed], key: str) -> str:
    """`2 attention ranks of 1.2 GB, 2 ffn ranks of 0.8 GB` (largest first within a role)."""
    counts = Counter(r.role for r in ranks)
    parts = []
    for role, count in counts.items():
        largest = max(getattr(r, key) for r in ranks if r.role == role)
        if role == "single process":
            parts.append(f"one process of {gb(largest)}")
        else:
            parts.append(f"{count} {role} rank{'s' if count > 1 else ''} of up to {gb(largest)}")
    return ", ".join(parts)


def check(ranks: list[RankNeed], machine: Machine) -> str | None:
    """The first reason the run does not fit this machine, as one sentence with the numbers; None if it fits."""
    limit = MAX_RANKS_PER_CORE * machine.cpus
    if len(ranks) > limit:
        return (
            f"{len(ranks)} ranks on {machine.cpus} CPU core{'s' if machine.cpus > 1 else ''} is more than "
            f"{MAX_RANKS_PER_CORE} per core ({limit} at most here)"
        )
    host = sum(r.host_bytes for r in ranks)
    if machine.mem_available is not None and host > machine.mem_available:
        return (
            f"the run needs about {gb(host)} of memory ({_describe(ranks, 'host_bytes')}) "
            f"but this machine has {gb(machine.mem_available)} available"
        )
    if machine.gpu_free is not None:
        for gpu in sorted({r.gpu for r in ranks if r.gpu is not None}):
            on_gpu = [r for r in ranks if r.gpu == gpu]
            used = sum(r.gpu_bytes for r in on_gpu)
            free = machine.gpu_free[gpu] if gpu < len(machine.gpu_free) else 0
            if used > free:
                return (
                    f"GPU {gpu} would need about {gb(used)} ({_describe(on_gpu, 'gpu_bytes')}) but has {gb(free)} free"
                )
    return None


# ---------------------------------------------------------------- this machine
def usable_cpus() -> int:
    """Cores this process may run on (its affinity mask, which containers and taskset narrow)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def parse_meminfo(text: str) -> int | None:
    """MemAvailable from the text of /proc/meminfo, in bytes; None when absent."""
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name == "MemAvailable":
            fields = rest.split()
            if fields and fields[0].isdigit():
                return int(fields[0]) * (1024 if fields[1:2] == ["kB"] else 1)
    return None


def available_memory() -> int | None:
    try:
        return parse_meminfo(Path("/proc/meminfo").read_text())
    except OSError:
        return None


_GPU_PROBE = (
    "import json, torch; print(json.dumps([torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count())]))"
)


def free_gpu_memory(timeout_s: float = GPU_PROBE_TIMEOUT_S) -> tuple[int, ...] | None:
    """Free bytes per visible GPU, asked in a child process so that this one holds no CUDA context on
    every GPU for the rest of the run; None (and a warning) when the probe fails or takes too long."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _GPU_PROBE], capture_output=True, text=True, timeout=timeout_s, check=False
        )
        if proc.returncode == 0:
            return tuple(int(x) for x in json.loads(proc.stdout.strip().splitlines()[-1]))
        reason = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    except subprocess.TimeoutExpired:
        reason = f"no answer within {timeout_s:.0f} s"
    except (OSError, ValueError, IndexError) as exc:
        reason = str(exc)
    log.warning("GPU memory was not checked: the probe failed (%s)", reason)
    return None


_GPU_INFO_PROBE = (
    "import json, torch; print(json.dumps([[torch.cuda.get_device_name(i), torch.cuda.get_device_properties(i)"
    ".total_memory] for i in range(torch.cuda.device_count())]))"
)


def gpu_info(timeout_s: float = GPU_PROBE_TIMEOUT_S) -> list[tuple[str, int]] | None:
    """(name, total bytes) per visible GPU, asked in a child process as `free_gpu_memory` does; None (and a
    warning) when the probe fails."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _GPU_INFO_PROBE], capture_output=True, text=True, timeout=timeout_s, check=False
        )
        if proc.returncode == 0:
            return [(str(n), int(t)) for n, t in json.loads(proc.stdout.strip().splitlines()[-1])]
        reason = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    except subprocess.TimeoutExpired:
        reason = f"no answer within {timeout_s:.0f} s"
    except (OSError, ValueError, IndexError, TypeError) as exc:
        reason = str(exc)
    log.warning("the GPU's name and memory are unknown: the probe failed (%s)", reason)
    return None


def replica_memory(
    config: ModelConfig,
    *,
    dtype: str,
    device_bytes: int,
    gpu_memory_utilization: float,
    whole_model: bool,
    ranks_on_gpu: int = 1,
    gate_on_attention: bool = True,
) -> ReplicaMemory:
    """One replica's memory on a GPU of `device_bytes`, as its engine will size its cache: its share of the GPU
    (`gpu_memory_utilization` over the ranks on that GPU) less its weights (`whole_model`: attention and every
    expert; else the attention side) and the fixed overhead; the activations per budget token as the engine
    estimates them (with one prefill graph runner, holding the MoE when the replica is the whole model)."""
    import torch

    from afd.engine.model_runner import step_activation_bytes

    weights = attention_weight_bytes(config, dtype, gate_on_attention=gate_on_attention)
    if whole_model:
        weights += ffn_weight_bytes(config, dtype, gate_on_attention=gate_on_attention)
    share = int(device_bytes * gpu_memory_utilization / max(1, ranks_on_gpu))
    return ReplicaMemory(
        device_bytes=device_bytes,
        cache_bytes=share - weights - CUDA_DEVICE_OVERHEAD,
        kv_bytes_per_token=kv_bytes_per_token(config, dtype),
        activation_bytes_per_token=step_activation_bytes(config, getattr(torch, dtype), 1, 1, moe_inside=whole_model),
    )


def probe_machine(*, gpus: bool) -> Machine:
    return Machine(usable_cpus(), available_memory(), free_gpu_memory() if gpus else None)
