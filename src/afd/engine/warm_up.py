"""Compile the CUDA step's Triton kernels before any timed or served work.

Why: a Triton kernel compiles on its first call in a process (a second or more per kernel and tile
configuration, less once triton's on-disk cache holds it). Without a warm-up that lands in the first
request's time to first token, and on p2p it stalls every replica of the wave. Each side warms up alone:
the attention side answers its boundary layers with zeros (nothing crosses to the FFN side, so no FFN
rank takes the warm-up for a step) and the FFN side runs its experts on random rows. CPU has nothing to
compile and returns at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Protocol

import torch

from afd import kernels
from afd.connectors.base import Exchange
from afd.engine.engine import Engine, LocalExchange, launch_sampling
from afd.engine.sampling import SamplingParams
from afd.model.attention_side import AttentionModel, zero_exchange
from afd.model.batch import Batch
from afd.model.ffn_side import FFNModel
from afd.model.fp8 import warm_up_fp8_linears
from afd.model.moe import select_experts
from afd.routing import Routing

logger = logging.getLogger(__name__)

# Two fresh prompts (varlen prefill), then one batched decode step over both; three times, because Triton compiles
# a kernel again when an integer argument is a multiple of 16 (its "divisibility" specialization): lengths, token
# counts and batch sizes (2 and 16) of both kinds are compiled before timed or served work.
PROMPT_LENS = ((17, 5), (32, 16), (1,) * 16)
# every tile configuration of the MoE kernels, the grouped-GEMM path, token counts of both kinds; on CUDA also the
# counts that reach every compiled variant of the routed-experts kernels (`moe.warm_up_token_counts`: without them a
# fresh machine compiled the pair sort three times mid-run, at pair tiles these counts had not reached)
FFN_TOKEN_COUNTS = (1, 8, 17, 64, 256, 1000, 1024)
# Then one step of the engine's whole token budget. Why: cuBLAS and the grouped GEMM pick other kernels for a
# full prefill step than for the sizes above, and CUDA loads each kernel's module on its first use. Measured on
# an H200 (`AFD_TIMELINE`): the first 8,192-token prefill step of a fresh process took 170 ms more on
# its host before its first exchange than the steps after it.
FULL_STEP_PROMPT_LEN = 1024  # the budget step's prompts: long enough for the prefill kernels' long-query tiles
# Then each prompt set continues as a server's steps do: the first prompt's next chunk of this many tokens beside the
# others' decodes, then another chunk alone. Why: a prompt with cached context takes another path through each layer
# (its keys gathered from the cache, its queries gathered and scattered around the decodes), whose kernels then load
# before serving. (The key-length table's alignment, another cause of a mid-run prefill compile, is kept fixed in
# `MLAttention`.)
CONTINUE_TOKENS = 8


def budget_prompt_lens(budget: int, max_model_len: int, free_tokens: int, block_size: int) -> tuple[int, ...]:
    """Prompt lengths of one warm-up step that fills `budget` tokens as far as the model length and the cache's
    `free_tokens` allow (each prompt takes the blocks of its length plus one token); () when none fits."""
    length = min(FULL_STEP_PROMPT_LEN, max_model_len - 1, budget)
    if length < 1:
        return ()
    blocks_each = -(-(length + 1) // block_size)
    return (length,) * min(budget // length, free_tokens // (blocks_each * block_size))


def warm_up_engine(engine: Engine, *, force: bool = False) -> None:
    """One prefill and one batched decode through the attention model (and the in-process FFN model, when the
    exchange is the local one) on a few cache blocks that are handed back afterwards. CUDA only (`force`: tests)."""
    if engine.device.type != "cuda" and not force:
        return
    start = time.perf_counter()
    model, cache = engine.model, engine.kv_cache
    exchange: Exchange
    if isinstance(engine.exchange, LocalExchange):
        exchange = engine.exchange
    elif model.has_shared_experts:  # the connector runs them here: their GEMMs at every warm-up shape too
        exchange = SharedExpertsOnly(model)
    else:
        exchange = zero_exchange
    free_tokens = cache.pool.num_free * cache.block_size
    full_step = budget_prompt_lens(engine.max_num_batched_tokens, engine.max_model_len, free_tokens, cache.block_size)
    for lens in (*PROMPT_LENS, *((full_step,) if full_step else ())):
        extra = 2 * CONTINUE_TOKENS if lens is not full_step else 0
        slots = [cache.allocate(n + 1 + extra) for n in lens]
        try:
            with torch.inference_mode():
                positions = torch.cat([torch.arange(n) for n in lens]).to(engine.device)
                prefill = Batch(slots=slots, query_lens=list(lens), context_lens=[0] * len(slots))
                hidden = model(torch.zeros_like(positions), positions, prefill, cache, exchange)
                warm_up_sampling(model, hidden)
                decode = Batch(slots=slots, query_lens=[1] * len(slots), context_lens=list(lens), batch_decodes=True)
                last = torch.tensor(lens, device=engine.device)
                model(torch.zeros_like(last), last, decode, cache, exchange)
                if extra:
                    _continue_first_prompt(model, cache, exchange, slots, [n + 1 for n in lens], engine.device)
            if engine.device.type == "cuda":
                torch.cuda.synchronize(engine.device)
        finally:
            for slot in slots:
                cache.free(slot)
    if isinstance(exchange, LocalExchange):  # the whole model here: its experts at every shape a step can have
        budget = engine.max_num_batched_tokens
        warm_up_ffn(exchange.ffn_model, engine.device, max_num_batched_tokens=budget, force=force)
    with (
        torch.inference_mode()
    ):  # the prefill graphs of every token bucket (afd.engine.graphs.prefill): no capture mid-run
        # FP8 linears: every tile bucket of each shape (a decode bucket the steps above missed would compile mid-run)
        warm_up_fp8_linears(model, model.embed_tokens.weight.dtype, engine.max_num_batched_tokens)
        for runner in engine.prefill_graphs:
            runner.capture_all()
        if kernels.enabled(engine.device):
            warm_up_decode_kernels(model, cache)
        warm_up_decode_graphs(engine)  # after the kernels: the captures then compile nothing
    logger.info("warmed up the attention step (kernels compiled) in %.1f s", time.perf_counter() - start)


# what the decode graphs' captures leave free on the device: a capture starts only while more than this plus twice
# the largest growth of one capture so far is free (an out-of-memory capture would turn decode graphs off)
DECODE_GRAPH_RESERVE_BYTES = 1 << 30


def warm_up_decode_graphs(engine: Engine) -> int:
    """Capture the decode graph of every batch bucket up to `max_num_seqs` (one each: a graph serves every context,
    `afd.engine.graphs.decode`), smallest first, within the device memory the KV cache leaves
    (`DECODE_GRAPH_RESERVE_BYTES`); returns how many it captured. Nothing without decode graphs (CPU,
    `enforce_eager`)."""
    runner = engine.cuda_graphs
    if runner is None:
        return 0
    start = time.perf_counter()
    keys = runner.warm_up_keys()
    room = DeviceRoom(engine.device, DECODE_GRAPH_RESERVE_BYTES) if engine.device.type == "cuda" else None
    with torch.inference_mode():
        captured = runner.capture_keys(keys, room)
    logger.info(
        "captured %d of %d decode CUDA graphs (batch buckets %s) in %.1f s%s",
        captured,
        len(keys),
        keys,
        time.perf_counter() - start,
        "; out of device memory for the rest, captured on first use" if room is not None and room.full else "",
    )
    return captured


class DeviceRoom:
    """Whether the device has memory for one more graph capture: more than `reserve` bytes plus twice the largest
    growth of the process's reserved memory between two calls."""

    def __init__(self, device: torch.device, reserve: int) -> None:
        self.device, self.reserve = device, reserve
        self.last = torch.cuda.memory_reserved(device)
        self.growth, self.full = 0, False

    def __call__(self) -> bool:
        reserved = torch.cuda.memory_reserved(self.device)
        self.growth, self.last = max(self.growth, reserved - self.last), reserved
        free, _ = torch.cuda.mem_get_info(self.device)
        self.full = free < self.reserve + 2 * self.growth
        return not self.full


