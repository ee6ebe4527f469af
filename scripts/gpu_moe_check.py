"""Routed experts on the GPU: the fixed-shape, host-sync-free path (afd.model.moe.routed_experts) checked and timed.

    PYTHONPATH=src python3 scripts/gpu_moe_check.py [--iters 20] [--device cuda]

(a) accuracy: fixed-shape grouped path vs the F.linear loop on random bf16 inputs of DeepSeek-V2-Lite shapes
    (relative Frobenius error; both also against an fp32 loop); tolerance 1e-2.
(b) host syncs (`torch.cuda.set_sync_debug_mode("warn")`, counted by file) in one DeepSeek-V2-Lite-shaped MoE
    layer forward (router + routed + shared experts, gate on FFN) for each router; also for the loop path and
    for the code before this change, to show the counter sees them.
(c) time of a 26-layer routed-experts forward (distinct weights per layer, routing given) at batch
    1/8/64/256: before (the code of commit d3ba3cc, kept below) vs after, eager, in the same run; plus the
    after path captured in one CUDA graph (shapes depend only on the batch), and the floor for the weights
    the batch touches at the 4.27 TB/s copy rate of DESIGN.md.
`--device cpu` is a dry run of (a) and (c) at small shapes (no sync counting, no graph).
"""
# ruff: noqa: T201  (a script that prints its results)

from __future__ import annotations

import argparse
import collections
import dataclasses
import sys
import time
import warnings

import torch

from afd.model.ffn_side import FFNModel
from afd.model.moe import group_by_expert, grouped_expert_mlp, routed_experts, select_experts
from afd.model.weights import load_model_config

COPY_RATE = 4.27e12  # bytes/s, H200 device-to-device copy (DESIGN.md)
TOLERANCE = 1e-2


