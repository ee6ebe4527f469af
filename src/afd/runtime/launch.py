"""`afd launch`: start a whole topology on this host, one OS process per rank, and gather the outputs.

Each rank is `python -m afd worker ...` (the same entry a user runs by hand on another host). The
launcher hands every rank the run's files through one run directory: `rank_spec.json` in, one
`outputs_attn{r}.json` out per attention replica. It owns the process tree: a rank that fails ends the
run (the others are stopped), and SIGTERM/SIGINT to the launcher stops every rank it started.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from afd.config import AFDConfig
from afd.engine import Output
from afd.topology import Role, SyncTopology

log = logging.getLogger(__name__)

STOP_GRACE_S = 5.0


class LaunchError(RuntimeError):
    """A rank failed or the run did not finish in time; the message names the rank."""


@dataclass(frozen=True)
class RunSpec:
    """What every rank of a run must agree on besides the AFD config."""

    model: str = "tiny"
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    max_new_tokens: int = 16
    prompt_logprobs: bool = False
    max_num_batched_tokens: int = 2048
    timeout_s: float = 300.0  # the whole run, launcher side


@dataclass
class RankProcess:
    role: Role
    role_rank: int
    world_rank: int
    proc: subprocess.Popen
    log_path: Path
    extra: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.role} rank {self.role_rank} (world rank {self.world_rank})"

    def last_error(self) -> str:
        """The last meaningful line of the rank's log: what to show the user."""
        try:
            lines = [ln.strip() for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return "no log"
        errors = [ln for ln in lines if "error" in ln.lower()]
        return (errors or lines or ["no output"])[-1]


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


def worker_command(config: AFDConfig, spec: RunSpec, role: Role, role_rank: int, run_dir: Path) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "afd",
        "worker",
        "--config",
        json.dumps(config.to_dict()),
        "--role",
        role,
        "--rank",
        str(role_rank),
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
    if spec.prompt_logprobs:
        cmd.append("--prompt-logprobs")
    if role == "attention":
        cmd += [
            "--prompts-file",
            str(run_dir / f"prompts_attn{role_rank}.jsonl"),
            "--output",
            str(run_dir / f"outputs_attn{role_rank}.json"),
        ]
    return cmd


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


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def launch(
    config: AFDConfig,
    spec: RunSpec,
    prompts: list[list[int]],
    *,
    run_dir: Path | None = None,
    on_progress=None,
) -> tuple[list[Output], dict]:
    """Run `prompts` through a whole topology on this host; returns outputs in prompt order and run stats."""
    owned_dir = run_dir is None
    run_dir = Path(tempfile.mkdtemp(prefix="afd_run_")) if run_dir is None else run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    assignment = assign_prompts(prompts, config.num_attention_ranks)
    for a, indices in enumerate(assignment):
        lines = [json.dumps({"prompt_ids": prompts[i]}) + "\n" for i in indices]
        (run_dir / f"prompts_attn{a}.jsonl").write_text("".join(lines))

    ranks: list[RankProcess] = []
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

    def on_signal(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    if _in_main_thread():
        for sig in previous:
            signal.signal(sig, on_signal)
    try:
        order = [("ffn", f) for f in range(config.num_ffn_ranks)] + [
            ("attention", a) for a in range(config.num_attention_ranks)
        ]
        for role, role_rank in order:
            log_path = run_dir / f"{role}{role_rank}.log"
            with open(log_path, "wb") as log_file:
                proc = subprocess.Popen(
                    worker_command(config, spec, role, role_rank, run_dir),
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,  # its own process group: stop_all reaches its children too
                    env={**os.environ, "PYTHONUNBUFFERED": "1"},
                )
            ranks.append(RankProcess(role, role_rank, world_rank_of(config, role, role_rank), proc, log_path))
        _wait_for_ranks(ranks, spec.timeout_s, on_progress)
    finally:
        stop_all(ranks)
        _cleanup_transport(config, run_dir)
        if log.isEnabledFor(logging.INFO):
            _echo_rank_logs(ranks)
        if _in_main_thread():
            for sig, handler in previous.items():
                signal.signal(sig, handler)

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
                raise LaunchError(f"{rank.name} exited with status {code}: {rank.last_error()}")
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
    for child in path.iterdir():
        child.unlink()
    path.rmdir()


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()
