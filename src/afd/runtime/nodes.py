"""`afd launch --nnodes N --node-rank K`: one command per host, each starting that host's share of the world ranks.

The split: the world ranks in world order (p2p: FFN ranks first; async: attention ranks first), `nproc_per_node`
consecutive ones per node, so node K starts world ranks K*P .. K*P+P-1. Every node is given the same command but
`--node-rank` (the same prompts included): prompt i still goes to attention replica i % A, and each node runs the
prompts of the attention replicas it hosts.

Node 0 hosts the run's world store at master_addr:master_port (as `afd launch` does on one host); every node's
launcher is a client of it, and its ranks are clients as under `afd launch` (they die with their own node's
launcher). The launchers meet in the store, in the run's namespace (from `AFD_SECRET`), under `nodes/`:
- `joined/K`: node K's launcher came; its record carries a digest of the run (config, run spec, prompts, split), so a
  node started with another command is refused, and node 0's carries the run token (async's shared-memory names);
- `alive/K`: a counter node K bumps while it waits; a node silent for the world timeout is gone;
- `outputs/attn{a}`: attention replica a's outputs file, posted by the node that ran it after its ranks ended well;
- `done/K` or `failed/K` (with the reason).
Node 0 waits for every node's done record (its outputs are in the store by then), prints the run's outputs and only
then closes the store. Records are signed with the run's key: a process without the secret cannot forge them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import secrets
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch.distributed as dist

from afd.config import AFDConfig
from afd.distributed.signals import Interrupted
from afd.distributed.store import RendezvousError, RunKeys, check_run_tag, connect_store, read_record
from afd.distributed.watchdog import FAILING_LINGER_S
from afd.engine.engine import Output
from afd.runtime.launch import (
    STOP_SIGNALS,
    LaunchError,
    RankProcess,
    assign_prompts,
    clean_up_run,
    describe_exit,
    host_world_store,
    keep_logs,
    rank_environment,
    rank_order,
    spawn_rank,
    stop_all,
    worker_command,
    world_rank_of,
    world_timeout,
)
from afd.runtime.spec import RunSpec
from afd.runtime.zygote import zygote_for_launch
from afd.topology import Role

log = logging.getLogger(__name__)

BEAT_S = 0.25  # how often a node's launcher bumps its `alive` counter while it waits


@dataclass(frozen=True)
class NodeSpec:
    """This host's place in a run over `nnodes` hosts; node 0 hosts the world store at master_addr:master_port."""

    nnodes: int
    node_rank: int
    nproc_per_node: int
    master_addr: str
    master_port: int

    def world_ranks(self) -> range:
        """The world ranks this node starts: `nproc_per_node` consecutive ones."""
        return range(self.node_rank * self.nproc_per_node, (self.node_rank + 1) * self.nproc_per_node)

    def node_of(self, world_rank: int) -> int:
        return world_rank // self.nproc_per_node

    def describe(self, node_rank: int) -> str:
        """'node 1 (world ranks 2-3)'."""
        first = node_rank * self.nproc_per_node
        ranks = (
            f"world rank {first}"
            if self.nproc_per_node == 1
            else f"world ranks {first}-{first + self.nproc_per_node - 1}"
        )
        return f"node {node_rank} ({ranks})"


def split_problem(nnodes: int, node_rank: int, nproc_per_node: int | None, world_size: int) -> str | None:
    """Why this split of a world over nodes is impossible (one sentence), or None when it is right."""
    if not 0 <= node_rank < nnodes:
        return f"--node-rank {node_rank} is out of range for --nnodes {nnodes} (0 to {nnodes - 1})"
    if nproc_per_node is None:
        if world_size % nnodes:
            return f"a world of {world_size} ranks does not split evenly over --nnodes {nnodes}; pick another --nnodes"
        return None
    if nproc_per_node * nnodes != world_size:
        return (
            f"--nproc-per-node {nproc_per_node} x --nnodes {nnodes} is {nproc_per_node * nnodes} ranks, but the "
            f"world has {world_size} (attention + FFN ranks); every node starts the same number of ranks"
        )
    return None


def ranks_in_world_order(config: AFDConfig) -> list[tuple[Role, int]]:
    """(role, role rank) of every world rank, indexed by world rank."""
    by_world = {world_rank_of(config, role, r): (role, r) for role, r in rank_order(config)}
    return [by_world[w] for w in range(len(by_world))]


