"""The p2p connector over real processes (gloo on 127.0.0.1): outputs, DP wave, and failures.

Ranks are forked from a forkserver that has torch and afd preloaded, so a 7-rank topology starts in
well under a second. Each rank's stderr goes to a file that the test reads.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import random
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers.p2p_fakes import DENSE, LAYERS, E, H, K, P2pStandInFFN

from afd.connectors.p2p.attention import P2pAttentionExchange
from afd.connectors.p2p.ffn import P2pFFNLoop
from afd.distributed.world import init_world
from afd.topology import SyncTopology, expert_ranges


def schedule(attn_rank: int, num_steps: int | None = None) -> list[int]:
    """Token counts of one replica's busy steps: ragged, with zeros, and some replicas idle."""
    n = (2 * attn_rank + 3) % 5 if num_steps is None else num_steps
    return [(3 * attn_rank + 5 * s + 1) % 7 for s in range(n)]


def rows(attn_rank: int, step: int, num_tokens: int) -> torch.Tensor:
    return torch.randn(num_tokens, H, generator=torch.Generator().manual_seed(1000 * attn_rank + step))


def attention_forward(exchange, model: P2pStandInFFN, x: torch.Tensor, gate_on_attention: bool) -> torch.Tensor:
    """A stand-in model forward: the residual stream through every boundary layer."""
    for layer in LAYERS:
        if gate_on_attention and layer in DENSE:
            continue
        routing = model.route(layer, x) if gate_on_attention else None
        x = x + (exchange(layer, x, routing) if exchange else model.reference(layer, x, gate_on_attention))
    return x


def boundary(gate_on_attention: bool) -> list[int]:
    return [layer for layer in LAYERS if not (gate_on_attention and layer in DENSE)]


# --- one rank ----------------------------------------------------------------------------------
def start_kill_timer(spec: dict) -> None:
    """`kill_after_s`: SIGKILL this rank that long after its connector is built (its groups need every rank, so the
    whole world is up by then; counted from process start, a slow start under load killed the store host before
    a peer had joined, and that peer could not name it)."""
    if "kill_after_s" in spec and not spec.get("kill_timer_started"):
        spec["kill_timer_started"] = True
        threading.Timer(spec["kill_after_s"], os.kill, (os.getpid(), signal.SIGKILL)).start()