def before_routed_experts(x, ids, weights, w13, w2):
    """The routed experts of commit d3ba3cc (FFNModel.experts_topk on CUDA bf16): nonzero, bincount and
    .tolist() in group_by_expert, a pageable torch.tensor(list, device=cuda) for the offsets."""
    groups = group_by_expert(ids, 0, w13.shape[0])
    xg = x[groups.token_idx]
    if xg.shape[0]:
        offs = torch.tensor(groups.group_sizes, device=x.device, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        gate, up = torch._grouped_mm(xg, w13.transpose(1, 2), offs=offs).chunk(2, dim=-1)
        y = torch._grouped_mm(torch.nn.functional.silu(gate) * up, w2.transpose(1, 2), offs=offs)
    else:
        y = xg
    w = weights.reshape(-1)[groups.pair_idx]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    return out.index_add_(0, groups.token_idx, y.float() * w[:, None])


def loop_routed_experts(x, ids, weights, w13, w2, start):
    """The exact loop: one F.linear per local expert."""
    groups = group_by_expert(ids, start, start + w13.shape[0])
    y = grouped_expert_mlp(x[groups.token_idx], groups.group_sizes, w13, w2, use_grouped_mm=False)
    w = weights.reshape(-1)[groups.pair_idx]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    return out.index_add_(0, groups.token_idx, y.float() * w[:, None])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def experts(E, H, inter, device, gen):
    w13 = torch.empty(E, 2 * inter, H, device=device, dtype=torch.bfloat16).normal_(0, H**-0.5, generator=gen)
    w2 = torch.empty(E, H, inter, device=device, dtype=torch.bfloat16).normal_(0, inter**-0.5, generator=gen)
    return w13, w2


def route(T, E, K, device, gen):
    logits = torch.randn(T, E, device=device, generator=gen)
    return select_experts(logits, top_k=K, scoring_func="softmax", topk_method="greedy")


def check_accuracy(dims, batches, device) -> bool:
    E, H, inter, K = dims
    gen = torch.Generator(device=device).manual_seed(0)
    w13, w2 = experts(E, H, inter, device, gen)
    ok = True
    print(f"(a) fixed-shape vs loop, bf16, E={E} H={H} I={inter} K={K}; tolerance {TOLERANCE:g} (relative Frobenius)")
    for T in batches:
        x = torch.randn(T, H, device=device, dtype=torch.bfloat16, generator=gen)
        r = route(T, E, K, device, gen)
        for start, stop in ((0, E), (E // 4, 3 * E // 4)):
            args = (x, r.topk_ids, r.topk_weights, w13[start:stop], w2[start:stop], start)
            fixed = routed_experts(*args, fixed_shape=True)
            loop = loop_routed_experts(*args)
            ref = loop_routed_experts(
                x.float(), r.topk_ids, r.topk_weights, w13[start:stop].float(), w2[start:stop].float(), start
            )
            err = rel(fixed, loop)
            ok &= err <= TOLERANCE and bool(torch.isfinite(fixed).all())
            print(
                f"    T={T:4d} experts [{start:2d},{stop:2d}): fixed vs loop {err:.2e}   "
                f"fixed vs fp32 {rel(fixed, ref):.2e}   loop vs fp32 {rel(loop, ref):.2e}"
            )
    return ok


def count_syncs(fn) -> list[str]:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return [f"{w.filename.rsplit('/', 1)[-1]}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]


def check_syncs(T: int = 8) -> bool:
    base = load_model_config("deepseek-v2-lite")
    ok = True
    print(f"(b) host syncs in one DeepSeek-V2-Lite-shaped MoE layer forward, bf16, {T} tokens, gate on FFN")
    for method in ("greedy", "group_limited_greedy", "noaux_tc"):
        groups = {} if method == "greedy" else {"n_group": 8, "topk_group": 3}
        scoring = "sigmoid" if method == "noaux_tc" else "softmax"
        config = dataclasses.replace(base, num_hidden_layers=2, topk_method=method, scoring_func=scoring, **groups)
        with torch.device("cuda"):
            model = FFNModel(config, gate_on_attention=False, dtype=torch.bfloat16)
        for p in model.parameters():
            p.data.normal_(0.0, p.shape[-1] ** -0.5)
        model = model.to(torch.bfloat16)
        x = torch.randn(T, config.hidden_size, device="cuda", dtype=torch.bfloat16)
        for label, fixed in (("fixed-shape (default)", None), ("loop path", False)):
            model.fixed_shape_moe = fixed
            model(1, x, None)  # warm-up
            syncs = count_syncs(lambda m=model, x=x: m(1, x, None))
            if fixed is None:
                ok &= not syncs
            where = dict(collections.Counter(syncs))
            print(f"    {method:21s} {label:22s}: {len(syncs)} syncs {where}")
        e = model.layers["1"].experts
        routing = model.route(1, x)
        syncs = count_syncs(
            lambda x=x, r=routing, e=e: before_routed_experts(x, r.topk_ids, r.topk_weights, e.w13, e.w2)
        )
        print(
            f"    {method:21s} {'before (d3ba3cc)':22s}: {len(syncs)} syncs {dict(collections.Counter(syncs))}"
            " (routed experts only)"
        )
        del model
    return ok


def timed(fn, iters: int, device: str) -> float:
    """Mean wall-clock seconds of fn() over iters calls, the device drained before and after."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(3):
        fn()
    sync()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - t) / iters


def time_layers(dims, num_layers, batches, iters, device) -> bool:
    E, H, inter, K = dims
    gen = torch.Generator(device=device).manual_seed(1)
    weights = [experts(E, H, inter, device, gen) for _ in range(num_layers)]
    expert_bytes = 3 * H * inter * 2
    ok = True
    print(
        f"(c) {num_layers}-layer routed-experts forward (E={E} H={H} I={inter} K={K}, bf16), ms per forward, "
        f"mean of {iters}"
    )
    print(f"    {'batch':>5} {'before':>9} {'after':>9} {'speedup':>8} {'graph':>9} {'floor':>8}  graph==eager")
    for T in batches:
        x = torch.randn(T, H, device=device, dtype=torch.bfloat16, generator=gen)
        routes = [route(T, E, K, device, gen) for _ in range(num_layers)]
        floor = sum(int(r.topk_ids.unique().numel()) for r in routes) * expert_bytes / COPY_RATE

        def before(x=x, routes=routes):
            return [
                before_routed_experts(x, r.topk_ids, r.topk_weights, *w) for r, w in zip(routes, weights, strict=True)
            ]

        def after(x=x, routes=routes):
            return [
                routed_experts(x, r.topk_ids, r.topk_weights, *w, 0, fixed_shape=True)
                for r, w in zip(routes, weights, strict=True)
            ]

        ok &= max(rel(a, b) for a, b in zip(after(), before(), strict=True)) <= TOLERANCE
        t_before, t_after = timed(before, iters, device), timed(after, iters, device)
        graph_ms, same = float("nan"), "-"
        if device == "cuda":
            try:
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    eager = after()
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    static = after()
                graph.replay()
                torch.cuda.synchronize()
                same = str(all(torch.equal(a, b) for a, b in zip(static, eager, strict=True)))
                graph_ms = timed(graph.replay, iters, device) * 1e3
                del graph
            except Exception as exc:  # report, do not hide the other numbers
                same = f"capture failed: {type(exc).__name__}: {exc}"
        print(
            f"    {T:5d} {t_before * 1e3:9.2f} {t_after * 1e3:9.2f} {t_before / t_after:7.2f}x {graph_ms:9.2f} "
            f"{floor * 1e3:8.2f}  {same}"
        )
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--layers", type=int, default=26)
    args = parser.parse_args()
    if args.device == "cuda":
        dims, batches, layers = (64, 2048, 1408, 6), (1, 8, 64, 256), args.layers
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    else:  # dry run of the script's logic at small shapes
        dims, batches, layers = (8, 64, 32, 2), (1, 8), 2
    ok = check_accuracy(dims, batches, args.device)
    if args.device == "cuda":
        ok &= check_syncs()
    ok &= time_layers(dims, layers, batches, args.iters, args.device)
    print("ALL CHECKS PASSED" if ok else "SOME CHECK FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
