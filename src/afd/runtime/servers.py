"""The ranks behind `afd serve`: started on this host like `afd launch` starts a run, supervised while the
front end serves, restarted unit by unit when they die, stopped on its word.

The front end makes the run's secret first (`new_secret`), keys its link listener with it, and hands both
to `start_server_ranks`: every attention rank (or whole-model replica, connector `none`) connects to that
listener, and the ranks get the same secret as `AFD_SECRET`. For `p2p` and `async` this process hosts the
world store, as the launcher does, so the ranks' watchdogs also stop them when the front end dies.

A **unit** is what is restarted together: one whole-model replica (`none`), or the whole world (`p2p`, whose DP
wave is lockstep; `async`). `lost(unit)` says which of its replicas a death costs: a `none` replica itself; every
replica of a `p2p` world or of an `async` world that lost an FFN rank (its experts); only the dead attention
replicas of an `async` world otherwise. Those are restarted alone on CPU, where a restarted replica maps the
running world's shared-memory windows again (`Loss.alone`, `restart_alone`); on NVSHMEM, whose world is fixed at
init, the survivors finish their requests and the world is then restarted (`Loss.drain`). `restart(unit)` stops
what is left of it and starts it afresh from the zygote, on a new world store (a new port) for a world.

A server's rank takes a stop signal as "stop after this step" (`afd.runtime.online`): `stop` sends SIGTERM,
the replicas abort what they run, end the wave or close their windows, say `bye` and exit 0.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from afd.config import AFDConfig
from afd.runtime.launch import (
    STOP_GRACE_S,
    LaunchError,
    RankProcess,
    clean_up_run,
    describe_exit,
    free_port,
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

__all__ = ["Loss", "ServerRanks", "new_secret", "start_server_ranks"]

log = logging.getLogger(__name__)

BROKEN_STOP_GRACE_S = 0.25  # the rest of a unit that lost a rank: a broken world cannot end cleanly


@dataclass(frozen=True)
class Loss:
    """What the deaths in one unit cost: `replicas` (front-end indices) can no longer serve; `drain`: the unit's
    other replicas still serve their requests, and the unit is restarted once they are done; `alone`: only the dead
    replicas are restarted, and the others serve on. `why`: one sentence."""

    replicas: tuple[int, ...]
    drain: bool
    why: str
    alone: bool = False


@dataclass
class Unit:
    """Ranks restarted together. `replicas`: the front-end replica indices they serve; `generation`: 0 at start,
    one more per restart."""

    index: int
    replicas: tuple[int, ...]
    config: AFDConfig | None  # the world's config (its store's port changes per generation), None for `none`
    ranks: list[RankProcess] = field(default_factory=list)
    store: object | None = None  # the world store (p2p, async), referenced while any rank may use it
    generation: int = 0
    rejoins: int = 0  # attention replicas restarted alone into this unit's running world (async on CPU)


class ServerRanks:
    """Every rank of one server, by unit. `dead()`: lines for ranks that exited; `lost(unit)`, `restart(unit)`;
    `stop()`: end them all."""

    def __init__(self, config: AFDConfig | None, spec: RunSpec, replicas: int, run_dir: Path, secret: str,
                 serve_address: LinkAddress) -> None:  # fmt: skip
        self.config, self.spec, self.run_dir = config, spec, run_dir
        self.num_replicas, self.serve_address = replicas, serve_address
        self._env = rank_environment(secret)
        self._secret = secret
        if config is None:
            self.units = [Unit(r, (r,), None) for r in range(replicas)]
        else:
            self.units = [Unit(0, tuple(range(replicas)), config)]
        self._stopped = False
        self._lock = threading.Lock()  # a restart and the final stop never overlap

    @property
    def ranks(self) -> list[RankProcess]:
        return [rank for unit in self.units for rank in unit.ranks]

    @property
    def names(self) -> list[str]:
        return [rank.name for rank in self.ranks]

    def unit_of(self, replica: int) -> Unit:
        return next(unit for unit in self.units if replica in unit.replicas)

    # --- starting
    def start_unit(self, unit: Unit) -> None:
        """Spawn every rank of `unit` (a fresh world store first, for a world); LaunchError when one cannot be."""
        zygote = zygote_for_launch()
        if unit.config is None:
            (r,) = unit.replicas
            cmd = replica_command(self.spec, r, self.num_replicas, self.run_dir, self.serve_address)
            unit.ranks = [spawn_rank("replica", r, r, cmd, self.run_dir, self._env, zygote)]
            return
        unit.store = host_world_store(unit.config, self._secret)
        unit.ranks = []
        for role, role_rank in rank_order(unit.config):
            cmd = worker_command(unit.config, self.spec, role, role_rank, self.run_dir, self.serve_address)
            world_rank = world_rank_of(unit.config, role, role_rank)
            unit.ranks.append(spawn_rank(role, role_rank, world_rank, cmd, self.run_dir, self._env, zygote))

    # --- watching
    def dead(self) -> list[str]:
        """One line per rank that exited (any status: a server's rank never ends on its own), with the log line
        that explains it: 'ffn rank 0 (world rank 0) exited with status -9 (killed by SIGKILL)'."""
        return [line for unit in self.units for line in self.dead_in(unit)]

    def dead_in(self, unit: Unit) -> list[str]:
        return [_death_line(rank, code) for rank, code in _exited(unit)]

    def lost(self, unit: Unit) -> Loss | None:
        """What the ranks of `unit` that exited cost, or None while every one runs (module docstring)."""
        dead = _exited(unit)
        if not dead:
            return None
        lines = [_death_line(rank, code) for rank, code in dead]
        why = lines[0] + (f" (and {len(lines) - 1} more)" if len(lines) > 1 else "")
        config = unit.config
        if config is None or config.connector == "p2p" or any(rank.role != "attention" for rank, _ in dead):
            return Loss(unit.replicas, False, why)
        replicas = tuple(sorted(rank.role_rank for rank, _ in dead))
        if self.spec.device == "cpu" and len(replicas) < len(unit.replicas):
            return Loss(replicas, False, why, alone=True)
        return Loss(replicas, True, why)

    # --- restarting and stopping
    def stop_unit(self, unit: Unit, grace_s: float = BROKEN_STOP_GRACE_S) -> None:
        """End what is left of `unit` (SIGTERM, SIGKILL after `grace_s`) and remove what a crashed rank left; the
        logs of its ranks stay, renamed by generation."""
        stop_all(unit.ranks, grace_s)
        unit.store = None
        clean_up_run(unit.config, self.run_dir, unit.ranks)
        for rank in unit.ranks:
            if rank.log_path.exists():
                rank.log_path.replace(rank.log_path.with_suffix(f".{unit.generation}.log"))
        unit.ranks = []

    def restart(self, unit: Unit) -> None:
        """Stop what is left of `unit` and start it again (a world on a fresh store port); LaunchError when a rank
        cannot be started. Blocking: seconds at most (the new ranks load on their own and connect later)."""
        with self._lock:
            if self._stopped:
                raise LaunchError("the server is stopping")
            self.stop_unit(unit)
            unit.generation += 1
            if unit.config is not None:
                unit.config = unit.config.replace(port=free_port(unit.config.host))
            self.start_unit(unit)
        log.info("restarted %s (generation %d)", ", ".join(r.name for r in unit.ranks), unit.generation)

    def restart_alone(self, unit: Unit, replicas: tuple[int, ...]) -> None:
        """Start the dead attention ranks of `replicas` again, into the unit's running world (`Loss.alone`); each
        new process is a restart generation of its own. LaunchError when one cannot be started."""
        assert unit.config is not None
        with self._lock:
            if self._stopped:
                raise LaunchError("the server is stopping")
            zygote = zygote_for_launch()
            for i, rank in enumerate(list(unit.ranks)):
                if rank.role != "attention" or rank.role_rank not in replicas or rank.proc.poll() is None:
                    continue
                unit.rejoins += 1
                if rank.log_path.exists():
                    rank.log_path.replace(rank.log_path.with_suffix(f".{unit.generation}.{unit.rejoins}.log"))
                cmd = worker_command(unit.config, self.spec, "attention", rank.role_rank, self.run_dir,
                                     self.serve_address, generation=unit.rejoins)  # fmt: skip
                unit.ranks[i] = spawn_rank("attention", rank.role_rank, rank.world_rank, cmd, self.run_dir, self._env,
                                           zygote)  # fmt: skip
                log.info("restarted %s alone (restart %d of the running world)", unit.ranks[i].name, unit.rejoins)

    def stop(self, grace_s: float = STOP_GRACE_S) -> dict[str, int]:
        """SIGTERM every rank still running, SIGKILL what is left after `grace_s`; then remove what a crashed
        rank left (shared-memory windows) and the run directory — kept, and named in a warning, when a rank
        failed. Returns each rank's exit status by name (0: it ended cleanly). Calling it again is a no-op."""
        with self._lock:
            if self._stopped:
                return {rank.name: rank.proc.returncode for rank in self.ranks}
            self._stopped = True
        stop_all(self.ranks, grace_s)
        for unit in self.units:
            unit.store = None  # every rank is gone: the world store can go too
            clean_up_run(unit.config, self.run_dir, unit.ranks)
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
    run_dir = Path(tempfile.mkdtemp(prefix="afd_serve_")) if run_dir is None else run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    server = ServerRanks(config, spec, replicas, run_dir, secret, serve_address)
    try:
        for unit in server.units:
            server.start_unit(unit)
    except LaunchError:
        server.stop()
        raise
    except OSError as exc:  # no process could be made (resources): nothing half started stays
        server.stop()
        raise LaunchError(f"could not start the server's ranks: {exc}") from None
    except BaseException:
        server.stop()
        raise
    log.info("started %s; logs in %s", ", ".join(server.names), run_dir)
    return server


def _exited(unit: Unit) -> list[tuple[RankProcess, int]]:
    """The ranks of `unit` that exited, with their exit status, from one look at its rank list: a restart on another
    thread replaces that list, and a caller on the server's loop must not see two different ones."""
    return [(rank, code) for rank in list(unit.ranks) if (code := rank.proc.poll()) is not None]


def _death_line(rank: RankProcess, code: int) -> str:
    why = rank.last_error()
    return f"{rank.name} exited with {describe_exit(code)}" + (f": {why}" if why else "")
