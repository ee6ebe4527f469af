"""Where the attention rank's host time goes in steps with prompt tokens (one GPU, V2-Lite bf16, random weights).

For each step layout: the host time of one `AttentionModel` forward with a zero exchange (call to return, device
drained before) beside its device time, eager and through the prefill graphs; a cProfile table of one graphed
forward of the layout named by --cprofile; and the host cost of each op an attention core launches, timed two
ways: back to back (1,000 launches, no sync: a full launch queue makes a launch wait for the device) and alone on
an idle device (synced before each call: what the call itself costs the host).

    PYTHONPATH=src python3 scripts/host_profile.py OUT_DIR [--layouts mixed,8x1024] [--cprofile mixed]
"""
# ruff: noqa: T201  (a script that prints its results)

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time

import torch
import torch.nn.functional as F

from afd.engine.graphs.prefill import PrefillGraphRunner
from afd.model.attention_side import run_segments, zero_exchange
from afd.model.batch import Batch
from afd.model.kv_cache import PagedLatentCache
from afd.model.weights import load_attention_model

LAYOUTS = {  # name -> [(query_len, context_len), ...] in the engine's order (decodes first)
    "8x1024": [(1024, 0)] * 8,
    "mixed": [(1, 512)] * 256 + [(1792, 0)],  # afd bench step --mixed 256x1792
    "mixed-small": [(1, 512)] * 256 + [(64, 0)],
    "chunk-after-context": [(1, 512)] * 64 + [(1984, 512)],
}


def forward_times(model, cache, layout, iters=5, runner=None):
    """(host ms, device ms) medians of `iters` forwards of one step layout; through the prefill graphs of `runner`
    when given."""
    slots = [cache.allocate(q + c + 1) for q, c in layout]
    try:
        ids = torch.randint(0, 1000, (sum(q for q, _ in layout),))
        pos = torch.cat([torch.arange(c, c + q) for q, c in layout])
        hosts, devices = [], []
        for it in range(iters + 2):
            batch = Batch(slots=slots, query_lens=[q for q, _ in layout], context_lens=[c for _, c in layout])
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            d_ids, d_pos = cache.prepare(batch, ids, pos)
            if runner is None:
                model(d_ids, d_pos, batch, cache, zero_exchange)
            else:
                run_segments(runner.segments(batch, d_ids, d_pos), zero_exchange)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            if it >= 2:
                hosts.append((t1 - t0) * 1e3)
                devices.append((t2 - t0) * 1e3)
        return statistics.median(hosts), statistics.median(devices)
    finally:
        for s in slots:
            cache.free(s)


def profiled_forward(model, cache, layout, runner) -> str:
    """cProfile tables (own time, cumulative) of one graphed forward of `layout`, after two unprofiled ones."""
    slots = [cache.allocate(q + c + 1) for q, c in layout]
    ids = torch.randint(0, 1000, (sum(q for q, _ in layout),))
    pos = torch.cat([torch.arange(c, c + q) for q, c in layout])

    def one():
        batch = Batch(slots=slots, query_lens=[q for q, _ in layout], context_lens=[c for _, c in layout])
        d_ids, d_pos = cache.prepare(batch, ids, pos)
        run_segments(runner.segments(batch, d_ids, d_pos), zero_exchange)

    for _ in range(2):
        one()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    one()
    prof.disable()
    torch.cuda.synchronize()
    for s in slots:
        cache.free(s)
    text = []
    for order in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(order).print_stats(35)
        text.append(s.getvalue())
    return "\n".join(text)


