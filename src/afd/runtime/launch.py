"""`afd launch`: start a whole topology on this host, one OS process per rank, and gather the outputs.

Each rank is `python -m afd worker ...` (the same entry a user runs by hand on another host), forked from
the process's zygote, which imported torch once (`afd.runtime.zygote`). The
launcher hands every rank the run's files through one run directory: `prompts_attn{r}.jsonl` in, one
`outputs_attn{r}.json` out per attention replica, and one log per rank.

The launcher owns the run:
- it hosts the world store itself (bound to the configured host only), before any rank starts, so
  the store outlives every rank; a port already in use fails the run at once, alone;
- it mints a random secret per run and gives it to its ranks in the environment (`AFD_SECRET`, never
  argv), and its own pid on their command lines (`--launcher-pid`): ranks die with it (parent-death signal +
  watchdog);
- a rank that fails ends the run (the others are stopped); the error names the rank, quotes only the
  log lines that explain the failure, and points at the run directory, which a failed run keeps;
- SIGTERM, SIGINT and SIGHUP stop every rank it started and raise `Interrupted` (the CLI exits
  with 128 + signum).
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from afd import env
from afd.config import AFDConfig
from afd.distributed.signals import Interrupted
from afd.distributed.store import RendezvousError, host_store
from afd.engine.engine import Output
from afd.engine.sampling import SamplingParams
from afd.env import SECRET_VAR
from afd.model.kv_cache import CacheOptions
from afd.runtime.link import LinkAddress, format_address
from afd.runtime.spec import RunSpec
from afd.runtime.zygote import RankHandle, Zygote, ZygoteError, zygote_for_launch
from afd.topology import Role, SyncTopology

log = logging.getLogger(__name__)

STOP_GRACE_S = 5.0


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# "2026-01-01 10:00:00,123 afd.worker ERROR message": the rank log format set by the CLI
_LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ \S+ (ERROR|CRITICAL) (.*)$")


class LaunchError(RuntimeError):
    """A rank failed or the run did not finish in time; the message names the rank. `exit_status` 2: the
    run was refused before any rank started (its port is taken)."""

    def __init__(self, message: str, exit_status: int = 1) -> None:
        super().__init__(message)
        self.exit_status = exit_status


@dataclass
class RankProcess:
    role: str  # "attention", "ffn", or "replica" (a whole-model replica of a server, connector none)
    role_rank: int
    world_rank: int
    proc: subprocess.Popen | RankHandle  # RankHandle: forked by the launch's zygote
    log_path: Path
    extra: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        if self.role == "replica":
            return f"replica {self.role_rank}"
        return f"{self.role} rank {self.role_rank} (world rank {self.world_rank})"

    def last_error(self) -> str:
        """The rank's last log line that explains its failure, or '' (never an unrelated line)."""
        try:
            return explain_failure(self.log_path.read_text(errors="replace"))
        except OSError:
            return ""


def explain_failure(log_text: str) -> str:
    """The last line of a rank's log that explains a failure: an ERROR/CRITICAL record, the CLI's
    one-line error, or the exception line that ends a Python traceback; '' when there is none."""
    found = ""
    in_traceback = False
    for line in log_text.splitlines():
        line = line.rstrip()
        if line.startswith("Traceback (most recent call last)"):
            in_traceback = True
        elif in_traceback:
            if line and not line[0].isspace():  # the exception line closes the traceback
                found, in_traceback = line, False
        elif match := _LOG_LINE.match(line):
            found = match.group(2)
        elif line.startswith("afd: error: "):
            found = line[len("afd: ") :]
    return found


def describe_exit(code: int) -> str:
    """'status 1', or 'status -9 (killed by SIGKILL)'."""
    if code < 0:
        try:
            return f"status {code} (killed by {signal.Signals(-code).name})"
        except ValueError:
            pass
    return f"status {code}"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def world_rank_of(config: AFDConfig, role: Role, role_rank: int) -> int:
    if config.connector == "p2p":
        return SyncTopology(config.num_attention_ranks, config.num_ffn_ranks).world_rank(role, role_rank)
    return role_rank if role == "attention" else config.num_attention_ranks + role_rank


