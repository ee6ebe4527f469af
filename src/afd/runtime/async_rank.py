"""One rank of an `async` run: an attention replica that never waits for the others, or a self-driven FFN rank.

The world store (the same rendezvous as p2p, attention ranks first) carries only the bootstrap: the
window geometry, the heap handles and the liveness records. After that every byte moves through the
symmetric windows. Replicas finish at different times (that is what `async` is for): the store is
hosted by the launcher, or by attention rank 0 (world rank 0) which, finished, keeps hosting it until
every other rank is done, so an early finish never ends the others. `timeout_s` in
`connector_extra_config` bounds every wait, as in p2p.
"""

from __future__ import annotations

import logging

import torch

from afd.buckets import DEFAULT_BATCH_BUCKETS
from afd.connectors.asynchronous.attention import AsyncAttentionExchange
from afd.connectors.asynchronous.ffn import AsyncFFNServer, run_ffn_loop
from afd.distributed.world import World, init_world
from afd.engine.graphs.ffn import ExpertPassGraphs
from afd.engine.warm_up import warm_up_ffn
from afd.model.weights import load_attention_model, load_ffn_model, load_model_config, resolve_dtype
from afd.runtime.online import run_online, stop_on_signals
from afd.runtime.rank import (
    RankJob,
    announce_ffn_ready,
    drive_replica,
    engine_for,
    ffn_dtype,
    profile_rank,
    select_device,
    wait_ffn_ready,
    world_options,
    write_outputs,
)
from afd.topology import AsyncTopology
from afd.transport.factory import default_heap_factory
from afd.transport.shm import ShmHeap
from afd.transport.symm_heap import HeapFactory

log = logging.getLogger(__name__)


def heap_factory(job: RankJob, world: World, device: torch.device, topo: AsyncTopology) -> HeapFactory:
    """Shared memory named after the launcher's run token (so it can clean up after a crash), or NVSHMEM. A server's
    FFN ranks keep their windows' names, so that an attention replica restarted alone can map them again."""
    rank, size = world.me.world_rank, world.world_size
    if job.generation and (device.type != "cpu" or job.role != "attention"):
        raise ValueError("only an attention replica on CPU shared memory can join a running async world")
    if device.type == "cpu" and job.run_token != "afd":
        ffn_ranks = [topo.world_rank("ffn", f) for f in range(topo.num_ffn)]
        options = dict(run_token=job.run_token, timeout_s=job.timeout_s, generation=job.generation)
        options["keep_name"] = job.serve_address is not None and job.role == "ffn"
        options["peers"] = ffn_ranks if job.generation else None  # a restarted replica writes to the FFN ranks only
        return lambda nbytes: ShmHeap(world.store, rank, size, nbytes, **options)
    return default_heap_factory(world.store, rank, size, device, job.timeout_s)


def run_async_rank(job: RankJob) -> None:
    cfg = job.config
    model_config = load_model_config(job.spec.model)
    topo = AsyncTopology(cfg.num_attention_ranks, cfg.num_ffn_ranks, model_config.n_routed_experts)
    world_rank = topo.world_rank(job.role, job.role_rank)
    device = select_device(job, world_rank)
    world = init_world(
        cfg.host,
        cfg.port,
        world_rank,
        topo.world_size,
        "gloo",
        job.timeout_s,
        num_attention=cfg.num_attention_ranks,
        num_ffn=cfg.num_ffn_ranks,
        world_order="attention_first",
        # a server's attention replica may die alone: the FFN ranks drop it and the server restarts the instance
        expendable=frozenset(range(cfg.num_attention_ranks)) if job.serve_address is not None else frozenset(),
        dtype=job.spec.dtype if job.role == "attention" else None,
        rejoin=job.generation > 0,
        **world_options(job),
    )
    shared_on_attention = cfg.connector_extra_config.shared_experts_on_attention  # where the shared experts run
    with world.session():
        dtype = job.spec.dtype if job.role == "attention" else ffn_dtype(job, world)  # before loading
        endpoint_args = dict(
            hidden_size=model_config.hidden_size,
            topk=model_config.num_experts_per_tok,
            num_layers=model_config.num_hidden_layers,
            dtype=resolve_dtype(dtype),
            device=device,
            max_num_batched_tokens=job.spec.max_num_batched_tokens,
            extra_config=cfg.connector_extra_config,
            heap_factory=heap_factory(job, world, device, topo),
            timeout_s=job.timeout_s,
        )
        load_args = dict(dtype=dtype, device=device, gate_on_attention=True, seed=job.spec.seed)
        load_args["quantization"] = job.spec.quantization
        if job.role == "attention":
            model = load_attention_model(job.spec.model, shared_experts=shared_on_attention, **load_args)
            exchange = AsyncAttentionExchange(
                world.store, topo, job.role_rank, shared_experts=model.shared, **endpoint_args
            )
            if shared_on_attention:
                log.info("attention rank %d: shared experts run here, between each send and its recv", job.role_rank)
            try:
                engine = engine_for(job, model, exchange)  # splits its steps into `exchange.num_ubatches`
                if exchange.num_ubatches > 1:
                    log.info(
                        "attention rank %d: eager steps of two or more sequences run as %d micro-batches in ping-pong",
                        job.role_rank,
                        exchange.num_ubatches,
                    )
                wait_ffn_ready(world.store, topo.num_ffn, job.timeout_s)  # their start-up is not the first TTFT
                if job.serve_address is not None:
                    run_online(engine, job)  # no wave: an idle replica waits on its link, not on the others
                else:
                    outputs, stats = drive_replica(engine, job, lambda has_work: has_work)  # no wave: alone
                    write_outputs(job, outputs, stats)
                    if exchange.num_ubatches > 1:
                        log.info(
                            "attention rank %d: %d of %d steps ran as micro-batches",
                            job.role_rank,
                            engine.ubatched_steps,
                            stats.num_steps,
                        )
            finally:
                exchange.close()  # the shutdown bit to every FFN rank
        else:
            experts = topo.expert_ranges[job.role_rank]
            ffn_model = load_ffn_model(
                job.spec.model, expert_range=experts, shared_experts=not shared_on_attention, **load_args
            )
            warm_up_ffn(ffn_model, device, max_num_batched_tokens=job.spec.max_num_batched_tokens)  # before any item
            server = AsyncFFNServer(world.store, topo, job.role_rank, **endpoint_args)
            server.drop_dead_peers = job.serve_address is not None  # serving: the others' requests go on
            # 1A1F on CUDA: whole passes enqueued on the device at decode sizes; what the host serves (elsewhere
            # everything, there the rest) replays one graph per pass up to the token budget
            chained = server.chain_to(ffn_model, graphs_usable=ExpertPassGraphs.usable(ffn_model))
            if ExpertPassGraphs.usable(ffn_model):
                server.expert_graphs = ExpertPassGraphs(
                    ffn_model, () if chained else DEFAULT_BATCH_BUCKETS, max_rows=job.spec.max_num_batched_tokens
                )
                server.expert_graphs.capture_all()
            announce_ffn_ready(world.store, job.role_rank)
            if job.serve_address is not None:
                stop_on_signals()  # a server's FFN rank ends when every replica shut down, also after a signal
            with profile_rank(job):
                run_ffn_loop(server, ffn_model)
            log.info("ffn rank %d: every attention rank shut down", job.role_rank)
