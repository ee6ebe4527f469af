"""One rank of a disaggregated run: `afd worker`. Started by `afd launch`, or by hand on any host.

An attention rank is an engine replica (its own requests, KV cache, prefill and greedy decode) whose
MoE layers go through the connector; an FFN rank serves its expert shard until the attention side is
done. The connector decides the loop: `p2p` steps every replica in one DP wave, `async` lets each
replica run on its own while the FFN loop drives itself.

A rank started by `afd launch` (it finds `AFD_LAUNCHER_PID` in its environment) is a client of the
launcher's world store, asks the kernel for SIGTERM when the launcher dies (`PR_SET_PDEATHSIG`), and
its watchdog also stops it when the launcher is gone: a launcher killed with -9 orphans nothing. A
rank started by hand hosts the store itself when it is world rank 0.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from afd import env
from afd.config import AFDConfig
from afd.engine import Engine, Output, Request
from afd.runtime.launch import RunSpec
from afd.topology import Role, SyncTopology, expert_ranges, local_gpu_index

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankJob:
    """Everything one rank needs: who it is, the model, and (attention) its prompts and output file."""

    config: AFDConfig
    role: Role
    role_rank: int
    spec: RunSpec
    prompts: tuple[tuple[int, ...], ...] = ()
    output_path: Path | None = None
    run_token: str = "afd"
    local_host: str | None = None  # the address this rank binds to (multi-host); default: derived from host
    device_index: int | None = None  # CUDA: this rank's local GPU (afd launch sets it; by hand: LOCAL_RANK, ...)

    @property
    def backend(self) -> str:
        return "nccl" if self.spec.device == "cuda" else "gloo"

    @property
    def timeout_s(self) -> float:
        extra = self.config.connector_extra_config
        return float(getattr(extra, "timeout_s", 120.0))


def select_device(job: RankJob, world_rank: int) -> torch.device:
    """CPU: a share of the host's cores. CUDA: the GPU `afd launch` chose (`--device-index`, packed by
    `gpu_placement`), or for a rank started by hand torchrun's conventions (`local_gpu_index`)."""
    if job.spec.device != "cuda":
        # ranks of one host share its cores: oversubscribed intra-op threads made every exchange ~7x slower
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // job.config.world_size))
        return torch.device("cpu")
    index = local_gpu_index(job.device_index, env.local_rank(), env.visible_devices(), torch.cuda.device_count())
    torch.cuda.set_device(index)
    log.info("world rank %d uses GPU %d of %d visible", world_rank, index, torch.cuda.device_count())
    return torch.device("cuda", index)


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class LauncherGone(RuntimeError):
    """The `afd launch` that started this rank is gone before the rank got going."""


def die_with_launcher(launcher_pid: int | None) -> None:
    """Have the kernel SIGTERM this rank when its launcher dies (Linux), then check the launcher is still here.

    The check after prctl closes the race of a launcher that died before the request took effect.
    """
    if launcher_pid is None:
        return
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            log.warning("no parent-death signal (errno %d); the watchdog still checks the launcher", ctypes.get_errno())
    if os.getppid() != launcher_pid:
        raise LauncherGone(f"the afd launch that started this rank (pid {launcher_pid}) is gone")


def world_options(job: RankJob) -> dict:
    """How this rank joins the world: a client of the launcher's store, or (by hand) world rank 0 hosts it."""
    launcher = env.launcher_pid()
    return {"local_host": job.local_host, "store_external": launcher is not None, "watch_pid": launcher}


class ReplicaStats:
    """Per-request time to first token and the replica's busy time, for the demo and bench tables."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.start_unix = time.time()
        self.num_steps = 0
        self.first_token: dict[int, float] = {}
        self.end = self.start

    def observe(self, engine: Engine, finished: list[Output]) -> None:
        now = time.perf_counter()
        self.num_steps += 1
        for seq in engine.running:
            if seq.token_ids and seq.request_id not in self.first_token:
                self.first_token[seq.request_id] = now - self.start
        for out in finished:
            self.first_token.setdefault(out.request_id, now - self.start)
        self.end = now

    def to_json(self) -> dict:
        """Times relative to the replica's start, plus that start on the wall clock to line replicas up."""
        return {
            "ttft_s": [self.first_token[k] for k in sorted(self.first_token)],
            "elapsed_s": self.end - self.start,
            "start_unix": self.start_unix,
            "num_steps": self.num_steps,
        }


