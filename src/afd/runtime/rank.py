"""What every rank process shares, whatever its connector: the job, its device, its launcher, its replica loop.

The role runtimes depend on this module one way: `worker` (p2p ranks and the entry), `async_rank` and
`online` import it, and it imports none of them.

A rank started by a launcher (`afd launch`, or `afd serve`'s front end: it is given `--launcher-pid`) is a
client of the launcher's world store, asks the kernel for SIGTERM when the
launcher dies (`PR_SET_PDEATHSIG`), and its watchdog also stops it when the launcher is gone: a launcher
killed with -9 orphans nothing. A rank started by hand hosts the store itself when it is world rank 0.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist

from afd import env
from afd.config import AFDConfig
from afd.distributed.watchdog import process_alive
from afd.distributed.world import World
from afd.engine.engine import Engine, Output, Request
from afd.profiling.profiler import profiled, watching_compiles
from afd.runtime.link import LinkAddress
from afd.runtime.spec import RunSpec
from afd.runtime.zygote import forked_from
from afd.topology import local_gpu_index
from afd.transport.symm_heap import wait_keys

log = logging.getLogger(__name__)

# "replica": a whole-model single-process engine (connector none), the data-parallel baseline of a server
RankRole = Literal["attention", "ffn", "replica"]


@dataclass(frozen=True)
class RankJob:
    """Everything one rank needs: who it is, the model, and (attention, replica) its prompts and output file,
    or the front end it serves (`serve_address`)."""

    config: AFDConfig
    role: RankRole
    role_rank: int
    spec: RunSpec
    prompts: tuple[tuple[int, ...], ...] = ()
    output_path: Path | None = None
    run_token: str = "afd"
    local_host: str | None = None  # the address this rank binds to (multi-host); default: derived from host
    device_index: int | None = None  # CUDA: this rank's local GPU (afd launch sets it; by hand: LOCAL_RANK, ...)
    serve_address: LinkAddress | None = None  # the front end's link; None: run `prompts` and exit
    num_replicas: int = 1  # role "replica": how many run side by side (they share this host's cores)
    launcher_pid: int | None = None  # the `afd launch` / `afd serve` that started it (it dies with it); None: by hand
    dtype_given: bool = True  # False: an FFN rank started without --dtype takes the attention side's (`ffn_dtype`)
    generation: int = 0  # > 0: a server's async attention replica restarted alone, joining its running world

    @property
    def backend(self) -> str:
        return "nccl" if self.spec.device == "cuda" else "gloo"

    @property
    def timeout_s(self) -> float:
        extra = self.config.connector_extra_config
        return float(getattr(extra, "timeout_s", 120.0))

    @property
    def processes_on_host(self) -> int:
        """The ranks of this run that share the host's cores."""
        return self.num_replicas if self.role == "replica" else self.config.world_size


def select_device(job: RankJob, world_rank: int) -> torch.device:
    """CPU: a share of the host's cores. CUDA: the GPU `afd launch` chose (`--device-index`, packed by
    `gpu_placement`), or for a rank started by hand torchrun's conventions (`local_gpu_index`)."""
    if job.spec.device != "cuda":
        # ranks of one host share its cores: oversubscribed intra-op threads made every exchange ~7x slower
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // job.processes_on_host))
        return torch.device("cpu")
    index = local_gpu_index(job.device_index, env.local_rank(), env.visible_devices(), torch.cuda.device_count())
    torch.cuda.set_device(index)
    log.info("world rank %d uses GPU %d of %d visible", world_rank, index, torch.cuda.device_count())
    return torch.device("cuda", index)


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class LauncherGone(RuntimeError):
    """The launcher that started this rank (`afd launch`, `afd serve`) is gone before the rank got going."""


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
    # a rank forked by the launch's zygote (afd.runtime.zygote) is the zygote's child; the zygote dies with the launcher
    parent = forked_from() or launcher_pid
    if os.getppid() != parent or (parent != launcher_pid and not process_alive(launcher_pid)):
        raise LauncherGone(f"the launcher that started this rank (pid {launcher_pid}) is gone")


def world_options(job: RankJob) -> dict:
    """How this rank joins the world: a client of the launcher's store, or (by hand) world rank 0 hosts it."""
    launcher = job.launcher_pid
    return {"local_host": job.local_host, "store_external": launcher is not None, "watch_pid": launcher}