def assign_prompts(prompts: list[list[int]], num_attention: int) -> list[list[int]]:
    """Prompt `i` goes to attention replica `i % A`; returns the prompt indices per replica."""
    return [list(range(a, len(prompts), num_attention)) for a in range(num_attention)]


def worker_command(
    config: AFDConfig,
    spec: RunSpec,
    role: Role,
    role_rank: int,
    run_dir: Path,
    serve_address: LinkAddress | None = None,
    placement: list[int] | None = None,
    generation: int = 0,
) -> list[str]:
    """The `afd worker` command of one rank: its prompts and output files, or (a server's) the front end.
    `placement`: the local GPU of each world rank (-1: another host's), default the whole world on this host's.
    `generation` > 0: a server's async attention replica restarted alone, joining its running world."""
    cmd = [sys.executable, "-m", "afd", "worker", "--config", json.dumps(config.to_dict()), "--role", role]
    cmd += ["--rank", str(role_rank)] + _spec_flags(spec, run_dir)
    cache = spec.cache
    if spec.device == "cuda" and placement is None:  # the launcher packs the whole world onto this host's GPUs
        import torch

        from afd.topology import gpu_placement

        placement = gpu_placement(
            config.connector, config.num_attention_ranks, config.num_ffn_ranks, torch.cuda.device_count()
        )
    if spec.device == "cuda":
        gpu = placement[world_rank_of(config, role, role_rank)]
        cmd += ["--device-index", str(gpu)]
        cache = cache.shared_by(placement.count(gpu))  # co-located ranks split the GPU's memory
    cmd += cache_flags(cache) + sampling_flags(spec.sampling)
    if generation:
        cmd += ["--rejoin", str(generation)]
    if serve_address is not None:
        cmd += serve_flags(serve_address)
    elif role == "attention":
        cmd += [
            "--prompts-file",
            str(run_dir / f"prompts_attn{role_rank}.jsonl"),
            "--output",
            str(run_dir / f"outputs_attn{role_rank}.json"),
        ]
    return cmd


def replica_command(
    spec: RunSpec, replica: int, num_replicas: int, run_dir: Path, serve_address: LinkAddress
) -> list[str]:
    """The `afd worker` command of whole-model replica `replica` of `num_replicas` (connector none); on CUDA
    replica i takes GPU i mod the GPU count."""
    cmd = [sys.executable, "-m", "afd", "worker", "--role", "replica", "--rank", str(replica)]
    cmd += ["--replicas", str(num_replicas)] + _spec_flags(spec, run_dir)
    cache = spec.cache
    if spec.device == "cuda":
        import torch

        count = max(1, torch.cuda.device_count())
        cmd += ["--device-index", str(replica % count)]
        cache = cache.shared_by(len(range(replica % count, num_replicas, count)))  # replicas on that GPU
    return cmd + cache_flags(cache) + sampling_flags(spec.sampling) + serve_flags(serve_address)


def serve_flags(serve_address: LinkAddress) -> list[str]:
    return ["--serve-address", format_address(serve_address)]


def _spec_flags(spec: RunSpec, run_dir: Path) -> list[str]:
    """The flags of what every rank of a run agrees on (the model, its numerics, the step budget)."""
    cmd = [
        "--model",
        spec.model,
        "--dtype",
        spec.dtype,
        "--device",
        spec.device,
        "--seed",
        str(spec.seed),
        "--max-new-tokens",
        str(spec.max_new_tokens),
        "--max-num-batched-tokens",
        str(spec.max_num_batched_tokens),
        "--run-token",
        run_token(run_dir),
    ]
    if spec.quantization is not None:
        cmd += ["--quantization", spec.quantization]
    if spec.busy_poll:
        cmd.append("--busy-poll")
    if spec.prompt_logprobs:
        cmd.append("--prompt-logprobs")
    if spec.max_model_len is not None:
        cmd += ["--max-model-len", str(spec.max_model_len)]
    return cmd


def cache_flags(cache: CacheOptions) -> list[str]:
    """The `afd worker` flags that give a rank these cache options."""
    flags = ["--block-size", str(cache.block_size), "--gpu-memory-utilization", repr(cache.gpu_memory_utilization)]
    flags += ["--max-num-seqs", str(cache.max_num_seqs)]
    return flags + (["--num-gpu-blocks-override", str(cache.num_blocks)] if cache.num_blocks is not None else [])