class SharedExpertsOnly(Exchange):
    """Answers a boundary with the attention model's own shared experts only: what a connector that runs them on
    this rank computes here, without crossing to the FFN side."""

    def __init__(self, model: AttentionModel) -> None:
        self.model = model

    def __call__(self, layer_idx: int, x: torch.Tensor, routing: Routing | None) -> torch.Tensor:
        """x: [T, H] -> the shared experts' output [T, H] model dtype."""
        return self.model.shared(layer_idx, x)


def _continue_first_prompt(
    model: AttentionModel, cache, exchange: Exchange, slots: list[int], cached: list[int], device: torch.device
) -> None:
    """Two steps after the decode: the first prompt's next chunk with the others' decodes, then a chunk alone."""
    n, first = CONTINUE_TOKENS, cached[0]
    query_lens = [n] + [1] * (len(slots) - 1)
    positions = torch.cat([torch.arange(c, c + q) for c, q in zip(cached, query_lens, strict=True)]).to(device)
    mixed = Batch(slots=slots, query_lens=query_lens, context_lens=list(cached))
    model(torch.zeros_like(positions), positions, mixed, cache, exchange)
    positions = torch.arange(first + n, first + 2 * n, device=device)
    alone = Batch(slots=slots[:1], query_lens=[n], context_lens=[first + n])
    model(torch.zeros_like(positions), positions, alone, cache, exchange)


def warm_up_decode_kernels(model: AttentionModel, cache) -> None:
    """Every compiled variant of the decode attention kernels for this model's heads (`mla_decode.warm_up`)."""
    from afd.kernels import mla_decode

    attention = model.layers[0].self_attn
    c, device = model.config, model.embed_tokens.weight.device
    dtype = model.embed_tokens.weight.dtype
    q_latent = torch.zeros(1, attention.num_heads, c.kv_lora_rank, dtype=dtype, device=device)
    q_pe = torch.zeros(1, attention.num_heads, c.qk_rope_head_dim, dtype=dtype, device=device)
    mla_decode.warm_up(q_latent, q_pe, cache.cache[attention.layer_idx], attention.softmax_scale)