class ReplicaStats:
    """Per-request time to first token and the replica's busy time, for the demo and bench tables."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.start_unix = time.time()
        self.num_steps = 0
        self.first_token: dict[int, float] = {}
        self.end = self.start
        self.decode_steps_ms: list[float] = []  # wall time of each all-decode step (overlap off: launch to tokens)

    def observe(self, engine: Engine, finished: list[Output]) -> None:
        now = time.perf_counter()
        if engine.last_launch_decode and not engine.overlap_steps:
            self.decode_steps_ms.append((now - self.end) * 1e3)
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
            "decode_steps_ms": self.decode_steps_ms,
        }


@contextlib.contextmanager
def profile_rank(job: RankJob) -> Iterator[None]:
    """Around this rank's serving part: `AFD_PROFILE=DIR` profiles it into DIR/<connector>_<role><rank>.*, and on
    CUDA the Triton kernels compiled inside it are logged (`afd.profiling.profiler`)."""
    connector = "none" if job.role == "replica" else job.config.connector
    name = f"{connector}_{job.role}{job.role_rank}"
    with watching_compiles(job.spec.device == "cuda"), profiled(name, env.profile_dir()):
        yield


def drive_replica(engine: Engine, job: RankJob, step_gate: Callable[[bool], bool]) -> tuple[list[Output], ReplicaStats]:
    """Run the replica's requests to completion; `step_gate(has_work)` says whether to step again."""
    for prompt in job.prompts:
        engine.add(Request(list(prompt), job.spec.max_new_tokens, job.spec.prompt_logprobs, job.spec.sampling))
    stats = ReplicaStats()
    outputs: dict[int, Output] = {}
    with profile_rank(job):
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


def engine_for(job: RankJob, model, exchange) -> Engine:
    """The replica's engine with the run's token budget, cache options and model length."""
    from afd.engine.warm_up import warm_up_engine

    spec = job.spec
    engine = Engine(
        model, exchange, spec.max_num_batched_tokens, max_model_len=spec.max_model_len, **spec.cache.engine_kwargs()
    )
    warm_up_engine(engine)  # compile the CUDA step's kernels before the replica's first timed step
    return engine


def local_replica_engine(job: RankJob) -> Engine:
    """A whole-model replica's engine in this process (attention model + FFN model + `LocalExchange`, as the
    reference engine is built), on the job's device, warmed up: connector `none`, and the bench's engine-alone run."""
    from afd.engine.engine import LocalExchange
    from afd.model.weights import load_attention_model, load_ffn_model

    load = dict(dtype=job.spec.dtype, device=select_device(job, job.role_rank), seed=job.spec.seed)
    load["quantization"] = job.spec.quantization
    attn, ffn = load_attention_model(job.spec.model, **load), load_ffn_model(job.spec.model, **load)
    return engine_for(job, attn, LocalExchange(ffn))


def ffn_dtype(job: RankJob, world: World) -> str:
    """The dtype an FFN rank loads and exchanges in: the one the attention ranks published at rendezvous (a vLLM
    engine's may differ from what it was asked: vLLM runs float32 as bfloat16 on CPU). A `--dtype` given to the
    FFN rank must name the same; without any published (attention ranks of another build) the job's own."""
    published = {p.dtype for p in world.peers.values() if p.role == "attention" and p.dtype}
    if len(published) > 1:
        raise ValueError(f"the attention ranks run different dtypes ({', '.join(sorted(published))}); give them one")
    if not published:
        return job.spec.dtype
    (attention,) = published
    if job.dtype_given and job.spec.dtype != attention:
        raise ValueError(
            f"ffn rank {job.role_rank} was started with --dtype {job.spec.dtype} but the attention side runs "
            f"{attention}; leave --dtype out (an FFN rank takes the attention side's) or give {attention}"
        )
    return attention


FFN_READY_KEY = "afd/ffn_ready"  # + "/<ffn rank>": set once the rank's kernels are compiled and its graphs captured


def announce_ffn_ready(store: dist.Store, ffn_rank: int) -> None:
    """An FFN rank finished its start-up (warm-up compiles, CUDA graph capture): attention ranks may start."""
    store.set(f"{FFN_READY_KEY}/{ffn_rank}", "1")


def wait_ffn_ready(store: dist.Store, num_ffn: int, timeout_s: float) -> None:
    """Wait, bounded, for every FFN rank's start-up before the first request: it happens after the world (and a
    window) exist, and would otherwise sit inside the first request's time to first token."""
    keys = [f"{FFN_READY_KEY}/{f}" for f in range(num_ffn)]
    wait_keys(store, keys, timeout_s, "the FFN ranks' start-up (kernels compiled, graphs captured)")