def launch_us(fn, n=1000) -> tuple[float, float]:
    """(µs per call back to back, µs per call alone on an idle device: median of 50)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    alone = []
    for _ in range(50):
        torch.cuda.synchronize()
        s = time.perf_counter()
        fn()
        alone.append(time.perf_counter() - s)
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6, statistics.median(alone) * 1e6


def core_probes(model) -> dict:
    """The ops of a mixed step's attention core at `mixed`'s shapes (256 decodes, a 1,792-token prompt)."""
    from afd.kernels.prefill_attention import prefill_attention
    from afd.model.fp8 import linear_weight

    c = model.config
    attn = model.layers[1].self_attn
    nh, B, T = c.num_attention_heads, 256, 1792
    q = torch.randn(B + T, nh, c.qk_head_dim, device="cuda", dtype=torch.bfloat16)
    q_nope = q[:B, :, : c.qk_nope_head_dim]
    w = linear_weight(attn.kv_b_proj, q.dtype).view(nh, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
    w_uk, w_uv = w.split([c.qk_nope_head_dim, c.v_head_dim], dim=1)
    o_latent = torch.randn(B, nh, c.kv_lora_rank, device="cuda", dtype=torch.bfloat16)
    kv_c = torch.randn(T, c.kv_lora_rank, device="cuda", dtype=torch.bfloat16)
    kpe = torch.randn(T, c.qk_rope_head_dim, device="cuda", dtype=torch.bfloat16)
    kv = attn.kv_b_proj(kv_c).view(T, nh, c.qk_nope_head_dim + c.v_head_dim)
    k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
    cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    out = torch.empty(B + T, nh, c.v_head_dim, device="cuda", dtype=torch.bfloat16)
    rows = torch.arange(B, device="cuda")
    o_out = torch.randn(B, nh, c.v_head_dim, device="cuda", dtype=torch.bfloat16)
    small = torch.zeros(8, device="cuda")
    return {
        "torch add_ (tiny)": lambda: small.add_(1),
        "einsum q_latent bhd,hdc->bhc": lambda: torch.einsum("bhd,hdc->bhc", q_nope, w_uk),
        "bmm q_latent": lambda: torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1),
        "einsum output bhc,hvc->bhv": lambda: torch.einsum("bhc,hvc->bhv", o_latent, w_uv),
        "kv_b_proj 1792 rows": lambda: attn.kv_b_proj(kv_c),
        "F.linear 1792 rows": lambda: F.linear(kv_c, attn.kv_b_proj.weight),
        "prefill_attention (triton)": lambda: prefill_attention(q[B:], k_nope, kpe, v, cu, cu, T, 0.1, out=out[B:]),
        "q[rows] gather": lambda: q[rows],
        "out[rows] = x": lambda: out.__setitem__(rows, o_out),
        "out[:B].copy_": lambda: out[:B].copy_(o_out),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"of {', '.join(LAYOUTS)}")
    parser.add_argument("--cprofile", default="mixed", help="the layout profiled ('' for none)")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    model = load_attention_model("deepseek-v2-lite", dtype="bfloat16", device="cuda", seed=0)
    layers = model.config.num_hidden_layers
    cache = PagedLatentCache(
        model.config, num_blocks=12000, block_size=16, max_num_seqs=320, dtype=torch.bfloat16, device="cuda"
    )
    layouts = {name: LAYOUTS[name] for name in args.layouts.split(",")}
    result: dict = {"layers": layers, "forward": {}, "launch_us": {}}
    lines = []
    with torch.inference_mode():
        for name, layout in layouts.items():
            host, device = forward_times(model, cache, layout)
            result["forward"][name] = {"host_ms": host, "device_ms": device}
            lines.append(f"{name}: eager host {host:.2f} ms ({host / layers:.3f} per layer), device {device:.2f} ms")
        runner = PrefillGraphRunner(model, cache, 8192, max_seqs=1024)
        t0 = time.perf_counter()
        runner.capture_all()
        lines.append(f"prefill graphs: buckets {runner.captured} in {time.perf_counter() - t0:.1f} s")
        for name, layout in layouts.items():
            host, device = forward_times(model, cache, layout, runner=runner)
            result["forward"][name].update(graph_host_ms=host, graph_device_ms=device)
            lines.append(f"{name} (prefill graphs): host {host:.2f} ms, device {device:.2f} ms")
        for name, fn in core_probes(model).items():
            queued, alone = launch_us(fn)
            result["launch_us"][name] = {"back_to_back": queued, "alone": alone}
            lines.append(f"launch {name}: {queued:.1f} us back to back, {alone:.1f} us alone")
        table = profiled_forward(model, cache, LAYOUTS[args.cprofile], runner) if args.cprofile else ""
    text = "\n".join(lines)
    print(text)
    with open(f"{args.out_dir}/host_profile.txt", "w") as f:
        f.write(text + f"\n\n== cProfile, one graphed forward of {args.cprofile}\n" + table)
    with open(f"{args.out_dir}/host_profile.json", "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
