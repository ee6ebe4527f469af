"""What a profile picks for a server: the token budget and micro-batch count the planner's simulator serves best
with, for one model and topology; and the check that the profile was measured on this device with this model.

Each candidate (`BUDGETS` x the connector's micro-batch counts) is simulated (`afd.planning.simulator`) on
`afd plan`'s default workload (`RECOMMEND_REQUESTS` requests, all at once): its capacity in requests/s. Among the
candidates whose TPOT p50 meets `afd plan`'s default SLO (all of them when none does), the smallest budget, then the
fewest micro-batches, within `CLOSE` of the best capacity wins: a larger budget costs activation memory and longer
mixed steps for gains the simulator barely sees. One simulation per candidate keeps this to a fraction of a second
(`afd plan`'s SLO bisection would take seconds at a server's start).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from pathlib import Path

from afd.bench.workload import Workload
from afd.model.config import ModelConfig
from afd.planning.costs import Shapes
from afd.planning.deployment import Deployment, DeploymentError
from afd.planning.plan import Slo
from afd.planning.profile import Profile, ProfileError
from afd.planning.simulator import simulate_rate
from afd.runtime.limits import Suggested

log = logging.getLogger(__name__)

BUDGETS = (2048, 4096, 8192, 16384)
UBATCHES = {"none": (1,), "p2p": (1,), "async": (1, 2, 3)}  # the planner models micro-batches on async only
RECOMMEND_REQUESTS = 200
CLOSE = 0.01
# afd plan's default workload: mixed lengths, median 64, capped at 1,024, 64 tokens out
SHORT_LEN, LONG_LEN, MAX_TOKENS = 64, 1024, 64


@dataclass(frozen=True)
class Target:
    """Where a profile is to be applied: the device ("cpu" or "cuda"), the GPU's name (None when unknown), the model
    as named on the command line and its config."""

    device: str
    gpu_name: str | None
    model: str
    config: ModelConfig


def _arch(config: ModelConfig) -> tuple:
    c = config
    return (c.hidden_size, c.num_hidden_layers, c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size)


def _same_model(profiled: str, target: Target) -> bool:
    """The same name (a directory by its last part), or a preset / readable checkpoint of the same shapes."""
    if Path(profiled).name.lower() == Path(target.model).name.lower():
        return True
    from afd.model.weights import load_model_config

    try:
        return _arch(load_model_config(profiled)) == _arch(target.config)
    except (OSError, ValueError):
        return False


def check_profile(profile: Profile, name: str, target: Target) -> None:
    """ProfileError in one sentence unless `profile` was measured on `target`'s kind of device with its model."""
    device = str(profile.machine.get("device", ""))
    on_cpu = device.lower().startswith("cpu")
    if target.device == "cpu" and not on_cpu:
        raise ProfileError(f"profile {name} was measured on {device or 'an unnamed device'}, not on this CPU")
    if target.device == "cuda":
        if on_cpu or not device:
            raise ProfileError(f"profile {name} was measured on {device or 'an unnamed device'}, not on a GPU")
        if target.gpu_name is None:
            raise ProfileError(f"profile {name} is for {device}, and this machine's GPU could not be named")
        if target.gpu_name.lower() not in device.lower():
            raise ProfileError(f"profile {name} was measured on {device}, not on this {target.gpu_name}")
    model = profile.machine.get("model")
    if not model:
        raise ProfileError(f"profile {name} does not say which model it was measured with")
    if not _same_model(str(model), target):
        raise ProfileError(f"profile {name} was measured with model {model}, not {target.model}")


def planning_workload(max_model_len: int) -> Workload:
    """`afd plan`'s default workload, shortened where the model's positions are fewer."""
    max_tokens = max(1, min(MAX_TOKENS, max_model_len // 2))
    long_len = max(1, min(LONG_LEN, max_model_len - max_tokens))
    w = Workload("mixed", RECOMMEND_REQUESTS, long_len, min(SHORT_LEN, long_len))
    return replace(w, max_tokens=max_tokens)


def recommend(
    profile: Profile,
    shapes: Shapes,
    base: Deployment,
    *,
    source: str,
    max_model_len: int,
    budget: int | None = None,
    ubatches: int | None = None,
) -> Suggested:
    """The budget and micro-batches (those not fixed by `budget` / `ubatches`) that score best for `base`'s
    connector and shape; ProfileError when no candidate fits the profile's GPU."""
    budgets = (budget,) if budget is not None else BUDGETS
    counts = (ubatches,) if ubatches is not None else UBATCHES[base.connector]
    workload, tpot_slo = planning_workload(max_model_len), Slo().tpot_p50_s
    lens = [len(x) for x in workload.prompts(2)]
    scored: list[tuple[float, bool, int, int]] = []
    problem = ""
    for b in budgets:
        for m in counts:
            d = replace(base, replicas=1, max_num_batched_tokens=b, ubatches=m if base.connector == "async" else 1)
            try:
                summary = simulate_rate(d, shapes, profile, workload, lens, math.inf)["summary"]
            except DeploymentError as exc:
                problem = str(exc)
                continue
            tpot = summary["tpot_p50_s"]
            scored.append((summary["request_throughput"], tpot is None or tpot <= tpot_slo, b, m))
            log.debug("%s, budget %d: %.2f req/s, TPOT p50 %s", d.name, b, scored[-1][0], tpot)
    if not scored:
        raise ProfileError(f"profile {source}: {base.name} does not fit its GPU ({problem})")
    kept = [x for x in scored if x[1]] or scored
    best = max(x[0] for x in kept)
    _, _, b, m = next(x for x in kept if x[0] >= (1 - CLOSE) * best)
    return Suggested(
        max_num_batched_tokens=None if budget is not None else b,
        ubatches=None if ubatches is not None or base.connector != "async" else m,
        source=f"profile {source}",
    )
