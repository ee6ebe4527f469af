"""The shipped H200 profiles: `h200-published`, fitted from the figures measured in docs/performance.md, and
`h200` (the default), measured by `afd profile` on one H200 with the exchange of the x2 table.

`python -m afd.planning.published` rewrites `profiles/h200-published.json`; `python -m afd.planning.published
--shipped MEASURED.json` rewrites `profiles/h200.json` from a profile `bash scripts/gpu_bench.sh profile` measured;
`python -m afd.planning.published --model-layers MEASURED.json MODEL` writes `profiles/h200-MODEL.json` from a
profile measured on MODEL's first layers (`scripts/model_slice.py`), the parts it cannot measure taken from `h200`
(`h200-MODEL-FORMAT.json` for a profile in another format than the model ships in, e.g. a bf16 release in FP8).
Every figure below is one row of performance.md, with its date; the model is DeepSeek-V2-Lite in bf16 at context
512 unless said otherwise.
"""

from __future__ import annotations

import math
import sys

from afd.bench.workload import Workload
from afd.model.weights import load_model_config
from afd.planning import costs
from afd.planning.costs import Shapes
from afd.planning.deployment import Deployment
from afd.planning.profile import Link, Part, Profile, fit_part

MS, US = 1e-3, 1e-6
# "The step against its memory floor", h200, 2026-12-01: graphed steady decode step (whole model, one GPU)
DECODE_STEP_MS = {1: 3.62, 8: 6.69, 64: 10.76, 256: 13.73}
PREFILL_8X1024_MS = 94.75
# "Kernels against the code they replace", h200, 2026-11-30: routed experts of 26 layers
ROUTED_26_LAYERS_MS = {1: 0.95, 8: 3.84, 64: 7.06, 256: 7.81}
# "Two attention replicas' rows in one FFN pass", h200, 2026-11-30: one layer, routed + shared, one item
ONE_ITEM_MS = {1: 0.063, 8: 0.176, 32: 0.293, 64: 0.307}
# docs/architecture.md (shared experts on the attention rank), x2: the FFN pass of an 8,192-token prefill layer
PREFILL_FFN_LAYER_MS = 2.7
# "The exchange", x2, 2026-12-01: one layer's round trip, (bytes, p50 µs)
EXCHANGE_ASYNC = [(8240, 21.7), (65920, 22.1), (527360, 22.4), (4218880, 35.3), (33751040, 159.0)]
EXCHANGE_P2P = [(8240, 197.5), (65920, 205.1), (527360, 199.5), (4218880, 186.0), (33751040, 265.4)]
# "The front end's share of TTFT", h200, 2026-12-01: p50 of three runs' middle
FRONT_END_MS = 1.2
# "Throughput at capacity through the HTTP stack", h200, 2026-12-01: none R=1, mixed, 768 at once, mean of 3
CAPACITY_NONE_R1 = 126.0
CAPACITY_WORKLOAD = Workload("mixed", 768, long_len=1024, short_len=64, max_tokens=64)
H200_MEMORY_BYTES = 139 * (1 << 30)  # what the device reports usable
CONTEXT = 512
SOURCE = (
    "fitted from docs/performance.md's figures (h200 2026-12-01 step table and capacity run, h200 2026-11-30 "
    "kernel and cross-replica tables, x2 2026-12-01 exchange table, the prefill FFN layer in architecture.md), "
    "DeepSeek-V2-Lite bf16; not measured by afd profile (python -m afd.planning.published)"
)


def _shapes() -> Shapes:
    return costs.shapes_of(load_model_config("deepseek-v2-lite"), "bfloat16")


def fitted_parts(s: Shapes) -> dict[str, Part]:
    """Every part but `host`, fitted to the figures above."""
    layers = s.moe_layers
    routed_rows = []
    for t, ms in ROUTED_26_LAYERS_MS.items():
        touched = costs.experts_touched(s.num_experts, s.num_experts, s.topk, t)
        routed_rows.append(
            (touched * s.expert_params * s.weight_bytes, 2.0 * s.expert_params * t * s.topk, ms * MS / 26)
        )
    shared_prefill = s.shared_params * s.weight_bytes  # bytes; its flops join the routed point below
    big = 8192
    routed_rows.append(
        (s.num_experts * s.expert_params * s.weight_bytes, 2.0 * (s.expert_params * s.topk + s.shared_params) * big,
         PREFILL_FFN_LAYER_MS * MS)
    )  # fmt: skip
    routed = fit_part(routed_rows)
    shared_rows = []
    for t, ms in ONE_ITEM_MS.items():
        r = costs.routed_pass_s(Profile({}, {"routed_experts": routed}), s, t, s.num_experts)
        shared_rows.append((shared_prefill, 2.0 * s.shared_params * t, max(ms * MS - r, 1 * US)))
    shared = fit_part(shared_rows)
    parts = {"routed_experts": routed, "shared_experts": shared}
    attn_rows = []
    for b, ms in DECODE_STEP_MS.items():
        ffn = ROUTED_26_LAYERS_MS[b] * MS + layers * shared.time(shared_prefill, 2.0 * s.shared_params * b)
        ctx = b * (CONTEXT + 1)
        attn_rows.append((costs.decode_bytes(s, ctx), costs.decode_flops(s, b, ctx), ms * MS - ffn))
    parts["attention_decode"] = attention = fit_part(attn_rows)
    tokens, pairs = big, 8 * costs.chunk_pairs(0, 1024)
    ffn = layers * PREFILL_FFN_LAYER_MS * MS
    left = PREFILL_8X1024_MS * MS - ffn - attention.time(costs.decode_bytes(s, 0), 0.0)
    parts["prefill"] = Part(peak_flops=costs.prefill_flops(s, tokens, pairs) / left)
    parts.update(exchange_parts())
    parts["launch"] = Part()  # graphed and prefill-graph steps: the host runs ms ahead of its stream (timeline table)
    return parts