def drive_replica(engine: Engine, job: RankJob, step_gate) -> tuple[list[Output], ReplicaStats]:
    """Run the replica's requests to completion; `step_gate(has_work)` says whether to step again."""
    for prompt in job.prompts:
        engine.add(Request(list(prompt), job.spec.max_new_tokens, job.spec.prompt_logprobs, job.spec.sampling))
    stats = ReplicaStats()
    outputs: dict[int, Output] = {}
    while step_gate(engine.has_work()):
        finished = engine.step()
        outputs.update((o.request_id, o) for o in finished)
        stats.observe(engine, finished)
    return [outputs[k] for k in sorted(outputs)], stats


def write_outputs(job: RankJob, outputs: list[Output], stats: ReplicaStats) -> None:
    if job.output_path is None:
        return
    tmp = job.output_path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"outputs": [o.to_json() for o in outputs], "stats": stats.to_json()}))
    tmp.replace(job.output_path)  # atomic: the launcher never reads half a file


# ---------------------------------------------------------------- p2p
def run_p2p_rank(job: RankJob) -> None:
    from afd.connectors.p2p import P2pAttentionExchange, P2pFFNLoop
    from afd.distributed import init_world
    from afd.weights import load_attention_model, load_ffn_model, load_model_config, resolve_dtype

    cfg = job.config
    topo = SyncTopology(cfg.num_attention_ranks, cfg.num_ffn_ranks)
    world_rank = topo.world_rank(job.role, job.role_rank)
    device = select_device(job, world_rank)
    model_config = load_model_config(job.spec.model)
    gate_on_attention = cfg.compute_gate_on_attention
    world = init_world(
        cfg.host,
        cfg.port,
        world_rank,
        topo.world_size,
        job.backend,
        job.timeout_s,
        num_attention=cfg.num_attention_ranks,
        num_ffn=cfg.num_ffn_ranks,
        **world_options(job),
    )
    try:
        common = dict(dtype=job.spec.dtype, device=device, gate_on_attention=gate_on_attention, seed=job.spec.seed)
        if job.role == "attention":
            model = load_attention_model(job.spec.model, **common)
            exchange = P2pAttentionExchange(
                world,
                topo,
                gate_on_attention=gate_on_attention,
                topk=model_config.num_experts_per_tok,
                boundary_layers=model.boundary_layers,
            )
            engine = Engine(model, exchange, job.spec.max_num_batched_tokens, **job.spec.cache.engine_kwargs())
            outputs, stats = drive_replica(engine, job, exchange.step_wave)
            write_outputs(job, outputs, stats)
        else:
            experts = expert_ranges(model_config.n_routed_experts, cfg.num_ffn_ranks)[job.role_rank]
            ffn_model = load_ffn_model(job.spec.model, expert_range=experts, **common)
            boundary = list(range(model_config.num_hidden_layers)) if not gate_on_attention else model_config.moe_layers
            dense = [i for i in boundary if not model_config.is_moe_layer(i)]
            steps = P2pFFNLoop(
                world,
                topo,
                ffn_model,
                num_experts=model_config.n_routed_experts,
                topk=model_config.num_experts_per_tok,
                hidden_size=model_config.hidden_size,
                dtype=resolve_dtype(job.spec.dtype),
                boundary_layers=boundary,
                gate_on_attention=gate_on_attention,
                dense_layers=dense,
            ).run()
            log.info("ffn rank %d served %d steps", job.role_rank, steps)
        world.close()
    except BaseException as exc:
        log.error("%s failed: %s", world.me.name, exc)
        world.close(error=exc)
        raise


# ---------------------------------------------------------------- entry
def run_rank(job: RankJob) -> int:
    """Run one rank; exit status 0 on a normal end. Leaves through os._exit to skip a gloo teardown hang."""
    die_with_launcher(env.launcher_pid())
    if job.config.connector == "p2p":
        run_p2p_rank(job)
    else:
        from afd.runtime.async_rank import run_async_rank

        run_async_rank(job)
    return 0


def exit_now(code: int) -> None:
    """Flush and leave without interpreter teardown (pending gloo work can block it until a timeout)."""
    logging.shutdown()
    os._exit(code)
