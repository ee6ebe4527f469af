"""`afd profile`: each part of a step measured on this machine with afd's own model and engine, then fitted.

Decode and prefill steps come from `afd bench step`'s engine (`run_bench_step`), the routed and shared experts from
the FFN model's own passes (`FFNModel.experts_topk`, `shared`) over uniform top-k rows, with every expert and with
half of them on the rank, the exchange from `afd bench exchange`'s round trips (both connectors, 1A1F). The
attention side is the whole step less the experts the same shapes cost.
"""

from __future__ import annotations

import datetime
import logging
import platform
import statistics
import time
from collections.abc import Callable

import torch

from afd.bench.exchange import run_bench_exchange
from afd.bench.offline import device_name
from afd.bench.step import run_bench_step
from afd.model.weights import load_ffn_model, load_model_config
from afd.planning import calibrate, costs
from afd.planning.fitting import Measured, fit_parts
from afd.planning.profile import Calibration, Link, Profile
from afd.profiling.graph_timing import graph_ms
from afd.routing import Routing

logger = logging.getLogger(__name__)

CPU_SHAPES = {
    "batches": [1, 4, 16, 64, 128, 256],
    "contexts": [32, 256],
    "prefills": [(1, 32), (1, 128), (4, 64), (8, 128), (16, 128)],
    "tokens": [1, 8, 64, 256],
}
GPU_SHAPES = {
    "batches": [1, 8, 64, 256],
    # up to 4K: decode steps of the long contexts plans are made for cost more per cached token than 512 and 2,048
    # alone fit (DeepSeek-V3's first layers at 4,096: -13 to -17% predicted from those two)
    "contexts": [512, 2048, 4096],
    "prefills": [(1, 128), (1, 512), (1, 1024), (1, 2048), (8, 1024)],
    # (decodes, prompt chunk), at each context. The small batches because a chunk beside 64 or 256 decodes cost ~6
    # ms more than a lone prompt's part and the decodes add up to (H200), while served steps beside a few decodes
    # (16 req/s) did not pay it: docs/planning.md, "Again, a later session"
    "mixed": [(8, 256), (16, 512), (64, 256), (64, 1024), (256, 512)],
    "tokens": [1, 8, 64, 256, 512, 1024, 2048, 4096],  # both sides of the kernels' bound (costs.kernel_max_pairs)
}