def node_ranks(config: AFDConfig, node: NodeSpec) -> list[tuple[Role, int, int]]:
    """(role, role rank, world rank) of the ranks `node` starts, in world-rank order."""
    order = ranks_in_world_order(config)
    return [(*order[w], w) for w in node.world_ranks()]


def run_digest(config: AFDConfig, spec: RunSpec, prompts: list[list[int]], node: NodeSpec) -> str:
    """What every node must have been given alike (all but --node-rank and --timeout), hashed."""
    what = {
        "config": config.to_dict(),
        "spec": {k: v for k, v in asdict(spec).items() if k != "timeout_s"},
        "prompts": prompts,
        "split": [node.nnodes, node.nproc_per_node],
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()


class NodeStore:
    """This node's launcher's view of the `nodes/` records in the run's namespace of the world store; a store op
    that fails (its host, node 0, is gone) raises LaunchError saying so."""

    def __init__(self, root: dist.Store, keys: RunKeys, store_host: str) -> None:
        self.store = dist.PrefixStore(f"{keys.namespace}nodes/", root)
        self.keys = keys
        self.store_host = store_host

    def put(self, key: str, body: dict | str) -> None:
        text = body if isinstance(body, str) else json.dumps(body)
        with self._op():
            self.store.set(key, self.keys.sign(key, text))

    def get(self, key: str) -> str | None:
        with self._op():
            return read_record(self.store, self.keys, key)

    def beat(self, node_rank: int) -> None:
        with self._op():
            self.store.add(f"alive/{node_rank}", 1)

    def beats(self, node_rank: int) -> int:
        with self._op():
            return int(self.store.add(f"alive/{node_rank}", 0))

    @contextlib.contextmanager
    def _op(self) -> Iterator[None]:
        try:
            yield
        except Exception:  # noqa: BLE001 - torch raises several types when the store's host is gone
            raise LaunchError(f"{self.store_host}, the world store's host, stopped answering") from None


class _Stop:
    """SIGTERM, SIGINT and SIGHUP raise `Interrupted` (once) while the node runs; the old handlers come back."""

    def __enter__(self) -> None:
        self.previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
        self.stopping = threading.Event()
        self.active = threading.current_thread() is threading.main_thread()
        if self.active:
            for sig, handler in self.previous.items():
                if handler is not signal.SIG_IGN:
                    signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, _frame) -> None:
        if not self.stopping.is_set():
            self.stopping.set()
            raise Interrupted(signum)

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        if self.active:
            for sig, handler in self.previous.items():
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def launch_node(
    config: AFDConfig, spec: RunSpec, prompts: list[list[int]], node: NodeSpec, secret: str
) -> tuple[list[Output], dict] | None:
    """Start this node's share of the run and wait for it; node 0 returns the run's outputs in prompt order and its
    stats, other nodes None. `config` has the master's host and port. Raises LaunchError naming the node or rank that
    failed (exit status 2: refused before any rank started) or Interrupted."""
    if not secret:
        raise LaunchError("a run over several nodes needs AFD_SECRET in the environment, the same on every node", 2)
    keys = RunKeys.from_secret(secret)
    digest = run_digest(config, spec, prompts, node)
    timeout_s = world_timeout(config)
    server = host_world_store(config, secret) if node.node_rank == 0 else None
    root = server if server is not None else _reach_store(config, node, keys, timeout_s)
    nodes = NodeStore(root, keys, node.describe(0))
    parent = Path(tempfile.mkdtemp(prefix=f"afd_node{node.node_rank}_"))
    run_dir: Path | None = None
    ranks: list[RankProcess] = []
    keep = False  # a run that started ranks and failed keeps its directory (logs) for the user to read
    try:
        with _Stop():
            try:
                token = _join(nodes, node, digest, timeout_s)
                run_dir = parent / f"afd_run_{token}"  # the same name on every node: the ranks' run token
                run_dir.mkdir()
                keep = True
                ranks = _start_ranks(config, spec, prompts, node, run_dir, rank_environment(secret))
                _wait_local(ranks, nodes, node, spec.timeout_s)
                if node.node_rank != 0:
                    _post_outputs(nodes, config, node, run_dir)
                    nodes.put(f"done/{node.node_rank}", "1")
                    keep = False
                    return None
                _await_nodes_done(nodes, node, timeout_s, spec.timeout_s)
                result = _gather(nodes, config, node, prompts, run_dir)
                keep = False
                return result
            except LaunchError as exc:
                _say_failed(nodes, node, str(exc))
                if server is not None:
                    stop_all(ranks)
                    _linger(nodes, node)  # the other nodes' ranks may still read why from the store
                raise LaunchError(str(exc) + (f"; logs: {parent}" if keep else ""), exc.exit_status) from None
            except Interrupted:
                keep = False
                _say_failed(nodes, node, "stopped by a signal")
                raise
    finally:
        stop_all(ranks)
        if run_dir is not None:
            clean_up_run(config, run_dir, ranks)
        del nodes, root, server  # every local rank is gone, and every other node is done, failed or gone
        if not keep:
            if run_dir is not None:
                keep_logs(run_dir)
            shutil.rmtree(parent, ignore_errors=True)


