"""Decode-shaped MoE kernels (afd.kernels.fused_moe) against the eager code they replace (afd.model.moe).

CPU: Triton's interpreter, fp32, tiny shapes (H=64, I=48, E=8), within 1e-5 of `routed_experts(fixed_shape=False)`
and of the eager grouped loop. GPU (`-m gpu`): DeepSeek-V2-Lite shapes in bf16 against an fp32 oracle and the
`torch._grouped_mm` path, bit-identical reruns, CUDA-graph capture + replay equal to eager, no host sync.
`python tests/test_kernel_moe.py [--sweep]` on the GPU prints one JSON line per batch size: `torch._grouped_mm`
path vs kernels, 26 layers of distinct expert weights in one CUDA graph, and the GB/s of each.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import contextlib  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("triton")

import afd.model.moe as moe  # noqa: E402
from afd.kernels import fused_moe as kmoe  # noqa: E402
from afd.kernels.moe_combine import combine_sorted_pairs  # noqa: E402
from afd.kernels.moe_down import expert_down  # noqa: E402
from afd.kernels.moe_gate_up import expert_gate_up  # noqa: E402
from afd.kernels.moe_sort import sort_pairs  # noqa: E402
from afd.kernels.moe_tiles import TileConfig, down_config, gate_up_config, rows_per_expert_hint  # noqa: E402
from afd.model.moe import grouped_expert_mlp, routed_experts, select_experts, sort_pairs_by_expert  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


cpu_only = pytest.mark.skipif(not INTERPRET, reason="interpreter test (runs where there is no GPU)")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

E, H, INTER = 8, 64, 48  # tiny CPU shapes: H and I not multiples of the default 64/128 tiles
SMALL_TILES = (TileConfig(16, 16, 16), TileConfig(16, 16, 32))  # several chunks, N tiles and K steps


def _experts(num_experts: int, hidden: int, inter: int, dtype=torch.float32, device="cpu", seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g, device=device) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g, device=device) * inter**-0.5
    return w13.to(dtype), w2.to(dtype)


def _routing(T: int, num_experts: int, K: int, device="cpu", seed: int = 0) -> moe.Routing:
    g = torch.Generator(device=device).manual_seed(seed)
    return select_experts(torch.randn(T, num_experts, generator=g, device=device), top_k=K, norm_topk_prob=True)


# ----------------------------------------------------------------------------------------------- CPU (interpreter)


@cpu_only
@pytest.mark.parametrize("T", [0, 1, 3, 17])
@pytest.mark.parametrize("K", [2, 3])
@pytest.mark.parametrize("expert_range", [(0, 8), (2, 5), (7, 8), (0, 0)])
def test_sort_pairs_equals_sort_pairs_by_expert(T, K, expert_range):
    """One-launch counting sort = `sort_pairs_by_expert`: same slots (stable, non-local pairs last), same offsets."""
    start, stop = expert_range
    r = _routing(T, E, K, seed=T + K)
    ref = sort_pairs_by_expert(r.topk_ids, start, stop)
    pair_idx, token_idx, offs = sort_pairs(r.topk_ids, start, stop - start)
    assert pair_idx.long().tolist() == ref.pair_idx.tolist()
    assert token_idx.long().tolist() == ref.token_idx.tolist()
    assert offs.tolist() == ref.offs.tolist()


@cpu_only
@pytest.mark.parametrize("T", [1, 3, 17])
@pytest.mark.parametrize("K", [2, 3])
@pytest.mark.parametrize("expert_range", [(0, 8), (2, 5), (5, 6)])
@pytest.mark.parametrize("tiles", [None, SMALL_TILES], ids=["table", "small_tiles"])
def test_fused_routed_experts_equals_routed_experts_fp32(T, K, expert_range, tiles):
    """Same result as the exact loop within 1e-5, on the whole expert set and on shards that exclude experts
    (pairs owned elsewhere add nothing), with the table's tiles (one chunk, masked N and K) and with small tiles
    (several row chunks per expert, several N tiles, several K steps)."""
    start, stop = expert_range
    w13, w2 = _experts(E, H, INTER, seed=K)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(T))
    r = _routing(T, E, K, seed=T)
    args = (x, r.topk_ids, r.topk_weights, w13[start:stop], w2[start:stop], start)
    ref = routed_experts(*args, fixed_shape=False)
    got = kmoe.fused_routed_experts(*args, configs=tiles and (tiles[0], tiles[1]))
    assert got.dtype == torch.float32 and got.shape == (T, H)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


@cpu_only
def test_fused_routed_experts_empty_and_foreign_cases():
    """No tokens, no local experts, and a batch none of whose pairs is local (every expert group empty, every
    row of the pair buffer unwritten): zeros of the right shape, never garbage."""
    w13, w2 = _experts(E, H, INTER)
    r = _routing(5, E, 2)
    x = torch.randn(5, H)
    assert kmoe.fused_routed_experts(x[:0], r.topk_ids[:0], r.topk_weights[:0], w13, w2).shape == (0, H)
    assert torch.equal(kmoe.fused_routed_experts(x, r.topk_ids, r.topk_weights, w13[:0], w2[:0], 3), torch.zeros(5, H))
    ids = torch.tensor([[0, 1], [1, 0], [0, 2], [2, 1], [1, 2]])  # experts 0..2 only; the shard holds 4..7
    got = kmoe.fused_routed_experts(x, ids, r.topk_weights, w13[4:], w2[4:], 4)
    assert torch.equal(got, torch.zeros(5, H))


@cpu_only
@pytest.mark.parametrize("sizes", [[3, 0, 5, 1, 0, 2], [0, 0, 17, 0], [1], [0, 0, 0]])
@pytest.mark.parametrize("tiles", [None, SMALL_TILES], ids=["table", "small_tiles"])
def test_fused_grouped_expert_mlp_equals_the_grouped_loop(sizes, tiles):
    """The async form (rows already grouped, device offsets, unweighted, x.dtype out) equals the eager loop on
    every row inside a group, including empty experts and padding rows past the last group (left alone)."""
    w13, w2 = _experts(len(sizes), H, INTER, seed=len(sizes))
    n = sum(sizes)
    x = torch.randn(n + 3, H, generator=torch.Generator().manual_seed(n))  # 3 padding rows belong to no group
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    ref = grouped_expert_mlp(x[:n], sizes, w13, w2, use_grouped_mm=False)
    got = kmoe.fused_grouped_expert_mlp(x, offs, w13, w2, configs=tiles and (tiles[0], tiles[1]))
    assert got.dtype == x.dtype and got.shape == x.shape
    torch.testing.assert_close(got[:n], ref, rtol=0, atol=1e-5)
    assert kmoe.fused_grouped_expert_mlp(x[:0], offs * 0, w13, w2).shape == (0, H)


@cpu_only
@pytest.mark.parametrize("T", [0, 1, 5, 33])
@pytest.mark.parametrize("expert_range", [(0, 8), (2, 5), (3, 3)])
def test_combine_sorted_pairs_equals_weigh_scatter_and_sum(T, expert_range):
    """The prefill-sized combine after `torch._grouped_mm`: from expert-sorted rows (non-local rows hold NaN, as
    the grouped GEMM leaves them) to the fp32 sum over local k, equal to weigh + scatter back + sum."""
    K, (start, stop) = 3, expert_range
    r = _routing(T, E, K, seed=T + start)
    pairs = sort_pairs_by_expert(r.topk_ids, start, stop)
    y = torch.randn(T * K, H)
    y[pairs.offs[-1] if stop > start else 0 :] = float("nan")  # never read
    got = combine_sorted_pairs(y, pairs.pair_idx, r.topk_weights, pairs.offs)
    local = (r.topk_ids >= start) & (r.topk_ids < stop)  # [T, K]
    by_pair = torch.zeros(T * K, H).index_copy_(0, pairs.pair_idx, torch.nan_to_num(y, nan=0.0))
    want = (by_pair.view(T, K, H) * (r.topk_weights * local)[..., None]).sum(1)
    assert got.shape == (T, H) and not got.isnan().any()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@cpu_only
def test_moe_dispatches_decode_batches_to_the_kernels(monkeypatch):
    """`routed_experts(fixed_shape=True)` and `grouped_expert_mlp_offsets` hand their arguments to the kernels
    when `_fused_moe_enabled` says so (forced on here; on CUDA it is the device, the batch size and
    `afd.kernels.enabled`), and the results equal the exact loop."""
    calls = []
    real = moe._fused_moe_enabled

    def forced(x, num_rows):
        calls.append(num_rows)
        return True

    monkeypatch.setattr(moe, "_fused_moe_enabled", forced)
    w13, w2 = _experts(E, H, INTER)
    x = torch.randn(9, H)
    r = _routing(9, E, 3, seed=4)
    args = (x, r.topk_ids, r.topk_weights, w13[2:7], w2[2:7], 2)
    torch.testing.assert_close(
        routed_experts(*args, fixed_shape=True), routed_experts(*args, fixed_shape=False), rtol=0, atol=1e-5
    )
    sizes = [2, 0, 4, 1, 0, 2, 0, 0]
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    got = moe.grouped_expert_mlp_offsets(x, offs, w13, w2)
    torch.testing.assert_close(got, grouped_expert_mlp(x, sizes, w13, w2, use_grouped_mm=False), rtol=0, atol=1e-5)
    assert calls == [27, 9]
    monkeypatch.setattr(moe, "_fused_moe_enabled", real)
    assert not moe._fused_moe_enabled(x, 1)  # CPU never takes them
    assert moe.FUSED_MOE_MAX_PAIRS >= 256 * 6  # decode batches of DeepSeek-V2 up to 256 tokens do


# ----------------------------------------------------------------------------------------------- GPU

V2_LITE = {"E": 64, "H": 2048, "I": 1408, "K": 6}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _oracle_fp32(x, ids, weights, w13, w2, start) -> torch.Tensor:
    """The definition in fp32 (bf16 inputs upcast, fp32 SwiGLU): the exact loop with fp32 weights."""
    return routed_experts(x.float(), ids, weights, w13.float(), w2.float(), start, fixed_shape=False)


@contextlib.contextmanager
def _kernels_off():
    """The eager-ops path (`torch._grouped_mm`) of the same functions: `AFD_DISABLE_TRITON=1`."""
    old = os.environ.get("AFD_DISABLE_TRITON")
    os.environ["AFD_DISABLE_TRITON"] = "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ["AFD_DISABLE_TRITON"]
        else:
            os.environ["AFD_DISABLE_TRITON"] = old


def _grouped_mm_ok() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(300)
def test_gpu_fused_routed_experts_bf16_v2_lite():
    """V2-Lite shapes, bf16, T in {1, 8, 64, 256}, all experts and a shard [16, 48): relative (Frobenius) error to
    the fp32 oracle <= 5e-3 (the kernel rounds only act to bf16; the grouped_mm path also rounds gate/up and y,
    so it is held to 1e-2 of the kernel); two runs give the same bits; `routed_experts` dispatches to it."""
    c = V2_LITE
    w13, w2 = _experts(c["E"], c["H"], c["I"], torch.bfloat16, "cuda")
    for T in (1, 8, 64, 256):
        x = torch.randn(T, c["H"], device="cuda", dtype=torch.bfloat16)
        r = _routing(T, c["E"], c["K"], device="cuda", seed=T)
        for start, stop in ((0, c["E"]), (16, 48)):
            args = (x, r.topk_ids, r.topk_weights, w13[start:stop], w2[start:stop], start)
            got = kmoe.fused_routed_experts(*args)
            again = kmoe.fused_routed_experts(*args)
            oracle = _oracle_fp32(*args)
            assert torch.equal(got, again), f"T={T} [{start}, {stop}): two runs differ"
            rel = _rel(got, oracle)
            assert rel <= 5e-3, f"T={T} [{start}, {stop}): relative error to the fp32 oracle {rel:.2e}"
            assert torch.equal(routed_experts(*args, fixed_shape=True), got), "routed_experts did not dispatch"
            if _grouped_mm_ok():
                with _kernels_off():
                    eager = routed_experts(*args, fixed_shape=True)
                assert _rel(got, eager) <= 1e-2, f"T={T}: kernel vs grouped_mm {_rel(got, eager):.2e}"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(300)
def test_gpu_prefill_sized_routed_experts_take_the_one_pass_combine():
    """Above the decode kernels' size (T*K > FUSED_MOE_MAX_PAIRS) the grouped GEMM stays, followed by `silu_mul`
    and `combine_sorted_pairs`: V2-Lite shapes, bf16, T = 1024 and 4096, all experts and a shard: within 1e-2 of
    the fp32 oracle and of the eager glue (which rounds the same bf16 products), same bits on two runs."""
    if not _grouped_mm_ok():
        pytest.skip("needs torch._grouped_mm (sm90+)")
    c = V2_LITE
    w13, w2 = _experts(c["E"], c["H"], c["I"], torch.bfloat16, "cuda")
    for T in (1024, 4096):
        assert T * c["K"] > moe.FUSED_MOE_MAX_PAIRS
        x = torch.randn(T, c["H"], device="cuda", dtype=torch.bfloat16)
        r = _routing(T, c["E"], c["K"], device="cuda", seed=T)
        for start, stop in ((0, c["E"]), (16, 48)):
            args = (x, r.topk_ids, r.topk_weights, w13[start:stop], w2[start:stop], start)
            got = routed_experts(*args, fixed_shape=True)
            assert torch.equal(got, routed_experts(*args, fixed_shape=True)), f"T={T}: two runs differ"
            assert _rel(got, _oracle_fp32(*args)) <= 1e-2, f"T={T} [{start}, {stop}): vs the fp32 oracle"
            with _kernels_off():
                eager = routed_experts(*args, fixed_shape=True)
            assert _rel(got, eager) <= 1e-3, f"T={T} [{start}, {stop}): vs the eager glue {_rel(got, eager):.2e}"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gpu_fused_routed_experts_fp16_fp32(dtype):
    """The other dtypes the kernels take, on V2-Lite shapes (T in {8, 64}, a shard): relative error to the fp32
    oracle <= 5e-3 in fp16 and <= 1e-5 in fp32 (fp32 products, not tf32); also the grouped (async) form."""
    c = V2_LITE
    w13, w2 = _experts(c["E"], c["H"], c["I"], dtype, "cuda")
    bound = 1e-5 if dtype == torch.float32 else 5e-3
    for T in (8, 64):
        x = torch.randn(T, c["H"], device="cuda", dtype=dtype)
        r = _routing(T, c["E"], c["K"], device="cuda", seed=T)
        args = (x, r.topk_ids, r.topk_weights, w13[16:48], w2[16:48], 16)
        rel = _rel(kmoe.fused_routed_experts(*args), _oracle_fp32(*args))
        assert rel <= bound, f"{dtype} T={T}: relative error {rel:.2e}"
        sizes = [T // 4, 0, T // 2, T - T // 4 - T // 2]
        offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32).cuda()
        got = kmoe.fused_grouped_expert_mlp(x, offs, w13[:4], w2[:4])
        ref = grouped_expert_mlp(x.float(), sizes, w13[:4].float(), w2[:4].float(), use_grouped_mm=False)
        assert _rel(got, ref) <= bound, f"{dtype} T={T} grouped: relative error {_rel(got, ref):.2e}"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(300)
def test_gpu_fused_grouped_expert_mlp_bf16_v2_lite():
    """The async form at V2-Lite shapes (32 local experts, uneven groups incl. empty ones, padding rows): every
    grouped row within 1e-2 relative error of the fp32 loop; `grouped_expert_mlp_offsets` dispatches to it."""
    c = V2_LITE
    w13, w2 = _experts(32, c["H"], c["I"], torch.bfloat16, "cuda")
    g = torch.Generator().manual_seed(0)
    for total in (6, 48, 384):
        sizes = torch.multinomial(torch.ones(32), total, replacement=True, generator=g).bincount(minlength=32)
        sizes[3] = 0
        n = int(sizes.sum())
        x = torch.randn(n + 5, c["H"], device="cuda", dtype=torch.bfloat16)
        offs = sizes.cumsum(0).to(torch.int32).cuda()
        got = kmoe.fused_grouped_expert_mlp(x, offs, w13, w2)
        ref = grouped_expert_mlp(x[:n].float(), sizes.tolist(), w13.float(), w2.float(), use_grouped_mm=False)
        assert _rel(got[:n], ref) <= 1e-2, f"{n} rows: relative error {_rel(got[:n], ref):.2e}"
        assert torch.equal(moe.grouped_expert_mlp_offsets(x, offs, w13, w2)[:n], got[:n])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(300)
def test_gpu_fused_moe_replays_from_a_cuda_graph_and_never_syncs():
    """Captured in a CUDA graph per T, replayed with new rows and routing copied into the captured inputs, the
    kernels give the same bits as eager; an eager call makes no host synchronisation."""
    c = V2_LITE
    w13, w2 = _experts(c["E"], c["H"], c["I"], torch.bfloat16, "cuda")
    for T in (1, 8, 64, 256):
        x = torch.randn(T, c["H"], device="cuda", dtype=torch.bfloat16)
        r = _routing(T, c["E"], c["K"], device="cuda", seed=1)
        ids, weights = r.topk_ids.clone(), r.topk_weights.clone()
        shard = (w13[8:56], w2[8:56], 8)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up (compiles) off the capture
            kmoe.fused_routed_experts(x, ids, weights, *shard)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = kmoe.fused_routed_experts(x, ids, weights, *shard)
        for seed in (2, 3):
            r = _routing(T, c["E"], c["K"], device="cuda", seed=seed)
            x.copy_(torch.randn(T, c["H"], device="cuda", dtype=torch.bfloat16))
            ids.copy_(r.topk_ids)
            weights.copy_(r.topk_weights)
            graph.replay()
            assert torch.equal(static_out, kmoe.fused_routed_experts(x, ids, weights, *shard)), f"T={T} seed={seed}"
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                kmoe.fused_routed_experts(x, ids, weights, *shard)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        syncs = [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]
        assert not syncs, f"T={T}: host syncs at {syncs}"


# ----------------------------------------------------------------------------------------------- timing


def _time_graph(fn, iters: int = 20) -> float:
    """ms per call of `fn` captured once in a CUDA graph and replayed `iters` times between two events."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


