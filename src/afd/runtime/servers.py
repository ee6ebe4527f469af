"""The ranks behind `afd serve`: started on this host like `afd launch` starts a run, supervised while the
front end serves, stopped on its word.

The front end makes the run's secret first (`new_secret`), keys its link listener with it, and hands both
to `start_server_ranks`: every attention rank (or whole-model replica, connector `none`) connects to that
listener, and the ranks get the same secret as `AFD_SECRET`. For `p2p` and `async` this process hosts the
world store, as the launcher does, so the ranks' watchdogs also stop them when the front end dies.

A server's rank takes a stop signal as "stop after this step" (`afd.runtime.online`): `stop` sends SIGTERM,
the replicas abort what they run, end the wave or close their windows, say `bye` and exit 0.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

from afd.config import AFDConfig
from afd.runtime.launch import (
    STOP_GRACE_S,
    LaunchError,
    RankProcess,
    clean_up_run,
    describe_exit,
    host_world_store,
    keep_logs,
    new_secret,
    rank_environment,
    rank_order,
    replica_command,
    spawn_rank,
    stop_all,
    worker_command,
    world_rank_of,
)
from afd.runtime.link import LinkAddress
from afd.runtime.spec import RunSpec
from afd.runtime.zygote import zygote_for_launch

__all__ = ["ServerRanks", "new_secret", "start_server_ranks"]

log = logging.getLogger(__name__)


class ServerRanks:
    """Every rank of one server. `names`: one per rank; `dead()`: those that exited; `stop()`: end them all."""

    def __init__(self, config: AFDConfig | None, run_dir: Path, store: object | None) -> None:
        self.config, self.run_dir = config, run_dir
        self.ranks: list[RankProcess] = []
        self._store = store  # the world store (p2p, async): referenced for as long as any rank may use it
        self._stopped = False

    @property
    def names(self) -> list[str]:
        return [rank.name for rank in self.ranks]

    def dead(self) -> list[str]:
        """One line per rank that exited (any status: a server's rank never ends on its own), with the log line
        that explains it: 'ffn rank 0 (world rank 0) exited with status -9 (killed by SIGKILL)'."""
        lines = []
        for rank in self.ranks:
            code = rank.proc.poll()
            if code is not None:
                why = rank.last_error()
                lines.append(f"{rank.name} exited with {describe_exit(code)}" + (f": {why}" if why else ""))
        return lines

    def stop(self, grace_s: float = STOP_GRACE_S) -> dict[str, int]:
        """SIGTERM every rank still running, SIGKILL what is left after `grace_s`; then remove what a crashed
        rank left (shared-memory windows) and the run directory — kept, and named in a warning, when a rank
        failed. Returns each rank's exit status by name (0: it ended cleanly). Calling it again is a no-op."""
        if self._stopped:
            return {rank.name: rank.proc.returncode for rank in self.ranks}
        self._stopped = True
        stop_all(self.ranks, grace_s)
        self._store = None  # every rank is gone: the world store can go too
        clean_up_run(self.config, self.run_dir, self.ranks)
        codes = {rank.name: rank.proc.returncode for rank in self.ranks}
        failed = [name for name, code in codes.items() if code != 0]
        if failed:
            log.warning("%s did not end cleanly; their logs are in %s", ", ".join(failed), self.run_dir)
        else:
            keep_logs(self.run_dir)
            shutil.rmtree(self.run_dir, ignore_errors=True)
        return codes


def start_server_ranks(
    config: AFDConfig | None,
    spec: RunSpec,
    replicas: int,
    serve_address: LinkAddress,
    *,
    secret: str,
    run_dir: Path | None = None,
) -> ServerRanks:
    """Start the ranks of a server on this host and return at once (they load, then connect to the front end).

    `config` None: `replicas` whole-model replicas (connector none; on CUDA replica i on GPU i mod count).
    Else the config's topology (`replicas` must be its `num_attention_ranks`); the world store is hosted here,
    at the config's host:port. Every replica connects to `serve_address` and authenticates with `secret`
    (`new_secret()`, the front end's link key). Raises LaunchError (exit status 2: the port is taken) before
    any rank starts, or after stopping those already started.
    """
    if config is not None and replicas != config.num_attention_ranks:
        raise ValueError(f"replicas={replicas} but the config has {config.num_attention_ranks} attention ranks")
    if replicas < 1:
        raise ValueError(f"a server needs at least one replica, got {replicas}")
    store = host_world_store(config, secret) if config is not None else None
    run_dir = Path(tempfile.mkdtemp(prefix="afd_serve_")) if run_dir is None else run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    server = ServerRanks(config, run_dir, store)
    env = rank_environment(secret)
    zygote = zygote_for_launch()
    try:
        if config is None:
            for r in range(replicas):
                cmd = replica_command(spec, r, replicas, run_dir, serve_address)
                server.ranks.append(spawn_rank("replica", r, r, cmd, run_dir, env, zygote))
        else:
            for role, role_rank in rank_order(config):
                cmd = worker_command(config, spec, role, role_rank, run_dir, serve_address)
                world_rank = world_rank_of(config, role, role_rank)
                server.ranks.append(spawn_rank(role, role_rank, world_rank, cmd, run_dir, env, zygote))
    except OSError as exc:  # no process could be made (resources): nothing half started stays
        server.stop()
        raise LaunchError(f"could not start the server's ranks: {exc}") from None
    except BaseException:
        server.stop()
        raise
    log.info("started %s; logs in %s", ", ".join(server.names), run_dir)
    return server