# one greedy row and one that samples with every filter: the kernels of both paths
WARM_UP_SAMPLING = (None, SamplingParams(temperature=0.7, top_p=0.9, top_k=50, seed=0))


def warm_up_sampling(model: AttentionModel, hidden: torch.Tensor) -> None:
    """The sampling path after a forward: lm_head on a few rows, log-softmax, both samplers, the pinned copy to the
    host. Why: a fresh process's first step spent ~20 ms after its last exchange (a timeline of the step's tail:
    17.7 ms on the first step, 0.24 ms on later ones) loading these kernels and its first pinned buffer."""
    n = len(WARM_UP_SAMPLING)
    if hidden.shape[0] < n:
        return
    _, _, ready = launch_sampling(model, hidden[:n], list(WARM_UP_SAMPLING), [0] * n)
    if ready is not None:
        ready.synchronize()


def warm_up_ffn(
    ffn_model: FFNModel, device: torch.device, *, max_num_batched_tokens: int = 0, force: bool = False
) -> None:
    """Routed experts (both forms: by (token, k) pairs and grouped by expert), shared experts and a dense layer
    on random rows of every size class the kernels pick a tile configuration for, and of one full step
    (`max_num_batched_tokens`, when larger). CUDA only (`force`: tests)."""
    if device.type != "cuda" and not force:
        return
    start = time.perf_counter()
    config = ffn_model.config
    dtype = ffn_model.dtype  # the compute dtype (weights may be FP8)
    held = [i for i in range(config.num_hidden_layers) if str(i) in ffn_model.layers]
    moe = [i for i in held if config.is_moe_layer(i)][:1]  # one layer of each kind: kernels compile per shape
    dense = [i for i in held if not config.is_moe_layer(i)][:1]
    gen = torch.Generator(device=device).manual_seed(0)
    counts = set(FFN_TOKEN_COUNTS) | {max(max_num_batched_tokens, 1)}
    if kernels.enabled(device):
        from afd.kernels.fused_moe import warm_up_token_counts

        local = ffn_model.num_local_experts or config.n_routed_experts
        counts |= set(warm_up_token_counts(config.num_experts_per_tok, local, max(counts)))
    with torch.inference_mode():
        for num_tokens in sorted(counts):
            x = torch.randn(num_tokens, config.hidden_size, device=device, dtype=dtype, generator=gen) * 0.1
            for layer in dense:
                ffn_model(layer, x, None)
            for layer in moe:
                if not ffn_model.gate_on_attention:  # the router runs here: its kernel compiles too
                    ffn_model.route(layer, x)
                logits = torch.randn(num_tokens, config.n_routed_experts, device=device, generator=gen)
                routing = select_experts(logits, top_k=config.num_experts_per_tok)
                ffn_model(layer, x, routing)
                if ffn_model.num_local_experts:
                    offs = torch.full((ffn_model.num_local_experts,), num_tokens, dtype=torch.int32, device=device)
                    ffn_model.experts_offsets(layer, x, offs)
        warm_up_fp8_linears(ffn_model, dtype, max(counts))  # FP8 shared experts / dense MLPs: every tile bucket
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    logger.info("warmed up the FFN step (kernels compiled) in %.1f s", time.perf_counter() - start)


class WaveExchange(Protocol):
    """The part of the p2p attention exchange (`p2p.attention.P2pAttentionExchange`) a warm-up step uses."""

    gate_on_attention: bool

    def step_wave(self, has_work: bool, keep_alive: bool = False) -> bool: ...

    def begin_step(self, num_tokens: int, ubatch_tokens: Sequence[int] | None = None) -> None: ...

    def __call__(self, layer_idx: int, x: torch.Tensor, routing: Routing | None) -> torch.Tensor: ...


def warm_up_wave_exchange(exchange: WaveExchange, model: AttentionModel) -> None:
    """One step of one zero row through every boundary layer of a p2p exchange, before the first request, on every
    attention rank at once (the DP wave makes it one step of the FFN ranks too).

    Why: torch creates an NCCL communicator on a group's first operation, and on the GPU that took 569 ms inside the
    first send of a server's first request (`AFD_TIMELINE`). The row is zeros with expert 0 at weight 0: the FFN
    ranks compute it like any row, and nothing of it reaches a request."""
    start = time.perf_counter()
    config, device = model.config, model.embed_tokens.weight.device
    exchange.step_wave(True)
    exchange.begin_step(1)
    x = torch.zeros(1, config.hidden_size, dtype=model.embed_tokens.weight.dtype, device=device)
    routing = None
    if exchange.gate_on_attention:
        k = config.num_experts_per_tok
        routing = Routing(torch.zeros(1, k, dtype=torch.long, device=device), torch.zeros(1, k, device=device))
    with torch.inference_mode():
        for layer_idx in model.boundary_layers:
            exchange(layer_idx, x, routing)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    logger.info("warmed up the p2p exchange (communicators created) in %.2f s", time.perf_counter() - start)