def sampling_flags(sampling: SamplingParams) -> list[str]:
    """The `afd worker` flags that make a rank sample its requests this way."""
    flags = ["--temperature", repr(sampling.temperature), "--top-p", repr(sampling.top_p)]
    flags += ["--top-k", str(sampling.top_k)]
    return flags + (["--sampling-seed", str(sampling.seed)] if sampling.seed is not None else [])


def stop_all(ranks: list[RankProcess], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM every rank's process group, then SIGKILL what is still alive after the grace period."""
    for rank in ranks:
        if rank.proc.poll() is None:
            _signal_group(rank.proc, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for rank in ranks:
        try:
            rank.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for rank in ranks:
        if rank.proc.poll() is None:
            _signal_group(rank.proc, signal.SIGKILL)
            rank.proc.wait(timeout=grace_s)


def _signal_group(proc: subprocess.Popen | RankHandle, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def world_timeout(config: AFDConfig) -> float:
    """The bound on every wait of the ranks (`connector_extra_config.timeout_s`)."""
    return float(getattr(config.connector_extra_config, "timeout_s", 120.0))


def launch(
    config: AFDConfig,
    spec: RunSpec,
    prompts: list[list[int]],
    *,
    run_dir: Path | None = None,
    on_progress=None,
) -> tuple[list[Output], dict]:
    """Run `prompts` through a whole topology on this host; returns outputs in prompt order and run stats.

    Raises LaunchError (a rank failed, the port is taken, the run took too long; the run directory
    is kept and named) or Interrupted (a stop signal; every rank was stopped).
    """
    secret = new_secret()
    store = host_world_store(config, secret)
    owned_dir = run_dir is None
    run_dir = Path(tempfile.mkdtemp(prefix="afd_run_")) if run_dir is None else run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    rank_env = rank_environment(secret)
    zygote = zygote_for_launch()
    assignment = assign_prompts(prompts, config.num_attention_ranks)
    for a, indices in enumerate(assignment):
        lines = [json.dumps({"prompt_ids": prompts[i]}) + "\n" for i in indices]
        (run_dir / f"prompts_attn{a}.jsonl").write_text("".join(lines))

    ranks: list[RankProcess] = []
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    stopping = threading.Event()

    def on_signal(signum, _frame):
        if stopping.is_set():  # already stopping: let the cleanup finish
            log.warning("%s: the run is already stopping", signal.Signals(signum).name)
            return
        stopping.set()
        raise Interrupted(signum)

    if _in_main_thread():
        for sig, handler in previous.items():
            if handler is not signal.SIG_IGN:  # under nohup, SIGHUP stays ignored
                signal.signal(sig, on_signal)
    keep_dir = True  # a failed run keeps its directory (logs, prompts) for the user to read
    try:
        for role, role_rank in rank_order(config):
            cmd = worker_command(config, spec, role, role_rank, run_dir)
            world_rank = world_rank_of(config, role, role_rank)
            ranks.append(spawn_rank(role, role_rank, world_rank, cmd, run_dir, rank_env, zygote))
        _wait_for_ranks(ranks, spec.timeout_s, on_progress)
    except LaunchError as exc:
        raise LaunchError(f"{exc}; logs: {run_dir}") from None
    except Interrupted:
        keep_dir = not owned_dir  # stopped on request: nothing failed, nothing to read
        raise
    finally:
        stopping.set()
        stop_all(ranks)
        del store  # every rank is gone: the world store can go too
        clean_up_run(config, run_dir, ranks)
        if _in_main_thread():
            for sig, handler in previous.items():
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        if not keep_dir:
            _remove_tree(run_dir)

    outputs: list[Output | None] = [None] * len(prompts)
    stats: dict = {"replicas": []}
    for a, indices in enumerate(assignment):
        data = json.loads((run_dir / f"outputs_attn{a}.json").read_text())
        for i, out in zip(indices, data["outputs"], strict=True):
            outputs[i] = Output(**out)
        stats["replicas"].append(data.get("stats", {}))
    if owned_dir:
        _remove_tree(run_dir)
    return [o for o in outputs if o is not None], stats


def new_secret() -> str:
    """A random secret per run: a rank of another run on the same store is refused, and cannot stop this one.
    Ranks get it as `AFD_SECRET` (`rank_environment`); a server's front end also keys its link with it."""
    return secrets.token_hex(16)


def host_world_store(config: AFDConfig, secret: str):
    """Host the run's world store at the config's host:port before any rank starts (it outlives them all);
    LaunchError with exit status 2 when the port is taken."""
    try:
        return host_store(config.host, config.port, world_timeout(config), secret)
    except RendezvousError as exc:
        raise LaunchError(str(exc), exc.exit_status) from None


def rank_environment(secret: str) -> dict[str, str]:
    """A rank's environment: this process's, with the run's secret (never on a command line)."""
    return {**env.child_environ(), "PYTHONUNBUFFERED": "1", SECRET_VAR: secret}


def rank_order(config: AFDConfig) -> list[tuple[Role, int]]:
    """The order ranks are started in: FFN ranks first, then attention ranks."""
    return [("ffn", f) for f in range(config.num_ffn_ranks)] + [
        ("attention", a) for a in range(config.num_attention_ranks)
    ]


def spawn_rank(
    role: str, role_rank: int, world_rank: int, cmd: list[str], run_dir: Path, env: dict, zygote: Zygote | None = None
) -> RankProcess:
    """Start one rank in its own process group (stop_all reaches its children too), logging to the run dir:
    forked from `zygote`, or (None) as a process of its own. It is told this process's pid: it dies with us."""
    log_path = run_dir / f"{role}{role_rank}.log"
    cmd = [*cmd, "--launcher-pid", str(os.getpid())]
    if zygote is not None:
        try:
            return RankProcess(role, role_rank, world_rank, zygote.spawn(cmd, env, log_path), log_path)
        except ZygoteError as exc:
            raise LaunchError(f"could not start {role} rank {role_rank}: {exc}") from None
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, env=env
        )
    return RankProcess(role, role_rank, world_rank, proc, log_path)


def clean_up_run(config: AFDConfig | None, run_dir: Path, ranks: list[RankProcess]) -> None:
    """After every rank is gone: what a crashed rank could not remove, and (with -v) the ranks' logs."""
    if config is not None:
        _cleanup_transport(config, run_dir)
    if log.isEnabledFor(logging.INFO):
        _echo_rank_logs(ranks)


def _wait_for_ranks(ranks: list[RankProcess], timeout_s: float, on_progress) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(ranks)
    while pending:
        for rank in list(pending):
            code = rank.proc.poll()
            if code is None:
                continue
            pending.remove(rank)
            if code != 0:
                why = rank.last_error()
                raise LaunchError(f"{rank.name} exited with {describe_exit(code)}" + (f": {why}" if why else ""))
            if on_progress is not None:
                on_progress(rank)
        if time.monotonic() > deadline:
            names = ", ".join(r.name for r in pending)
            raise LaunchError(f"the run did not finish within {timeout_s:.0f} s; still running: {names}")
        time.sleep(0.02)


def _echo_rank_logs(ranks: list[RankProcess]) -> None:
    """With -v, the ranks' own log lines (window sizes, rendezvous, shutdown) reach the user's terminal."""
    for rank in ranks:
        try:
            lines = rank.log_path.read_text(errors="replace").splitlines()
        except OSError:
            continue
        for line in lines:
            if " afd." in line:
                log.info("[%s] %s", rank.name, line.split(" ", 2)[-1])


def _cleanup_transport(config: AFDConfig, run_dir: Path) -> None:
    """Unlink shared-memory windows a crashed rank could not unlink itself."""
    if config.connector == "async":
        from afd.transport.shm import cleanup_segments

        cleanup_segments(run_token(run_dir))


def run_token(run_dir: Path) -> str:
    return run_dir.name


def _remove_tree(path: Path) -> None:
    keep_logs(path)
    for child in path.iterdir():
        child.unlink()
    path.rmdir()


def keep_logs(run_dir: Path) -> None:
    """`AFD_LOG_DIR`: copy the run's rank logs there before its directory is removed."""
    folder = env.log_dir()
    if folder is None:
        return
    dest = Path(folder) / run_dir.name
    dest.mkdir(parents=True, exist_ok=True)
    for log_file in run_dir.glob("*.log"):
        shutil.copy2(log_file, dest / log_file.name)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()
