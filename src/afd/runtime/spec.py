"""`RunSpec`: what every rank of a run must agree on besides the AFD config (the launcher writes it into each
rank's command line; the rank reads it back)."""

from __future__ import annotations

from dataclasses import dataclass

from afd.engine.sampling import SamplingParams
from afd.model.kv_cache import CacheOptions
from afd.runtime.limits import SMALL_BUDGET


@dataclass(frozen=True)
class RunSpec:
    """What every rank of a run must agree on besides the AFD config."""

    model: str = "tiny"
    dtype: str = "float32"
    quantization: str | None = None  # "fp8": every attention/MLP linear block-scaled FP8 (afd.model.fp8)
    device: str = "cpu"
    seed: int = 0
    max_new_tokens: int = 16
    prompt_logprobs: bool = False
    max_num_batched_tokens: int = SMALL_BUDGET  # a server's is chosen by afd.runtime.limits.step_limits
    timeout_s: float = 300.0  # the whole run, launcher side
    cache: CacheOptions = CacheOptions()
    sampling: SamplingParams = SamplingParams()  # every request's (greedy by default)
    max_model_len: int | None = None  # positions a request may take (default: the model's)
    busy_poll: bool = False  # a server's idle replicas poll their link without sleeping (a core each)