def calibrated_host(profile: Profile, s: Shapes) -> Part:
    """The serving loop's cost per scheduled sequence and step that makes `none` R=1 serve the measured capacity on
    the mixed workload (the kernels alone would serve about twice as much): bisection on the simulator."""
    from afd.planning.simulator import simulate_rate

    d = Deployment("none")
    lens = [len(x) for x in CAPACITY_WORKLOAD.prompts(2)]

    def capacity(per_item: float) -> float:
        parts = {**profile.parts, "host": Part(per_item_s=per_item)}
        p = Profile(profile.machine, parts, gpu_memory_bytes=profile.gpu_memory_bytes)
        return simulate_rate(d, s, p, CAPACITY_WORKLOAD, lens, math.inf)["summary"]["request_throughput"]

    lo, hi = 0.0, 200 * US
    if capacity(lo) <= CAPACITY_NONE_R1:
        return Part()
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if capacity(mid) > CAPACITY_NONE_R1 else (lo, mid)
    return Part(per_item_s=(lo + hi) / 2)


def h200_profile() -> Profile:
    s = _shapes()
    machine = {
        "device": "NVIDIA H200 (1 GPU; exchange on 2x H200 NVLink)",
        "torch": "2.11.0+cu130",
        "model": "deepseek-v2-lite",
    }
    p = Profile(machine, fitted_parts(s), SOURCE, "bfloat16", H200_MEMORY_BYTES, FRONT_END_MS * MS, Link())
    host = calibrated_host(p, s)
    return Profile(p.machine, {**p.parts, "host": host}, SOURCE, "bfloat16", H200_MEMORY_BYTES, FRONT_END_MS * MS)


def exchange_parts() -> dict[str, Part]:
    """The exchange round trips of the x2 table (two H200s over NVLink)."""
    return {
        "exchange_async": fit_part([(b, 0.0, us * US) for b, us in EXCHANGE_ASYNC]),
        "exchange_p2p": fit_part([(b, 0.0, us * US) for b, us in EXCHANGE_P2P]),
    }


def with_link_exchange(measured: Profile) -> Profile:
    """`measured` (one H200's `afd profile`) with the exchange between two GPUs: on one GPU its async round trip is
    two processes taking turns on the device (0.6 ms, where NVLink's is 22 µs) and its p2p one a stand-in; the
    one-GPU round trip stays in `exchange_colocated` (`fitting.fit_parts`), for deployments whose ranks share a GPU."""
    from dataclasses import replace

    assumed = {
        name: "the x2 table of docs/performance.md (2026-12-01): one GPU has no link between two"
        for name in ("exchange_async", "exchange_p2p")
    }
    machine = {**measured.machine, "assumed": {**measured.machine.get("assumed", {}), **assumed}}
    source = measured.source + "; exchange from the x2 table (python -m afd.planning.published --shipped)"
    return replace(measured, machine=machine, parts={**measured.parts, **exchange_parts()}, source=source)


COMPUTE_PARTS = ("routed_experts", "routed_experts_grouped", "shared_experts", "attention_decode", "prefill")


def on_model_layers(measured: Profile, base: Profile, model: str) -> Profile:
    """`measured` (`afd profile --no-exchange --no-calibration` over `model`'s first layers on one GPU:
    `scripts/model_slice.py`) for its compute parts, `base` (the shipped `h200`) for everything a slice of a model
    too big for the GPU cannot measure: the exchange and launch parts, the serving calibration, the front end and
    the link, each named in `machine.assumed`."""
    from dataclasses import replace

    parts = {**base.parts, **{name: measured.parts[name] for name in COMPUTE_PARTS if name in measured.parts}}
    taken = [name for name in base.parts if name not in COMPUTE_PARTS] + ["calibration", "front_end_s", "link"]
    assumed = {name: f"the shipped h200 profile's (measured on {base.machine.get('model')})" for name in taken}
    machine = {**measured.machine, "model": model, "assumed": {**measured.machine.get("assumed", {}), **assumed}}
    source = f"{measured.source}; the rest from the shipped h200 (python -m afd.planning.published --model-layers)"
    return replace(
        measured, machine=machine, parts=parts, source=source, calibration=base.calibration,
        front_end_s=base.front_end_s, link=base.link,
    )  # fmt: skip


if __name__ == "__main__":
    from afd.planning.profile import DEFAULT_PROFILE, PROFILES_DIR, load_profile, model_profile_name

    if sys.argv[1:2] == ["--shipped"]:
        with_link_exchange(load_profile(sys.argv[2])).save(PROFILES_DIR / "h200.json")
    elif sys.argv[1:2] == ["--model-layers"]:  # --model-layers MEASURED.json MODEL
        model = sys.argv[3]
        shipped = on_model_layers(load_profile(sys.argv[2]), load_profile(DEFAULT_PROFILE), model)
        shipped.save(PROFILES_DIR / f"{model_profile_name(model, shipped.dtype)}.json")
    else:
        path = sys.argv[1] if len(sys.argv) > 1 else PROFILES_DIR / "h200-published.json"
        h200_profile().save(path)