def _reach_store(config: AFDConfig, node: NodeSpec, keys: RunKeys, timeout_s: float) -> dist.Store:
    """A client of node 0's world store, once node 0 is there (bounded); refuses a store of another run."""
    where = f"{config.host}:{config.port}"
    log.info("node %d: waiting for node 0's world store at %s", node.node_rank, where)
    try:  # plain sockets first: a TCPStore client that cannot connect yet logs C++ tracebacks
        root = connect_store(config.host, config.port, timeout_s)
    except Exception:  # noqa: BLE001 - torch raises several types here
        raise LaunchError(
            f"node 0, the world store's host at {where}, did not come within {timeout_s:.0f} s; start "
            "afd launch --node-rank 0 there, or check --master-addr and --master-port"
        ) from None
    try:
        check_run_tag(root, keys, config.host, config.port, timeout_s, f"node {node.node_rank}")
    except RendezvousError as exc:
        raise LaunchError(str(exc), exc.exit_status) from None
    return root


def _join(nodes: NodeStore, node: NodeSpec, digest: str, timeout_s: float) -> str:
    """Say this node came and wait (bounded) for the others; returns the run token node 0 minted."""
    if node.node_rank == 0:
        token = secrets.token_hex(6)
        nodes.put("joined/0", {"digest": digest, "token": token})
    else:
        nodes.put(f"joined/{node.node_rank}", {"digest": digest})
    log.info("node %d: joined; waiting for the other nodes", node.node_rank)
    deadline = time.monotonic() + timeout_s
    joined: dict[int, dict] = {}
    while True:
        for k in range(node.nnodes):
            if k not in joined and (body := nodes.get(f"joined/{k}")) is not None:
                joined[k] = json.loads(body)
                if joined[k]["digest"] != digest:
                    raise LaunchError(
                        f"node {k} was started with other flags or prompts than node {node.node_rank}; "
                        "give every node the same command but --node-rank",
                        2,
                    )
        nodes.beat(node.node_rank)
        if len(joined) == node.nnodes:
            return str(joined[0]["token"])
        if time.monotonic() >= deadline:
            missing = ", ".join(node.describe(k) for k in range(node.nnodes) if k not in joined)
            raise LaunchError(
                f"{missing} did not come within {timeout_s:.0f} s; start afd launch there with the same flags, "
                "its --node-rank and the same AFD_SECRET"
            )
        time.sleep(0.05)


def _start_ranks(
    config: AFDConfig, spec: RunSpec, prompts: list[list[int]], node: NodeSpec, run_dir: Path, env: dict
) -> list[RankProcess]:
    """Write this node's prompts files and start its ranks (CUDA: local rank i takes GPU i mod the GPU count)."""
    placement = None
    if spec.device == "cuda":
        import torch

        count = max(1, torch.cuda.device_count())
        placement = [-1] * (config.num_attention_ranks + config.num_ffn_ranks)
        for i, w in enumerate(node.world_ranks()):
            placement[w] = i % count
    assignment = assign_prompts(prompts, config.num_attention_ranks)
    zygote = zygote_for_launch()
    ranks = []
    for role, role_rank, world_rank in node_ranks(config, node):
        if role == "attention":
            lines = [json.dumps({"prompt_ids": prompts[i]}) + "\n" for i in assignment[role_rank]]
            (run_dir / f"prompts_attn{role_rank}.jsonl").write_text("".join(lines))
        cmd = worker_command(config, spec, role, role_rank, run_dir, placement=placement)
        ranks.append(spawn_rank(role, role_rank, world_rank, cmd, run_dir, env, zygote))
    return ranks