def _time(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _expert_rows(model: str, dtype: str, device: str, tokens: list[int], iters: int, quantization: str | None = None):
    """(routed rows, shared rows): (bytes, flops, seconds) of one layer's pass, all experts and half of them (routed
    rows add the token count: which side of the kernels' bound they fall on). On
    CUDA every MoE layer's pass in one CUDA graph, per layer, as a graphed decode step runs them (timed one call
    at a time, the launches would outweigh a small batch's whole step)."""
    config = load_model_config(model)
    s = costs.shapes_of(config, quantization or dtype)
    dev = torch.device(device)
    layers = config.moe_layers if dev.type == "cuda" else config.moe_layers[:1]

    def per_layer(fn: Callable[[int], object]) -> float:
        if dev.type == "cuda":
            return graph_ms(lambda: [fn(i) for i in layers], reps=1, rounds=iters) * 1e-3 / len(layers)
        return _time(lambda: fn(layers[0]), dev, iters)

    routed, shared = [], []
    for local in sorted({config.n_routed_experts, max(1, config.n_routed_experts // 2)}):
        ffn = load_ffn_model(model, dtype=dtype, device=device, expert_range=(0, local), quantization=quantization)
        if dev.type == "cuda":
            ffn.fixed_shape_moe = True  # the capturable path, as in the step graphs
        for t in tokens:
            x = torch.randn(t, config.hidden_size, dtype=getattr(torch, dtype), device=dev)
            scores = torch.rand(t, config.n_routed_experts, device=dev)
            ids = scores.topk(config.num_experts_per_tok, dim=-1).indices  # [T, K] uniform
            w = torch.full(ids.shape, 1.0 / ids.shape[1], dtype=torch.float32, device=dev)
            routing = Routing(ids, w)
            with torch.inference_mode():
                sec = per_layer(lambda i, ffn=ffn, x=x, routing=routing: ffn.experts_topk(i, x, routing))
                touched = costs.experts_touched(local, s.num_experts, s.topk, t)
                flops = 2.0 * s.expert_params * t * s.topk * local / s.num_experts
                routed.append((touched * s.expert_params * s.weight_bytes, flops, sec, t))
                if local == config.n_routed_experts and s.shared_params:
                    sec = per_layer(lambda i, ffn=ffn, x=x: ffn.shared(i, x))
                    shared.append((s.shared_params * s.weight_bytes, 2.0 * s.shared_params * t, sec))
        del ffn
    return routed, shared


def measure_profile(
    model: str,
    dtype: str,
    device: str,
    *,
    exchange: bool = True,
    calibrate: bool = True,
    calibration_requests: int = 128,
    calibration_rates: tuple[float, ...] | None = None,
    quantization: str | None = None,
    say: Callable[[str], None] = logger.info,
) -> Profile:
    """Measure every part on this machine and fit it; `exchange=False` leaves the exchange parts out;
    `calibrate` then serves a short trace (`afd serve`, none R=1) and fits what serving adds (`Calibration`).
    `quantization` ("fp8"): the weights quantized at load, as `--quantization` serves them, so the profile's rates
    carry FP8's own kernels and quantization launches; its `dtype` is then the weights' format, "fp8"."""
    shapes = GPU_SHAPES if device == "cuda" else CPU_SHAPES
    config = load_model_config(model)
    weights = quantization or dtype
    s = costs.shapes_of(config, weights)
    steps = 10  # the step rows are medians of this many (isolated) steps
    say("experts: one layer's routed and shared passes ...")
    routed_rows, shared_rows = _expert_rows(model, dtype, device, shapes["tokens"], steps, quantization)
    say("decode and prefill steps ...")
    step = run_bench_step(
        model=model, dtype=dtype, device=device, batches=shapes["batches"], contexts=shapes["contexts"],
        prefills=shapes["prefills"], mixed=shapes.get("mixed"), steps=steps, progress=say, quantization=quantization,
    )  # fmt: skip
    # CPU: the median of isolated steps (a mean of consecutive ones carries whatever else ran on the 2 cores)
    mode = "graph_ms" if device == "cuda" else "eager_isolated_ms"
    exchanges = {}
    if exchange:
        # p2p's NCCL ranks need a GPU each; on one GPU only async runs (its two ranks share the device)
        connectors = ("async",) if device == "cuda" and torch.cuda.device_count() < 2 else ("p2p", "async")
        say(f"exchange round trips, {' and '.join(connectors)} ...")
        ex = run_bench_exchange(
            model=model, dtype=dtype, device=device, tokens=shapes["tokens"], connectors=connectors,
            iters=20 if device == "cpu" else 50, progress=say,
        )  # fmt: skip
        for connector in connectors:
            exchanges[connector] = [[r["bytes"], r["p50_us"] * 1e-6] for r in ex["rows"] if r["connector"] == connector]
    measured = Measured(
        device=device,
        routed=[list(r) for r in routed_rows],
        shared=[list(r) for r in shared_rows],
        decode=[
            {"batch": r["batch"], "context": r["context"], "seconds": (r[mode] or r["eager_ms"]) * 1e-3}
            for r in step["decode"]
        ],
        prefill=[
            {"batch": r["batch"], "context": r["context"], "tokens": r["tokens"], "seconds": r["ms"] * 1e-3}
            for r in step["prefill"]
        ],
        mixed=[
            {"decodes": r["decodes"], "context": r["context"], "chunk": r["chunk"], "seconds": r["mixed_ms"] * 1e-3}
            for r in step.get("mixed", [])
        ],
        exchange=exchanges,
    )
    parts, assumed = fit_parts(measured, s, say)
    if "exchange_p2p" in assumed:
        logger.warning("p2p's exchange needs two GPUs: the profile takes async's round trip for it")
    machine = {
        "device": device_name(device),
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "model": model,
        **({"assumed": assumed} if assumed else {}),
    }
    memory = torch.cuda.get_device_properties(0).total_memory if device == "cuda" else 16e9
    source = f"afd profile --model {model} --dtype {dtype} --device {device}"
    source += f" --quantization {quantization}" if quantization else ""
    measured_json = {"parts": measured.to_json()}
    profile = Profile(machine, parts, source, weights, float(memory), 0.0, Link(), measured=measured_json)
    if not calibrate:
        return profile
    from afd.planning.calibrate import default_rates

    rates = calibration_rates or default_rates(device)
    return measure_calibration(profile, model, dtype, device, calibration_requests, rates, say, quantization)


def measure_calibration(
    profile: Profile,
    model: str,
    dtype: str,
    device: str,
    requests: int,
    rates: tuple[float, ...],
    say: Callable[[str], None] = logger.info,
    quantization: str | None = None,
) -> Profile:
    """Serve the calibration trace on this machine and fit what the simulator must add to the parts to hold it."""
    from dataclasses import replace

    from afd.planning.deployment import Deployment
    from afd.runtime.limits import DEFAULT_MAX_NUM_SEQS, LARGE_BUDGET, SMALL_BUDGET

    config = load_model_config(model)
    trace = calibrate.calibration_trace(requests, rates)
    budget = SMALL_BUDGET if device == "cpu" else LARGE_BUDGET
    d = Deployment("none", max_num_seqs=DEFAULT_MAX_NUM_SEQS, max_num_batched_tokens=budget)
    say(f"calibration: serving {requests} requests at {', '.join(map(str, rates))} req/s (afd serve, none R=1) ...")
    runs = calibrate.serve_trace(
        model, dtype, device, trace, d, config.vocab_size, config.max_position_embeddings, quantization=quantization
    )
    cal: Calibration = calibrate.fit_calibration(
        profile, costs.shapes_of(config, profile.dtype), d, trace, runs, config.vocab_size
    )
    say(calibrate.format_calibration(cal))
    kept = {
        "runs": [{"rate": str(run["rate"]), "summary": run["summary"]} for run in runs],  # "inf": JSON has no inf
        "max_num_seqs": d.max_num_seqs,
        "max_num_batched_tokens": d.max_num_batched_tokens,
    }
    measured = {**profile.measured, "calibration": kept}
    return replace(
        profile, calibration=cal, source=profile.source + " (calibrated against afd serve)", measured=measured
    )