def rank_main(spec: dict) -> None:
    """Entry point of a rank process (forked by the forkserver)."""
    err = os.open(spec["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(err, 2)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, force=True)
    log = logging.getLogger("afd.test")
    time.sleep(spec.get("delay", 0.0))
    num_attn, num_ffn = spec.get("sizes", (spec["A"], spec["F"]))
    backend = spec.get("backend", "gloo")
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", spec["world_rank"] % torch.cuda.device_count())
        torch.cuda.set_device(device)
    world = None
    try:
        world = init_world(
            "127.0.0.1",
            spec["port"],
            spec["world_rank"],
            num_attn + num_ffn,
            backend,
            spec["timeout"],
            num_attention=num_attn,
            num_ffn=num_ffn,
            local_host=spec.get("local_host"),
        )
        topo = SyncTopology(num_attn, num_ffn)
        for phase, gate_on_attention in enumerate(spec["gates"]):
            name = f"p2p{phase}"
            if world.me.role == "ffn":
                model = P2pStandInFFN(expert_ranges(E, num_ffn)[world.me.role_rank])
                loop = P2pFFNLoop(
                    world,
                    topo,
                    model,
                    num_experts=E,
                    topk=K,
                    hidden_size=H,
                    dtype=torch.float32,
                    boundary_layers=boundary(gate_on_attention),
                    gate_on_attention=gate_on_attention,
                    dense_layers=() if gate_on_attention else DENSE,
                    name=name,
                )
                start_kill_timer(spec)
                steps = loop.run()
                Path(spec["out"], f"ffn{world.me.role_rank}_{phase}.json").write_text(json.dumps(steps))
                continue
            a = world.me.role_rank
            ex = P2pAttentionExchange(
                world,
                topo,
                gate_on_attention=gate_on_attention,
                topk=K,
                boundary_layers=boundary(gate_on_attention),
                name=name,
            )
            start_kill_timer(spec)
            busy, outs, step = schedule(a, spec.get("steps")), [], 0
            while ex.step_wave(step < len(busy)):
                if step == spec.get("kill_at_step"):
                    os.kill(os.getpid(), signal.SIGKILL)
                num_tokens = busy[step] if step < len(busy) else 0
                ex.begin_step(num_tokens)
                x = rows(a, step, num_tokens).to(device)
                outs.append(attention_forward(ex, P2pStandInFFN(), x, gate_on_attention).cpu())
                step += 1
            torch.save(outs, Path(spec["out"], f"attn{a}_{phase}.pt"))
        world.close()
    except BaseException as exc:  # noqa: BLE001 - report, tell the world, and leave without gloo teardown
        if world is not None:
            exc = world.blame(exc)
            world.close(error=exc)
        log.error("rank failed: %s", exc)
        logging.shutdown()
        os._exit(1)


# --- harness -----------------------------------------------------------------------------------
_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "afd.distributed.world", "afd.connectors.p2p.attention"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Result:
    exitcode: int | None
    stderr: str


def run_ranks(tmp_path: Path, specs: list[dict], limit_s: float) -> dict[int, Result]:
    """Start ranks in the given order, wait at most `limit_s`, kill whatever is left."""
    procs: dict[int, mp.Process] = {}
    try:
        for spec in specs:
            spec.setdefault("stderr", str(tmp_path / f"rank{spec['world_rank']}.err"))
            spec.setdefault("out", str(tmp_path))
            procs[spec["world_rank"]] = proc = _CTX.Process(target=rank_main, args=(spec,), daemon=True)
            proc.start()
        deadline = time.monotonic() + limit_s
        for proc in procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
    finally:
        for proc in procs.values():
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    return {r: Result(p.exitcode, Path(tmp_path / f"rank{r}.err").read_text()) for r, p in procs.items()}


def topology_specs(num_attn: int, num_ffn: int, seed: int, **extra) -> list[dict]:
    port, rng = _free_port(), random.Random(seed)
    specs = [
        dict(port=port, world_rank=r, A=num_attn, F=num_ffn, timeout=20.0, delay=rng.random() * 0.3, **extra)
        for r in range(num_attn + num_ffn)
    ]
    rng.shuffle(specs)  # ranks start in any order
    return specs


def assert_ok(results: dict[int, Result]) -> None:
    for r, res in results.items():
        assert res.exitcode == 0, f"world rank {r} exited {res.exitcode}:\n{res.stderr[-3000:]}"


# --- tests ---------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize(("num_attn", "num_ffn"), [(1, 1), (2, 2), (3, 2), (1, 2), (1, 4), (5, 2), (2, 3)])
def test_outputs_match_single_process(tmp_path: Path, num_attn: int, num_ffn: int) -> None:
    """Both gate placements in one world (two connector instances), ragged and idle replicas."""
    gates = [True, False]
    results = run_ranks(
        tmp_path, topology_specs(num_attn, num_ffn, seed=num_attn * 10 + num_ffn, gates=gates), limit_s=40
    )
    assert_ok(results)
    wave = max(len(schedule(a)) for a in range(num_attn))
    model = P2pStandInFFN()
    for phase, gate_on_attention in enumerate(gates):
        for f in range(num_ffn):
            assert json.loads((tmp_path / f"ffn{f}_{phase}.json").read_text()) == wave
        for a in range(num_attn):
            outs = torch.load(tmp_path / f"attn{a}_{phase}.pt")
            busy = schedule(a)
            assert len(outs) == wave  # an idle replica steps with zero tokens until the wave ends
            for step, out in enumerate(outs):
                num_tokens = busy[step] if step < len(busy) else 0
                want = attention_forward(None, model, rows(a, step, num_tokens), gate_on_attention)
                torch.testing.assert_close(
                    out,
                    want,
                    atol=1e-5,
                    rtol=1e-5,
                    msg=f"attention {a} step {step} gate_on_attention={gate_on_attention}",
                )


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_1a1f_matches_single_process(tmp_path: Path) -> None:
    """NCCL data plane (gloo control plane), one GPU per rank."""
    gates = [True, False]
    specs = topology_specs(1, 1, seed=5, gates=gates, backend="nccl")
    for s in specs:
        s["timeout"] = 60.0
    assert_ok(run_ranks(tmp_path, specs, limit_s=100))
    for phase, gate_on_attention in enumerate(gates):
        outs = torch.load(tmp_path / f"attn0_{phase}.pt")
        for step, num_tokens in enumerate(schedule(0)):
            want = attention_forward(None, P2pStandInFFN(), rows(0, step, num_tokens), gate_on_attention)
            torch.testing.assert_close(outs[step], want, atol=1e-4, rtol=1e-4)


@pytest.mark.timeout(30)
def test_missing_rank_is_named(tmp_path: Path) -> None:
    specs = [s for s in topology_specs(1, 2, seed=1, gates=[True]) if s["world_rank"] != 2]
    for s in specs:
        s["timeout"] = 2.0
    t0 = time.monotonic()
    results = run_ranks(tmp_path, specs, limit_s=15)
    assert time.monotonic() - t0 < 12
    for r, res in results.items():
        assert res.exitcode not in (0, None), r
        assert "world rank 2 (attention 0) did not arrive" in res.stderr, res.stderr


@pytest.mark.timeout(30)
def test_missing_store_host_is_named(tmp_path: Path) -> None:
    specs = [dict(port=_free_port(), world_rank=1, A=1, F=1, timeout=2.0, gates=[True])]
    results = run_ranks(tmp_path, specs, limit_s=15)
    assert results[1].exitcode not in (0, None)
    assert "hosted by world rank 0 (ffn 0)" in results[1].stderr, results[1].stderr


@pytest.mark.timeout(30)
def test_mismatched_sizes_are_named(tmp_path: Path) -> None:
    port = _free_port()
    specs = [
        dict(port=port, world_rank=0, A=1, F=2, timeout=5.0, gates=[True]),
        dict(port=port, world_rank=1, A=2, F=1, timeout=5.0, gates=[True]),
    ]
    results = run_ranks(tmp_path, specs, limit_s=15)
    for res in results.values():
        assert res.exitcode not in (0, None)
    assert "world rank 1 (attention 0)" in results[0].stderr and "num_attention=2, num_ffn=1" in results[0].stderr


@pytest.mark.timeout(40)
@pytest.mark.parametrize(("killed", "name"), [(3, "world rank 3 (attention 1)"), (0, "world rank 0 (ffn 0)")])
def test_killed_rank_is_named_by_the_others(tmp_path: Path, killed: int, name: str) -> None:
    """Kill an attention rank, or the FFN rank hosting the store, mid-run."""
    specs = topology_specs(2, 2, seed=7, gates=[True], steps=200)
    if killed == 0:
        specs.sort(key=lambda s: s["world_rank"])
        specs[0]["kill_after_s"] = 2.0
    else:
        specs[[s["world_rank"] for s in specs].index(killed)]["kill_at_step"] = 5
    t0 = time.monotonic()
    results = run_ranks(tmp_path, specs, limit_s=25)
    assert time.monotonic() - t0 < 20
    assert results[killed].exitcode == -signal.SIGKILL
    for r in set(results) - {killed}:
        assert results[r].exitcode not in (0, None), f"world rank {r}: {results[r].stderr[-2000:]}"
        assert name in results[r].stderr, f"world rank {r}: {results[r].stderr[:6000]}"


@pytest.mark.timeout(30)
def test_ranks_on_distinct_loopback_hosts(tmp_path: Path) -> None:
    """As if multi-host: FFN ranks bind 127.0.0.2/.3; only the world store listens on a known port."""
    specs = topology_specs(2, 2, seed=3, gates=[False])
    for s in specs:
        s["local_host"] = {0: "127.0.0.2", 1: "127.0.0.3"}.get(s["world_rank"], "127.0.0.1")
    assert_ok(run_ranks(tmp_path, specs, limit_s=20))
    outs = torch.load(tmp_path / "attn0_0.pt")
    want = attention_forward(None, P2pStandInFFN(), rows(0, 1, schedule(0)[1]), gate_on_attention=False)
    torch.testing.assert_close(outs[1], want, atol=1e-5, rtol=1e-5)
