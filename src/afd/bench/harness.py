"""The run harness of `afd demo`, `afd bench` and `afd bench serve`: runs measured from the outside.

A launched run (`run_connector`: one process per rank through `afd.runtime.launch`), the single-process
reference engine (`run_reference`), and one whole-model replica driven in this process with requests
that arrive at given times (`replica_engine` + `drive_arrivals`: the engine alone, without a front end).
It sits above the role runtimes (`rank`, `worker`, `async_rank`, `online`): it imports them, they never
import it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from afd.config import parse_config
from afd.engine.engine import Engine, Output, Request
from afd.runtime.spec import RunSpec

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    connector: str
    topology: str
    outputs: list[Output]
    elapsed_s: float
    ttft_s: list[float]
    replicas: list[dict] = field(default_factory=list)

    @property
    def generated_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank q-th percentile; nan for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def max_logprob_diff(reference: list[Output], outputs: list[Output]) -> float:
    """Largest |Δ| over generated and prompt log-probabilities; inf if the greedy tokens differ."""
    worst = 0.0
    for ref, out in zip(reference, outputs, strict=True):
        if ref.token_ids != out.token_ids:
            return float("inf")
        pairs = list(zip(ref.logprobs, out.logprobs, strict=True))
        if ref.prompt_logprobs is not None and out.prompt_logprobs is not None:
            pairs += [(a, b) for a, b in zip(ref.prompt_logprobs, out.prompt_logprobs, strict=True) if a is not None]
        worst = max([worst, *(abs(a - b) for a, b in pairs)])
    return worst


def run_reference(spec: RunSpec, prompts: list[list[int]]) -> RunResult:
    """The single-process engine, timed the same way as a replica. On CUDA its KV pool takes most of the
    GPU (`gpu_memory_utilization`): everything is handed back before the launched ranks need the GPUs."""
    try:
        return _run_reference(spec, prompts)
    finally:
        release_device_memory(spec.device)


def release_device_memory(device: str) -> None:
    """Return this process's cached GPU memory to the driver (the reference engine is gone by now)."""
    if device == "cuda":
        import gc

        import torch

        gc.collect()  # graphs and cache tensors may sit in reference cycles
        torch.cuda.empty_cache()


def _run_reference(spec: RunSpec, prompts: list[list[int]]) -> RunResult:
    from afd.engine.engine import LocalExchange
    from afd.model.weights import load_attention_model, load_ffn_model
    from afd.runtime.rank import RankJob, drive_replica

    load = dict(dtype=spec.dtype, device=spec.device, seed=spec.seed, quantization=spec.quantization)
    attn, ffn = load_attention_model(spec.model, **load), load_ffn_model(spec.model, **load)
    budget = max(spec.max_num_batched_tokens, *map(len, prompts))
    engine = Engine(attn, LocalExchange(ffn), budget, **spec.cache.engine_kwargs())
    job = RankJob(
        config=parse_config({}),
        role="attention",
        role_rank=0,
        spec=spec,
        prompts=tuple(map(tuple, prompts)),
    )
    outputs, stats = drive_replica(engine, job, lambda has_work: has_work)
    return RunResult("none", "1 proc", outputs, stats.end - stats.start, stats.to_json()["ttft_s"], [stats.to_json()])


def run_connector(
    connector: str,
    num_attn: int,
    num_ffn: int,
    spec: RunSpec,
    prompts: list[list[int]],
    *,
    extra_config: dict | None = None,
) -> RunResult:
    """One launched run; elapsed is the slowest replica's engine time (process start and loading excluded).
    `extra_config`: the connector's `connector_extra_config` (e.g. async micro-batching)."""
    from afd.runtime.launch import free_port, launch

    config = parse_config(
        {
            "connector": connector,
            "num_attention_ranks": num_attn,
            "num_ffn_ranks": num_ffn,
            "port": free_port(),
            "connector_extra_config": extra_config or {},
        }
    )
    outputs, stats = launch(config, spec, prompts)
    replicas = stats["replicas"]
    elapsed = max((r["elapsed_s"] for r in replicas if r), default=0.0)
    ttft = [t for r in replicas for t in r.get("ttft_s", [])]
    return RunResult(connector, f"{num_attn}A{num_ffn}F", outputs, elapsed, ttft, replicas)


# ---------------------------------------------------------------- the engine alone, with arrivals
def replica_engine(spec: RunSpec) -> Engine:
    """One whole-model replica in this process, built as `afd serve --connector none` builds each of its
    replicas (`afd.runtime.worker.run_local_replica`): same device choice, token budget, cache, model length,
    warm-up and decode CUDA graphs. Call `release_device_memory` after dropping it."""
    from afd.runtime.rank import RankJob, local_replica_engine

    # GPU 0, as a server's replica 0 (a job without an index refuses a host with several GPUs)
    job = RankJob(config=parse_config({}), role="replica", role_rank=0, spec=spec, device_index=0)
    return local_replica_engine(job)


def drive_arrivals(
    engine: Engine,
    requests: list[Request],
    arrivals_s: list[float],
    timeout_s: float,
    on_finished: Callable[[], None] = lambda: None,
) -> list[list[float]]:
    """Each request enters `engine` at its arrival (seconds from now), between two steps as a served replica
    takes it; per request, when each of its tokens left a step, in seconds from its arrival. `on_finished()`
    after each request's last token (progress).

    What a front end adds to time to first token is measured against this: the same requests at the same
    times, without HTTP, router or link. TimeoutError when the requests are not done within `timeout_s`.
    """
    order = sorted(range(len(requests)), key=arrivals_s.__getitem__)
    token_times: list[list[float]] = [[] for _ in requests]
    index_of: dict[int, int] = {}  # engine request id -> index into `requests`
    start = time.perf_counter()
    added = 0
    while added < len(order) or engine.has_work():
        now = time.perf_counter() - start
        if now > timeout_s:
            raise TimeoutError(f"the engine had not finished {len(requests)} requests within {timeout_s:g} s")
        while added < len(order) and arrivals_s[order[added]] <= now:
            index_of[engine.add(requests[order[added]])] = order[added]
            added += 1
        if not engine.has_work():  # idle until the next arrival (bounded by the loop's timeout check)
            time.sleep(max(0.0, min(arrivals_s[order[added]], timeout_s) - (time.perf_counter() - start)))
            continue
        finished = engine.step()
        now = time.perf_counter() - start
        for token in engine.last_step_tokens:
            i = index_of[token.request_id]
            token_times[i].append(now - arrivals_s[i])
        for _ in finished:
            on_finished()
    return token_times