_SWEEP = [  # (block_m or None for the table's, block_n, block_k, num_warps, num_stages) tried by `--sweep`
    (None, 64, 128, 4, 4),
    (None, 64, 128, 4, 3),
    (None, 64, 64, 4, 6),
    (None, 128, 64, 4, 4),
    (None, 128, 64, 4, 5),
    (None, 128, 128, 4, 3),
    (None, 64, 256, 8, 3),
    (32, 64, 128, 4, 4),
    (32, 128, 64, 4, 4),
]


def _copy_gbps() -> float:
    """Device-to-device copy rate (read + write) of 4 GiB, GB/s, timed eagerly: inside a CUDA graph the copy
    becomes a memcpy node that reads slower (~2.8 TB/s seen) than the copy kernel an eager `copy_` launches."""
    src = torch.empty(1 << 32, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * src.numel() * 10 / start.elapsed_time(end) / 1e6


def _grouped_mm_path(*args) -> torch.Tensor:
    return routed_experts(*args, fixed_shape=True)  # with `_kernels_off`: sort + torch._grouped_mm + combine


def _all_layers(fn, x, routes, w13, w2):
    """A closure running `fn` (a routed-experts function) on every layer's routing and weights."""
    return lambda: [fn(x, r.topk_ids, r.topk_weights, w13[i], w2[i]) for i, r in enumerate(routes)]


def _sweep(x, routes, w13, w2, hint: int, weight_bytes: int) -> dict:
    """GB/s of `expert_gate_up` (2/3 of the weight bytes) and `expert_down` (1/3) alone, 26 layers in a graph, for
    each tile config of `_SWEEP` with the table's block_m; a config that does not fit is reported, not raised."""
    sorted_ = [sort_pairs(r.topk_ids, 0, w13.shape[1]) for r in routes]
    acts = [expert_gate_up(x, offs, w13[i], token_idx=tok) for i, (_, tok, offs) in enumerate(sorted_)]
    weights = [r.topk_weights.reshape(-1).contiguous() for r in routes]
    outs = [torch.empty(x.shape[0] * r.topk_ids.shape[1], x.shape[1], device="cuda") for r in routes]
    result = {}
    for bm, bn, bk, nw, ns in _SWEEP:
        cfg = TileConfig(bm or gate_up_config(hint).block_m, bn, bk, nw, ns)
        name = f"m{cfg.block_m}_n{bn}_k{bk}_w{nw}_s{ns}"

        def gate_up(cfg=cfg):
            for i, (_, tok, offs) in enumerate(sorted_):
                expert_gate_up(x, offs, w13[i], token_idx=tok, config=cfg)

        def down(cfg=cfg):
            for i, (pair, _, offs) in enumerate(sorted_):
                expert_down(acts[i], offs, w2[i], out=outs[i], dest_idx=pair, weights=weights[i], config=cfg)

        for kernel, fn, share in (("gate_up", gate_up, 2 / 3), ("down", down, 1 / 3)):
            try:
                ms = _time_graph(fn)
                result[f"{kernel}/{name}"] = {"ms": round(ms, 4), "GBps": round(share * weight_bytes / ms / 1e6)}
            except Exception as e:  # noqa: BLE001 - e.g. a config over the shared-memory limit
                result[f"{kernel}/{name}"] = f"{type(e).__name__}: {str(e)[:80]}"
    return result


def bench_moe_kernel(batches=(1, 8, 64, 256), layers: int = 26, sweep: bool = False) -> list[dict]:
    """One JSON line per T: 26 layers of V2-Lite routed experts (distinct weights, so L2 does not flatter either
    path) in one CUDA graph, `torch._grouped_mm` path vs the kernels; weight bytes of the touched experts and
    the GB/s each path achieves, beside the device-to-device copy rate of the same run. `sweep` also times
    the tile configs of `_SWEEP` (both kernels) and reports the best."""
    c = V2_LITE
    torch.manual_seed(0)
    w13 = torch.randn(layers, c["E"], 2 * c["I"], c["H"], device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(layers, c["E"], c["H"], c["I"], device="cuda", dtype=torch.bfloat16) * 0.02
    copy_gbps = _copy_gbps()
    expert_bytes = 3 * c["H"] * c["I"] * w13.element_size()
    results = []
    for T in batches:
        x = torch.randn(T, c["H"], device="cuda", dtype=torch.bfloat16)
        routes = [_routing(T, c["E"], c["K"], device="cuda", seed=100 * T + i) for i in range(layers)]
        touched = sum(int(torch.unique(r.topk_ids).numel()) for r in routes)
        weight_bytes = touched * expert_bytes

        with _kernels_off():
            base_ms = (
                _time_graph(_all_layers(_grouped_mm_path, x, routes, w13, w2)) if _grouped_mm_ok() else float("nan")
            )
        kernel_ms = _time_graph(_all_layers(kmoe.fused_routed_experts, x, routes, w13, w2))
        sort_ms = _time_graph(lambda: [sort_pairs(r.topk_ids, 0, c["E"]) for r in routes])  # noqa: B023
        hint = rows_per_expert_hint(T, c["K"], c["E"])
        line = {
            "kernel": "moe",
            "T": T,
            "layers": layers,
            "experts_touched_per_layer": touched / layers,
            "weight_GB": weight_bytes / 1e9,
            "grouped_mm_ms": base_ms,
            "kernel_ms": kernel_ms,
            "sort_pairs_ms": sort_ms,
            "grouped_mm_GBps": weight_bytes / base_ms / 1e6,
            "kernel_GBps": weight_bytes / kernel_ms / 1e6,
            "copy_GBps": copy_gbps,
            "floor_ms": weight_bytes / copy_gbps / 1e6,
            "gate_up_config": vars(gate_up_config(hint)),
            "down_config": vars(down_config(hint)),
        }
        if sweep:
            line["sweep"] = _sweep(x, routes, w13, w2, hint, weight_bytes)
        results.append(line)
        print(json.dumps(line), flush=True)
    return results


if __name__ == "__main__":
    bench_moe_kernel(sweep="--sweep" in sys.argv)


@pytest.mark.parametrize(("top_k", "num_local"), [(6, 64), (8, 256), (2, 4), (8, 32)])
def test_the_warm_up_token_counts_reach_every_routed_variant(top_k: int, num_local: int) -> None:
    """Every token count up to the step budget launches variants that one of the warm-up's counts compiled first,
    and the counts are few (V2-Lite: 20 for an 8,192-token budget)."""
    budget = 8192
    counts = kmoe.warm_up_token_counts(top_k, num_local, budget)
    made = {kmoe.routed_compile_key(t, top_k, num_local) for t in counts}
    needed = {kmoe.routed_compile_key(t, top_k, num_local) for t in range(1, budget + 1)}
    assert needed == made and len(counts) == len(made) <= 40
    assert counts == sorted(counts) and counts[0] == 1 and counts[-1] <= budget
    assert kmoe.warm_up_token_counts(6, 64, 8192) == [1, 3, 6, 8, 11, 16, 22, 24, 41, 43, 48, 83, 86, 88, 126, 128,
                                                      129, 136, 169, 256]  # fmt: skip
