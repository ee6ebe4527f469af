"""The co-located round trip (`exchange_colocated`): where it comes from, and that only deployments whose attention
and FFN ranks share a GPU pay it (pure: no processes)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from afd.model.weights import load_model_config
from afd.planning import costs
from afd.planning.deployment import Deployment, StepCosts, StepLoad
from afd.planning.fitting import Measured, fit_parts
from afd.planning.profile import Part, load_profile
from afd.planning.published import with_link_exchange

LITE = costs.shapes_of(load_model_config("deepseek-v2-lite"), "bfloat16")
DECODE = StepLoad(batch=32, ctx=32 * 600, prefill=0, pairs=0.0, seqs=32, emitted=32)


def _measured(device: str, connectors: tuple[str, ...]) -> Measured:
    rows = [[b * 1e6, b * 1e9, 1e-4 + b * 1e-6, b] for b in (1.0, 8.0, 64.0)]
    decode = [{"batch": b, "context": c, "seconds": 5e-3 + b * 1e-5 + c * 1e-6} for b in (1, 8, 64) for c in (32, 256)]
    prefill = [{"batch": 1, "context": c, "tokens": c, "seconds": 1e-2 + c * 5e-5} for c in (32, 128, 512)]
    exchange = {name: [[4096.0 * t, 6e-4 + t * 1e-8] for t in (1, 8, 64)] for name in connectors}
    return Measured(device, rows, [r[:3] for r in rows], decode, prefill, [], exchange)


def test_one_gpus_async_round_trip_is_the_colocated_one() -> None:
    """On one GPU (async measured, p2p not) the async round trip is two processes taking turns: it is the
    co-located part too; measured on a CPU or with a GPU per rank (p2p measured), there is none."""
    parts, _ = fit_parts(_measured("cuda", ("async",)), LITE)
    assert parts["exchange_colocated"] == parts["exchange_async"]
    assert "exchange_colocated" not in fit_parts(_measured("cpu", ("async",)), LITE)[0]
    assert "exchange_colocated" not in fit_parts(_measured("cuda", ("p2p", "async")), LITE)[0]


def test_the_shipped_profile_keeps_the_one_gpu_round_trip_beside_the_link_one() -> None:
    """`published.with_link_exchange` swaps in the x2 table's round trips and keeps the measured one-GPU round trip
    in `exchange_colocated`; the shipped `h200` carries it (0.6 ms a layer against NVLink's ~22 µs)."""
    measured = load_profile("h200")
    one_gpu_trip = {"exchange_async": Part(fixed_s=6e-4), "exchange_colocated": Part(fixed_s=6e-4)}
    one_gpu = replace(measured, parts={**measured.parts, **one_gpu_trip})  # as `fit_parts` fits one GPU's rows
    shipped = with_link_exchange(one_gpu)
    assert shipped.parts["exchange_colocated"] == Part(fixed_s=6e-4)
    assert shipped.parts["exchange_async"].fixed_s < 1e-4
    h200 = load_profile("h200")
    assert h200.part("exchange_colocated").fixed_s == pytest.approx(6.2e-4, rel=0.05)


def test_only_colocated_deployments_pay_the_colocated_round_trip() -> None:
    """A co-located async 1A1F step takes `exchange_colocated` per layer where the profile has it, the link's round
    trip where it has not; ranks on GPUs of their own never take it."""
    h200 = load_profile("h200")
    link = replace(h200, parts={k: v for k, v in h200.parts.items() if k != "exchange_colocated"})
    layers = LITE.moe_layers
    together, apart = Deployment("async", colocated=True), Deployment("async")
    with_it = StepCosts(together, LITE, h200).replica_step(DECODE)
    without = StepCosts(together, LITE, link).replica_step(DECODE)
    wire = StepCosts(together, LITE, link)._wire(DECODE.tokens, DECODE.tokens)
    assert with_it - without == pytest.approx(layers * (h200.part("exchange_colocated").fixed_s - wire), rel=1e-3)
    assert StepCosts(apart, LITE, h200).replica_step(DECODE) == StepCosts(apart, LITE, link).replica_step(DECODE)


def test_simulate_refuses_p2p_ranks_sharing_a_gpu(capsys) -> None:
    """NCCL takes one GPU per rank: `--colocated` with p2p on a GPU profile is one sentence, exit 2 (on a CPU
    profile, where p2p's ranks do share the host, it runs)."""
    from pathlib import Path

    from helpers.cli import main_exit

    flags = ["simulate", "--connector", "p2p", "--attention", "1", "--ffn", "1", "--colocated", "--requests", "8"]
    code, err = main_exit(capsys, *flags)
    assert code == 2 and "NCCL takes one GPU per rank" in err and err.count("\n") == 1
    cpu = Path(__file__).resolve().parents[2] / "docs" / "bench" / "2026-12-01_cpu_profile_tiny.json"
    code, err = main_exit(capsys, *flags, "--model", "tiny", "--profile", str(cpu))
    assert code == 0, err