def _wait_local(ranks: list[RankProcess], nodes: NodeStore, node: NodeSpec, run_timeout_s: float) -> None:
    """Until every local rank ended well; fails on a rank's failure, another node's, or the store host's end."""
    deadline = time.monotonic() + run_timeout_s
    pending = list(ranks)
    next_beat = 0.0
    while pending:
        for rank in list(pending):
            code = rank.proc.poll()
            if code is None:
                continue
            pending.remove(rank)
            if code != 0:
                why = rank.last_error()
                raise LaunchError(f"{rank.name} exited with {describe_exit(code)}" + (f": {why}" if why else ""))
        if time.monotonic() >= next_beat:
            _check_nodes(nodes, node)
            next_beat = time.monotonic() + BEAT_S
        if time.monotonic() > deadline:
            names = ", ".join(r.name for r in pending)
            raise LaunchError(f"the run did not finish within {run_timeout_s:.0f} s; still running: {names}")
        time.sleep(0.02)


def _check_nodes(nodes: NodeStore, node: NodeSpec) -> None:
    """Beat, and fail at once when another node said it failed (before its ranks could say why, say)."""
    nodes.beat(node.node_rank)
    for k in range(node.nnodes):
        if k != node.node_rank and (why := nodes.get(f"failed/{k}")) is not None:
            raise LaunchError(f"{node.describe(k)} failed: {why}")


def _post_outputs(nodes: NodeStore, config: AFDConfig, node: NodeSpec, run_dir: Path) -> None:
    for role, role_rank, _ in node_ranks(config, node):
        if role == "attention":
            nodes.put(f"outputs/attn{role_rank}", (run_dir / f"outputs_attn{role_rank}.json").read_text())


def _await_nodes_done(nodes: NodeStore, node: NodeSpec, silence_s: float, run_timeout_s: float) -> None:
    """Node 0: until every other node said done; one that failed or went silent for `silence_s` is named."""
    pending = set(range(1, node.nnodes))
    last = {k: (-1, time.monotonic()) for k in pending}
    deadline = time.monotonic() + run_timeout_s
    while pending:
        for k in sorted(pending):
            if (why := nodes.get(f"failed/{k}")) is not None:
                raise LaunchError(f"{node.describe(k)} failed: {why}")
            if nodes.get(f"done/{k}") is not None:
                pending.discard(k)
                continue
            beat, since = last[k]
            now_beat = nodes.beats(k)
            if now_beat != beat:
                last[k] = (now_beat, time.monotonic())
            elif time.monotonic() - since > silence_s:
                raise LaunchError(f"{node.describe(k)} stopped without a word (its afd launch was killed?)")
        if pending and time.monotonic() > deadline:
            raise LaunchError(
                f"the run did not finish within {run_timeout_s:.0f} s; waiting for {node.describe(min(pending))}"
            )
        time.sleep(0.05)


def _gather(
    nodes: NodeStore, config: AFDConfig, node: NodeSpec, prompts: list[list[int]], run_dir: Path
) -> tuple[list[Output], dict]:
    """Node 0: the run's outputs in prompt order (local replicas from files, the others from the store)."""
    local = {r for role, r, _ in node_ranks(config, node) if role == "attention"}
    outputs: list[Output | None] = [None] * len(prompts)
    stats: dict = {"replicas": []}
    for a, indices in enumerate(assign_prompts(prompts, config.num_attention_ranks)):
        text = (run_dir / f"outputs_attn{a}.json").read_text() if a in local else nodes.get(f"outputs/attn{a}")
        if text is None:
            raise LaunchError(f"attention rank {a}'s outputs never reached node 0")
        data = json.loads(text)
        for i, out in zip(indices, data["outputs"], strict=True):
            outputs[i] = Output(**out)
        stats["replicas"].append(data.get("stats", {}))
    return [o for o in outputs if o is not None], stats


def _say_failed(nodes: NodeStore, node: NodeSpec, why: str) -> None:
    try:
        nodes.put(f"failed/{node.node_rank}", why)
    except Exception:  # noqa: BLE001 - the store host is gone: nobody is left to tell
        log.debug("node %d: could not record its failure", node.node_rank)


def _linger(nodes: NodeStore, node: NodeSpec) -> None:
    """Node 0 after a failure: keep the store a few seconds, until every other node said done or failed."""
    deadline = time.monotonic() + FAILING_LINGER_S
    others = range(1, node.nnodes)
    while time.monotonic() < deadline:
        if all(nodes.get(f"done/{k}") or nodes.get(f"failed/{k}") for k in others):
            return
        time.sleep(0.05)
