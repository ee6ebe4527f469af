"""Where the attention rank's host time goes in a prefill step (one GPU, V2-Lite bf16, random weights).

For a few step layouts: the host time of one `AttentionModel` forward with a zero exchange (call to return,
device drained before) beside its device time, per layer; a torch.profiler CPU table and a cProfile table of
one forward; and the host cost of one launch of each kernel the layer uses (1,000 launches, no sync).
`python scripts/host_profile.py OUT_DIR` (CUDA only).
"""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import sys
import time

import torch
import torch.nn.functional as F

from afd.engine.graphs.prefill import PrefillGraphRunner
from afd.model.attention_side import run_segments, zero_exchange
from afd.model.batch import Batch
from afd.model.kv_cache import PagedLatentCache
from afd.model.weights import load_attention_model


def forward_times(model, cache, layout, iters=5, runner=None):
    """(host ms, device ms) medians of `iters` forwards of one step layout [(query_len, context_len), ...]; through
    the prefill graphs of `runner` when given."""
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
        return sorted(hosts)[len(hosts) // 2], sorted(devices)[len(devices) // 2], batch, d_ids, d_pos
    finally:
        for s in slots:
            cache.free(s)


def launch_us(fn, n=1000):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def main(out_dir: str) -> None:
    torch.set_grad_enabled(False)
    model = load_attention_model("deepseek-v2-lite", dtype="bfloat16", device="cuda", seed=0)
    config = model.config
    cache = PagedLatentCache(
        config, num_blocks=4096, block_size=16, max_num_seqs=128, dtype=torch.bfloat16, device="cuda"
    )
    layers = config.num_hidden_layers
    layouts = {
        "4x512 fresh": [(512, 0)] * 4,
        "8x1024 fresh": [(1024, 0)] * 8,
        "chunk 1984 after 512 + 64 decodes": [(1984, 512)] + [(1, 512)] * 64,
        "64 decodes": [(1, 512)] * 64,
    }
    result: dict = {"layers": layers, "forward": {}, "launch_us": {}}
    lines = []
    with torch.inference_mode():
        for name, layout in layouts.items():
            host, device, batch, d_ids, d_pos = forward_times(model, cache, layout)
            result["forward"][name] = {"host_ms": host, "device_ms": device, "host_per_layer_ms": host / layers}
            lines.append(f"{name}: host {host:.2f} ms ({host / layers:.3f} per layer), device {device:.2f} ms")
        before = torch.cuda.memory_allocated()
        runner = PrefillGraphRunner(model, cache, 8192)
        t0 = time.perf_counter()
        runner.capture_all()
        result["prefill_graphs"] = {
            "capture_s": time.perf_counter() - t0,
            "buckets": runner.captured,
            "memory_GiB": (torch.cuda.memory_allocated() - before) / 2**30,
        }
        lines.append(f"prefill graphs: {result['prefill_graphs']}")
        for name, layout in layouts.items():
            host, device, *_ = forward_times(model, cache, layout, runner=runner)
            result["forward"][name].update(graph_host_ms=host, graph_device_ms=device)
            lines.append(f"{name} (prefill graphs): host {host:.2f} ms, device {device:.2f} ms")
        # one forward of the 2048-token layout under the profilers
        layout = layouts["4x512 fresh"]
        slots = [cache.allocate(q + c + 1) for q, c in layout]
        ids = torch.randint(0, 1000, (2048,))
        pos = torch.cat([torch.arange(0, 512)] * 4)

        def one():
            batch = Batch(slots=slots, query_lens=[512] * 4, context_lens=[0] * 4)
            d_ids, d_pos = cache.prepare(batch, ids, pos)
            return model(d_ids, d_pos, batch, cache, zero_exchange)

        one()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            one()
        torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
        prof_py = cProfile.Profile()
        prof_py.enable()
        one()
        prof_py.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(prof_py, stream=s).sort_stats("tottime").print_stats(35)
        cp_tot = s.getvalue()
        s = io.StringIO()
        pstats.Stats(prof_py, stream=s).sort_stats("cumulative").print_stats(45)
        cp_cum = s.getvalue()

        # host cost of single launches
        from afd.kernels.norm import rms_norm
        from afd.kernels.prefill_attention import prefill_attention
        from afd.kernels.rope import rope

        x = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
        w = torch.ones(2048, device="cuda", dtype=torch.bfloat16)
        lin = torch.randn(1536, 2048, device="cuda", dtype=torch.bfloat16)
        kpe = torch.randn(2048, 64, device="cuda", dtype=torch.bfloat16)
        cos = torch.randn(2048, 32, device="cuda")
        q = torch.randn(2048, 16, 192, device="cuda", dtype=torch.bfloat16)
        kn = torch.randn(2048, 16, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(2048, 16, 128, device="cuda", dtype=torch.bfloat16)
        cu = torch.tensor([0, 512, 1024, 1536, 2048], dtype=torch.int32, device="cuda")
        layer0 = model.layers[1]
        g = torch.cuda.CUDAGraph()
        y = torch.empty_like(x)
        s_ = torch.cuda.Stream()
        s_.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s_):
            y.copy_(x)
        torch.cuda.current_stream().wait_stream(s_)
        with torch.cuda.graph(g):
            y.copy_(x)
        small = torch.zeros(8, device="cuda")
        rows = torch.arange(2048, device="cuda")
        latents = cache.cache[0][:2048].clone()
        probes = {
            "torch add_ (tiny)": lambda: small.add_(1),
            "F.linear 2048x2048 -> 1536": lambda: F.linear(x, lin),
            "rms_norm (triton)": lambda: rms_norm(x, w, 1e-6),
            "RMSNorm module": lambda: layer0.input_layernorm(x),
            "rope (triton)": lambda: rope(kpe, cos, cos, False),
            "prefill_attention (triton)": lambda: prefill_attention(q, kn, kpe, v, cu, cu, 512, 0.1),
            "gate (fused router)": lambda: layer0.gate(x),
            "cuda graph replay (1 copy)": g.replay,
            "torch.cat 2 tensors": lambda: torch.cat([kpe, kpe], dim=-1),
            "index_copy_": lambda: cache.cache[0].index_copy_(0, rows, latents),
        }
        for name, fn in probes.items():
            result["launch_us"][name] = launch_us(fn)
            lines.append(f"launch {name}: {result['launch_us'][name]:.1f} us")
    text = "\n".join(lines)
    print(text)
    with open(f"{out_dir}/host_profile.txt", "w") as f:
        f.write(text + "\n\n== torch.profiler (CPU), one 4x512 forward\n" + table)
        f.write("\n\n== cProfile by tottime\n" + cp_tot + "\n\n== cProfile by cumulative\n" + cp_cum)
    with open(f"{out_dir}/host_profile.json", "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
