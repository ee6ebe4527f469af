"""One rank's side of `afd bench exchange` (1A1F, its own process): the no-op and echo FFNs the FFN rank
serves, and the attention rank's timed passes (eager or replayed from a CUDA graph) or ordering stress test.

`rank_main` is the process's target; `afd.bench.exchange` starts both ranks and reads back what they wrote.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from afd import env
from afd.connectors.asynchronous.attention import AsyncAttentionExchange
from afd.connectors.asynchronous.ffn import AsyncFFNServer, run_ffn_loop
from afd.connectors.p2p.attention import P2pAttentionExchange
from afd.connectors.p2p.ffn import P2pFFNLoop
from afd.distributed.world import World, init_world
from afd.profiling.profiler import profiled
from afd.routing import Routing
from afd.topology import AsyncTopology, SyncTopology


class NoOpFFN:
    """An FFN side that answers zeros without computing: only the exchange is left to time."""

    has_shared_experts = True  # answers zeros for them: the FFN side of the default placement

    def experts_topk(self, layer_idx: int, x: torch.Tensor, routing: Routing) -> torch.Tensor:  # [R, H] fp32
        return torch.zeros(x.shape, dtype=torch.float32, device=x.device)

    def shared(self, layer_idx: int, x: torch.Tensor) -> torch.Tensor:  # [R, H]
        return torch.zeros_like(x)


class EchoFFN:
    """An FFN side that answers each row with itself: a reply equals its request only if both directions
    delivered the current message (the ordering stress test, `run_exchange_stress`)."""

    has_shared_experts = True  # answers zeros for them: the FFN side of the default placement

    def experts_topk(self, layer_idx: int, x: torch.Tensor, routing: Routing) -> torch.Tensor:  # [R, H] fp32
        return x.float()

    def shared(self, layer_idx: int, x: torch.Tensor) -> torch.Tensor:  # [R, H]
        return torch.zeros_like(x)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


Exchange = Callable[[int, torch.Tensor, Routing], torch.Tensor]


def _time_exchanges(
    exchange: Exchange, spec: dict, device: torch.device, begin: Callable[[int], None] | None = None
) -> list[dict]:
    """For every T: `warmup` untimed passes, `iters` timed one by one, `iters` back to back. A pass is
    `spec["layers"]` exchanges, layer 0, 1, ... in order, each input the previous one plus its answer (a forward
    pass's residual stream); a row's times are per exchange (the pass's time over its layers)."""
    dtype = getattr(torch, spec["dtype"])
    layers = spec.get("layers", 1)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for num_tokens in spec["tokens"]:
        x0 = torch.randn(num_tokens, spec["hidden_size"], generator=gen).to(device=device, dtype=dtype)  # [T, H]
        scores = torch.rand(num_tokens, spec["num_experts"], generator=gen)  # [T, E]
        ids = scores.topk(spec["topk"], dim=1).indices.to(device)  # [T, K]
        routing = Routing(ids, torch.rand(num_tokens, spec["topk"], generator=gen).to(device))

        def one_pass(x0: torch.Tensor = x0, routing: Routing = routing) -> None:
            x = x0
            for layer_idx in range(layers):
                x = x + exchange(layer_idx, x, routing)

        if spec.get("graph"):
            one_pass = _captured(exchange, one_pass, device)
        if begin is not None:
            begin(num_tokens)
        for _ in range(spec["warmup"]):
            one_pass()
        _synchronize(device)
        single = []
        for _ in range(spec["iters"]):
            start = time.perf_counter()
            one_pass()
            _synchronize(device)
            single.append((time.perf_counter() - start) * 1e6 / layers)
        start = time.perf_counter()
        for _ in range(spec["iters"]):
            one_pass()
        _synchronize(device)
        mean = (time.perf_counter() - start) * 1e6 / spec["iters"] / layers
        deciles = statistics.quantiles(single, n=10) if len(single) > 1 else single * 9
        rows.append({"tokens": num_tokens, "p50_us": statistics.median(single), "p90_us": deciles[8], "mean_us": mean})
    return rows


def _captured(
    exchange: AsyncAttentionExchange, one_pass: Callable[[], None], device: torch.device
) -> Callable[[], None]:
    """`one_pass` captured in one CUDA graph, exchanges included (as a decode step of async 1A1F is captured): the
    returned call replays it between the exchange's `before_replay` / `after_replay`."""
    if not exchange.capturable:
        raise RuntimeError("--graph needs an async exchange that can be captured (CUDA, NVSHMEM waits, 1A1F)")
    exchange.warm_up_graph_kernels()
    one_pass()  # eager once: the kernels of the pass compile outside the capture
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    sends = exchange.captured_sends
    with torch.cuda.graph(graph):
        one_pass()
    sends = exchange.captured_sends - sends

    def replay() -> None:
        exchange.before_replay()
        graph.replay()
        exchange.after_replay(sends)

    return replay


def _run_p2p(world: World, spec: dict, device: torch.device) -> list[dict] | None:
    """Attention: the timed rows. FFN: serves one DP-wave step per token count, returns None."""
    topo = SyncTopology(1, 1)
    if world.me.role == "ffn":
        passes = spec["warmup"] + 2 * spec["iters"]  # one step per T, that many passes in it
        layers = list(range(spec.get("layers", 1))) * passes
        P2pFFNLoop(
            world,
            topo,
            NoOpFFN(),
            num_experts=spec["num_experts"],
            topk=spec["topk"],
            hidden_size=spec["hidden_size"],
            dtype=getattr(torch, spec["dtype"]),
            boundary_layers=layers,
            gate_on_attention=True,
        ).run()
        return None
    ex = P2pAttentionExchange(world, topo, gate_on_attention=True, topk=spec["topk"])

    def begin(num_tokens: int) -> None:
        ex.step_wave(True)
        ex.begin_step(num_tokens)

    with torch.inference_mode():  # as the engine runs its steps
        rows = _time_exchanges(ex, {**spec, "graph": False}, device, begin)  # p2p is never captured
    ex.step_wave(False)  # the wave is over: the FFN loop returns
    return rows


def _stress(exchange: Exchange, spec: dict, device: torch.device) -> list[dict]:
    """`spec["stress"]` round trips of fresh random rows, T drawn from 1..max(tokens), layer index cycling; every
    reply must equal its request (EchoFFN). Mismatches are counted on the device, read every 1,000 round trips."""
    dtype = getattr(torch, spec["dtype"])
    gen = torch.Generator().manual_seed(0)
    sizes = torch.randint(1, max(spec["tokens"]) + 1, (spec["stress"],), generator=gen).tolist()
    topk, experts = spec["topk"], spec["num_experts"]
    bad = torch.zeros((), dtype=torch.int64, device=device)
    start = time.perf_counter()
    for i, t in enumerate(sizes):
        x = torch.randn(t, spec["hidden_size"], device=device).to(dtype)  # [T, H]
        ids = (torch.arange(topk, device=device) + i).remainder(experts).expand(t, topk)  # [T, K]
        out = exchange(i % spec["num_layers"], x, Routing(ids, torch.ones(t, topk, device=device)))
        bad += (out != x).any()
        if i % 1000 == 999 and int(bad):
            raise RuntimeError(f"round trip {i}: {int(bad)} replies differed from their requests")
    _synchronize(device)
    elapsed = time.perf_counter() - start
    return [{"round_trips": len(sizes), "messages": 2 * len(sizes), "mismatches": int(bad), "seconds": elapsed}]


def _stress_captured(exchange: AsyncAttentionExchange, spec: dict, device: torch.device) -> list[dict]:
    """The stress test through captured passes, the path of a captured decode step (`send_request`, the device
    wait, `take_reply`): one graph per T of a few sizes up to the largest, each a pass of `num_layers` exchanges
    that echo the previous one's answer; replays in random order of sizes (the FFN's device chain mispredicts at
    every change of size and hands back, which is stressed too), fresh rows before each. The last answer of a
    pass equals its input only if every message of the pass was delivered whole and in order."""
    dtype = getattr(torch, spec["dtype"])
    topk, experts, layers = spec["topk"], spec["num_experts"], spec["num_layers"]
    top = max(spec["tokens"])
    sizes = sorted({1, 3, max(1, top // 8), max(1, top // 2), top})
    graphs = []
    for t in sizes:
        x = torch.zeros(t, spec["hidden_size"], device=device, dtype=dtype)  # [T, H], refilled before each replay
        ids = ((torch.arange(topk, device=device) + t) % experts).expand(t, topk).contiguous()  # [T, K]
        routing = Routing(ids, torch.ones(t, topk, device=device))
        answer: dict[str, torch.Tensor] = {}

        def one_pass(x: torch.Tensor = x, routing: Routing = routing, answer: dict = answer) -> None:
            y = x
            for layer_idx in range(layers):
                y = exchange(layer_idx, y, routing)
            answer["y"] = y  # after the capture: the graph's output buffer

        graphs.append((_captured(exchange, one_pass, device), x, answer))
    replays = -(-spec["stress"] // layers)
    picks = torch.randint(0, len(sizes), (replays,), generator=torch.Generator().manual_seed(0)).tolist()
    bad = torch.zeros((), dtype=torch.int64, device=device)
    start = time.perf_counter()
    for i, pick in enumerate(picks):
        replay, x, answer = graphs[pick]
        x.copy_(torch.randn(x.shape, device=device))
        replay()
        bad += (answer["y"] != x).any()
        if i % 100 == 99 and int(bad):
            raise RuntimeError(f"captured pass {i}: {int(bad)} passes ended with another answer than their input")
    _synchronize(device)
    elapsed = time.perf_counter() - start
    exchange.before_replay()  # raises if any reply failed the device-side header check
    trips = replays * layers
    return [{"round_trips": trips, "messages": 2 * trips, "mismatches": int(bad), "seconds": elapsed}]


def _run_async(world: World, spec: dict, device: torch.device) -> list[dict] | None:
    """Attention: the timed rows (or the stress test's). FFN: the self-driven loop until the shutdown flag,
    returns None."""
    topo = AsyncTopology(1, 1, spec["num_experts"])
    stress = spec.get("stress", 0)
    args = dict(
        hidden_size=spec["hidden_size"],
        topk=spec["topk"],
        num_layers=spec["num_layers"] if stress else spec.get("layers", 1),
        dtype=getattr(torch, spec["dtype"]),
        device=device,
        max_num_batched_tokens=max(spec["tokens"]),
        extra_config={"recv_poll_timeout_ms": 100},
        timeout_s=spec["timeout_s"],
    )
    if world.me.role == "ffn":
        run_ffn_loop(AsyncFFNServer(world.store, topo, 0, **args), EchoFFN() if stress else NoOpFFN())
        return None
    ex = AsyncAttentionExchange(world.store, topo, 0, **args)
    try:
        with torch.inference_mode():  # as the engine runs its steps (the window's buffers are inference tensors)
            if stress:
                return (_stress_captured if spec.get("graph") else _stress)(ex, spec, device)
            return _time_exchanges(ex, spec, device)
    finally:
        ex.close()  # the shutdown flag: the FFN loop returns


def rank_main(spec: dict, world_rank: int, out: str) -> None:
    """One rank's process: join a 2-rank world, run its side, write its rows (or its error) to `out`."""
    code = 1
    try:
        is_async = spec["connector"] == "async"
        role = ("attention", "ffn")[world_rank] if is_async else ("ffn", "attention")[world_rank]
        device = torch.device(spec["devices"][role])
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(1)  # two ranks share the host's cores
        backend = "nccl" if device.type == "cuda" and not is_async else "gloo"
        order = "attention_first" if is_async else "ffn_first"
        world = init_world(
            "127.0.0.1",
            spec["port"],
            world_rank,
            2,
            backend,
            spec["timeout_s"],
            num_attention=1,
            num_ffn=1,
            world_order=order,
        )
        with world.session(), profiled(f"{spec['connector']}_{role}", env.profile_dir()):
            rows = (_run_async if is_async else _run_p2p)(world, spec, device)
        Path(out).write_text(json.dumps({"rows": rows}))
        code = 0
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which names the rank
        Path(out).write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
    finally:
        os._exit(code)  # NVSHMEM's finalize is collective: never run it at exit (afd.transport.nvshmem)
