"""The step limits a server runs with when its flags do not say: the token budget of one step
(`max_num_batched_tokens`), the sequences a replica runs at once (`max_num_seqs`) and the micro-batches of a step.

One pure function, `step_limits`, decides them from numbers passed in (the device, its memory, the flags given, what
a profile suggests), so the rule is tested without a GPU. Each value comes from, in order: the flag the user gave;
what a measured profile suggests for this model and topology; the device's default — on a GPU of at least 70 GiB
(the class vLLM and SGLang give larger defaults) a budget of 8,192 tokens and 1,024 sequences where the KV cache
holds 1,024 sequences of `SEQ_TOKENS` tokens; below that, on CPU, or when the GPU's memory is unknown, 2,048 tokens
and 256 sequences (fewer where the cache holds fewer).
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1 << 30
LARGE_GPU_BYTES = 70 * GiB  # a GPU of at least this much memory gets the larger defaults
SMALL_BUDGET = 2048  # tokens per step: CPU, smaller GPUs, unknown memory
LARGE_BUDGET = 8192  # tokens per step on a large GPU
DEFAULT_MAX_NUM_SEQS = 256
LARGE_MAX_NUM_SEQS = 1024
SEQ_TOKENS = 1024  # cache tokens one sequence slot should have before the default offers it


@dataclass(frozen=True)
class ReplicaMemory:
    """One replica's GPU memory, in bytes: the GPU's total, and what its KV cache and step activations may share
    (its share of the GPU less its weights and fixed overheads)."""

    device_bytes: int
    cache_bytes: int
    kv_bytes_per_token: int
    activation_bytes_per_token: int

    def cache_tokens(self, budget: int) -> int:
        """KV-cache tokens left once a step of `budget` tokens has its activations."""
        left = self.cache_bytes - budget * self.activation_bytes_per_token
        return max(0, left // max(1, self.kv_bytes_per_token))


@dataclass(frozen=True)
class Suggested:
    """What a profile picks for a model and topology (None: no opinion), and the profile's name."""

    max_num_batched_tokens: int | None = None
    ubatches: int | None = None
    max_num_seqs: int | None = None
    source: str = "profile"


@dataclass(frozen=True)
class StepLimits:
    """The chosen values and, for each, where it came from ("flag", "profile NAME" or a default's reason)."""

    max_num_batched_tokens: int
    max_num_seqs: int
    ubatches: int
    budget_from: str
    seqs_from: str
    ubatches_from: str

    def describe(self, ubatches: bool = True) -> str:
        """One line: each value and where it came from (`ubatches` False leaves the micro-batches out)."""
        line = (
            f"max_num_batched_tokens {self.max_num_batched_tokens} ({self.budget_from}), "
            f"max_num_seqs {self.max_num_seqs} ({self.seqs_from})"
        )
        return line + (f", ubatches {self.ubatches} ({self.ubatches_from})" if ubatches else "")

    def to_json(self) -> dict:
        return {
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_num_seqs": self.max_num_seqs,
            "ubatches": self.ubatches,
            "from": {
                "max_num_batched_tokens": self.budget_from,
                "max_num_seqs": self.seqs_from,
                "ubatches": self.ubatches_from,
            },
        }


def _gpu(device: str, memory: ReplicaMemory | None) -> str:
    if device != "cuda":
        return device
    if memory is None:
        return "a GPU of unknown memory"
    return f"a GPU of {memory.device_bytes / GiB:.0f} GiB"


def machine_defaults(on_gpu: bool, device_bytes: float | None) -> tuple[int, int]:
    """(token budget, sequences) a server on this machine starts from before its KV cache is sized: the larger
    pair on a GPU of at least 70 GiB (the cache may then cut the sequences: `default_max_num_seqs`)."""
    if on_gpu and device_bytes is not None and device_bytes >= LARGE_GPU_BYTES:
        return LARGE_BUDGET, LARGE_MAX_NUM_SEQS
    return SMALL_BUDGET, DEFAULT_MAX_NUM_SEQS


def default_budget(device: str, memory: ReplicaMemory | None) -> tuple[int, str]:
    """The device's token budget and why: 8,192 on a GPU of at least 70 GiB, else 2,048."""
    budget, _ = machine_defaults(device == "cuda", memory.device_bytes if memory else None)
    return budget, f"default on {_gpu(device, memory)}"


def default_max_num_seqs(device: str, memory: ReplicaMemory | None, budget: int, max_model_len: int) -> tuple[int, str]:
    """The device's sequence cap and why: 1,024 on a large GPU whose cache holds that many sequences of
    min(`SEQ_TOKENS`, `max_model_len`) tokens, else 256, or as many as the cache holds when that is fewer."""
    why = f"default on {_gpu(device, memory)}"
    if device != "cuda" or memory is None:
        return DEFAULT_MAX_NUM_SEQS, why
    per_seq = max(1, min(SEQ_TOKENS, max_model_len))
    fits = memory.cache_tokens(budget) // per_seq
    if memory.device_bytes >= LARGE_GPU_BYTES and fits >= LARGE_MAX_NUM_SEQS:
        return LARGE_MAX_NUM_SEQS, why
    if fits >= DEFAULT_MAX_NUM_SEQS:
        return DEFAULT_MAX_NUM_SEQS, why
    return max(1, fits), f"{why}: its KV cache holds {max(1, fits)} sequences of {per_seq} tokens"


def step_limits(
    device: str,
    memory: ReplicaMemory | None,
    *,
    max_num_batched_tokens: int | None = None,
    max_num_seqs: int | None = None,
    ubatches: int | None = None,
    suggested: Suggested | None = None,
    max_model_len: int = SEQ_TOKENS,
) -> StepLimits:
    """The step limits of a replica: each flag given wins, then what `suggested` (a profile) picks, then the
    device's default (`default_budget`, `default_max_num_seqs`, one micro-batch)."""
    s = suggested or Suggested()

    def pick(given: int | None, from_profile: int | None, default: tuple[int, str]) -> tuple[int, str]:
        if given is not None:
            return given, "flag"
        if from_profile is not None:
            return from_profile, s.source
        return default

    budget, budget_from = pick(max_num_batched_tokens, s.max_num_batched_tokens, default_budget(device, memory))
    seqs, seqs_from = pick(max_num_seqs, s.max_num_seqs, default_max_num_seqs(device, memory, budget, max_model_len))
    m, m_from = pick(ubatches, s.ubatches, (1, "default"))
    return StepLimits(budget, seqs, m, budget_from, seqs_from, m_from)
