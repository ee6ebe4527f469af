"""One rank of a run: `afd worker`. Started by `afd launch` or `afd serve`, or by hand on any host.

An attention rank is an engine replica (its own requests, KV cache, prefill and decode) whose MoE
layers go through the connector; an FFN rank serves its expert shard until the attention side is
done. The connector decides the loop: `p2p` steps every replica in one DP wave, `async` lets each
replica run on its own while the FFN loop drives itself. A `replica` rank (connector `none`) is the
whole model in one process, the data-parallel baseline of a server.

A replica runs its prompts file to the end, or with `serve_address` serves a front end
(`afd.runtime.online`). This module holds the p2p ranks, the `none` replica and the entry; what every
rank shares is in `afd.runtime.rank`, the async ranks in `afd.runtime.async_rank`.
"""

from __future__ import annotations

import logging
import os

from afd.engine.warm_up import warm_up_ffn, warm_up_wave_exchange
from afd.runtime.online import run_online, stop_on_signals
from afd.runtime.rank import (  # noqa: F401 - RankJob and drive_replica are also imported from here
    RankJob,
    announce_ffn_ready,
    die_with_launcher,
    drive_replica,
    engine_for,
    ffn_dtype,
    local_replica_engine,
    profile_rank,
    select_device,
    wait_ffn_ready,
    world_options,
    write_outputs,
)
from afd.topology import SyncTopology, expert_ranges

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- p2p
def run_p2p_rank(job: RankJob) -> None:
    from afd.connectors.p2p.attention import P2pAttentionExchange
    from afd.connectors.p2p.ffn import P2pFFNLoop
    from afd.distributed.world import init_world
    from afd.engine.graphs.ffn import ExpertPassGraphs
    from afd.model.weights import load_attention_model, load_ffn_model, load_model_config, resolve_dtype

    cfg = job.config
    topo = SyncTopology(cfg.num_attention_ranks, cfg.num_ffn_ranks)
    world_rank = topo.world_rank(job.role, job.role_rank)
    device = select_device(job, world_rank)
    model_config = load_model_config(job.spec.model)
    gate_on_attention = cfg.compute_gate_on_attention
    num_ubatches = cfg.connector_extra_config.num_ubatches  # p2p_ubatching: both roles must agree
    world = init_world(
        cfg.host,
        cfg.port,
        world_rank,
        topo.world_size,
        job.backend,
        job.timeout_s,
        num_attention=cfg.num_attention_ranks,
        num_ffn=cfg.num_ffn_ranks,
        dtype=job.spec.dtype if job.role == "attention" else None,
        **world_options(job),
    )
    with world.session():
        dtype = job.spec.dtype if job.role == "attention" else ffn_dtype(job, world)  # before loading
        common = dict(dtype=dtype, device=device, gate_on_attention=gate_on_attention, seed=job.spec.seed)
        common["quantization"] = job.spec.quantization
        if job.role == "attention":
            model = load_attention_model(job.spec.model, **common)
            exchange = P2pAttentionExchange(
                world,
                topo,
                gate_on_attention=gate_on_attention,
                topk=model_config.num_experts_per_tok,
                boundary_layers=model.boundary_layers,
                num_ubatches=num_ubatches,
            )
            engine = engine_for(job, model, exchange)
            wait_ffn_ready(world.store, cfg.num_ffn_ranks, job.timeout_s)  # their start-up is not the first TTFT
            warm_up_wave_exchange(exchange, model)  # NCCL communicators are created now, not in the first request
            if job.serve_address is not None:
                run_online(engine, job, wave=exchange)
            else:
                outputs, stats = drive_replica(engine, job, exchange.step_wave)
                write_outputs(job, outputs, stats)
                if num_ubatches > 1:
                    log.info(
                        "attention rank %d: %d of %d steps ran as micro-batches",
                        job.role_rank,
                        engine.ubatched_steps,
                        stats.num_steps,
                    )
        else:
            experts = expert_ranges(model_config.n_routed_experts, cfg.num_ffn_ranks)[job.role_rank]
            ffn_model = load_ffn_model(job.spec.model, expert_range=experts, **common)
            warm_up_ffn(ffn_model, device, max_num_batched_tokens=job.spec.max_num_batched_tokens)  # before any item
            graphs = None  # one FFN rank: its MoE replays from CUDA graphs up to the budget (several: all-to-all)
            if cfg.num_ffn_ranks == 1 and ExpertPassGraphs.usable(ffn_model):
                graphs = ExpertPassGraphs(ffn_model, max_rows=job.spec.max_num_batched_tokens)
                graphs.capture_all()
            boundary = list(range(model_config.num_hidden_layers)) if not gate_on_attention else model_config.moe_layers
            dense = [i for i in boundary if not model_config.is_moe_layer(i)]
            loop = P2pFFNLoop(
                world,
                topo,
                ffn_model,
                num_experts=model_config.n_routed_experts,
                topk=model_config.num_experts_per_tok,
                hidden_size=model_config.hidden_size,
                dtype=resolve_dtype(dtype),
                boundary_layers=boundary,
                gate_on_attention=gate_on_attention,
                dense_layers=dense,
                num_ubatches=num_ubatches,
                expert_graphs=graphs,
            )
            announce_ffn_ready(world.store, job.role_rank)
            if job.serve_address is not None:
                stop_on_signals()  # a server's FFN rank ends with the wave, also after a stop signal
            with profile_rank(job):
                steps = loop.run()
            log.info("ffn rank %d served %d steps", job.role_rank, steps)


# ---------------------------------------------------------------- none
def run_local_replica(job: RankJob) -> None:
    """A whole-model replica in one process (attention model + FFN model + `LocalExchange`, as the reference
    engine is built; decode CUDA graphs on CUDA): no world, no connector."""
    engine = local_replica_engine(job)
    if job.serve_address is not None:
        run_online(engine, job)
    else:
        outputs, stats = drive_replica(engine, job, lambda has_work: has_work)
        write_outputs(job, outputs, stats)


# ---------------------------------------------------------------- entry
def run_rank(job: RankJob) -> int:
    """Run one rank; exit status 0 on a normal end. Leaves through os._exit to skip a gloo teardown hang."""
    die_with_launcher(job.launcher_pid)
    if job.role == "replica":
        run_local_replica(job)
    elif job.config.connector == "p2p":
        run_p2p_rank(job)
    else:
        from afd.runtime.async_rank import run_async_rank

        run_async_rank(job)
    return 0


def exit_now(code: int) -> None:
    """Flush and leave without interpreter teardown (pending gloo work can block it until a timeout)."""
    logging.shutdown()
    os._exit(code)
