"""Single-process reference engine: scheduler, MLA KV cache, sampling (greedy by default), around an `exchange`.

One step = schedule -> `exchange.begin_step(T)` (if present) -> forward of the flattened batch ->
sample -> post-process. The exchange is the only way to the FFN side, so the same engine drives the
local reference (`LocalExchange`) and every disaggregated connector. An exchange with `num_ubatches` > 1
(async or p2p micro-batching) gets the forward as that many micro-batches in ping-pong (`attention_side.run_ubatches`).

Chunked prefill: a step is the running decodes (one token each, first) plus prompt chunks that fill
what is left of `max_num_batched_tokens`, so a long prompt never stalls the decodes and no step is ever
larger than the budget (the async window is sized by it). A chunk after the first reads the earlier
chunks through the paged cache; only the chunk that ends a prompt is sampled.

Overlapped steps ("async scheduling", `overlap_steps`): the host's work between two steps (reading the
sampled tokens, bookkeeping, scheduling, building the next step's metadata, launching it) would leave
the GPU idle. So a pure decode step is left in flight: the next `step()` launches its successor first,
with the input ids gathered on the device from the tokens the step in flight sampled, and only then
waits for those tokens and does their bookkeeping while the GPU runs the successor.
"""

from __future__ import annotations

import logging
from collections import deque

import torch

from afd import env
from afd.connectors.base import Exchange
from afd.engine.graphs.decode import DecodeGraphRunner, capture_safe_moe
from afd.engine.graphs.prefill import PrefillGraphRunner, graph_memory_estimate
from afd.engine.request import EngineLoad, Output, Request, StepToken
from afd.engine.sampling import sample
from afd.engine.sequence import ON_DEVICE, LaunchedStep, Scheduled, SequenceState
from afd.model.attention_side import AttentionModel, Segments, run_segments, run_ubatches, split_ubatches
from afd.model.batch import Batch
from afd.model.ffn_side import FFNModel
from afd.model.kv_cache import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    PagedLatentCache,
    activation_bytes_estimate,
    blocks_needed,
    device_memory,
    latent_bytes_per_token,
    num_cache_blocks,
)
from afd.routing import Routing

logger = logging.getLogger(__name__)


class LocalExchange(Exchange):
    """The reference exchange: the MLP of a boundary layer runs on an in-process FFNModel."""

    def __init__(self, ffn_model: FFNModel) -> None:
        self.ffn_model = ffn_model

    def __call__(self, layer_idx: int, x: torch.Tensor, routing: Routing | None) -> torch.Tensor:
        """x: [T, H] model dtype, routing or None (gate on the FFN side) -> the MoE output [T, H] model dtype."""
        return self.ffn_model(layer_idx, x, routing)


def launch_sampling(
    model: AttentionModel, hidden: torch.Tensor, sampling: list, positions: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.cuda.Event | None]:
    """Sample one token per row of `hidden [B, H]` (`sampling[i]`: SamplingParams or None for greedy) and start
    copying `[token, its logprob]` to the host: (tokens [B] on the device, the host buffer [2, B] float64, the event
    that says the copy landed; None on CPU, where the copy is done)."""
    logprobs = torch.log_softmax(model.compute_logits(hidden), dim=-1)  # [B, V] fp32
    tokens = sample(logprobs, sampling, positions)  # [B]; greedy rows: logprobs.argmax
    picked = logprobs.gather(1, tokens[:, None]).squeeze(1)  # [B]
    both = torch.stack([tokens.double(), picked.double()])  # [2, B]
    cuda = both.is_cuda
    host = torch.empty(both.shape, dtype=both.dtype, pin_memory=cuda)
    host.copy_(both, non_blocking=cuda)
    ready = None
    if cuda:  # queued before any later step, so reading it never waits for one
        ready = torch.cuda.Event()
        ready.record()
    return tokens, host, ready


class Engine:
    """Continuous batching with chunked prefill over one `AttentionModel` and an `exchange` to the FFN side.

    `max_num_batched_tokens` is the token budget of one step, as in vLLM: prompts longer than it (or than
    what the decodes leave of it) are prefilled over several steps.

    The MLA cache is one paged pool (`afd.model.kv_cache`), sized once here: `num_blocks` if given, else
    `max_cache_tokens` tokens, else on CUDA `gpu_memory_utilization` of the GPU's memory less the weights
    and the activation peak, else (CPU) a 4 GiB budget; never more than `max_num_seqs` sequences of
    `max_model_len` tokens could use. A request reserves its blocks at admission; while the pool is full,
    new requests wait in the queue.

    `overlap_steps` (None: on with CUDA and the in-process `LocalExchange` unless `enforce_eager`): leave
    a pure decode step in flight and launch the next one before reading its tokens
    (module docstring). `step()` then returns the requests the previous step finished, and
    `last_step_tokens` are that step's, one call later than without overlap. Off by default with a
    disaggregated exchange: its forward already waits on the host at every exchange, and the p2p DP wave
    announces each step's token count before it runs. An explicit True also works on CPU (the tests compare
    it with False there), where it gains nothing.
    """

    def __init__(
        self,
        model: AttentionModel,
        exchange: Exchange,
        max_num_batched_tokens: int = 8192,
        *,
        max_num_seqs: int = 256,
        max_cache_tokens: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        num_blocks: int | None = None,
        gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
        max_model_len: int | None = None,
        enforce_eager: bool = False,
        overlap_steps: bool | None = None,
    ) -> None:
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be at least 1")
        if num_blocks is not None and num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.model, self.exchange = model, exchange
        self.max_num_batched_tokens, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        self.max_cache_tokens = max_cache_tokens
        self.device = model.embed_tokens.weight.device
        dtype = model.embed_tokens.weight.dtype
        config = model.config
        max_model_len = max_model_len or config.max_position_embeddings
        self.max_model_len = max_model_len
        if num_blocks is None:
            cuda = self.device.type == "cuda"
            num_blocks = num_cache_blocks(
                block_size=block_size,
                bytes_per_token=latent_bytes_per_token(config, dtype),
                max_useful_tokens=max_num_seqs * max_model_len,
                max_cache_tokens=max_cache_tokens,
                memory=device_memory(self.device) if cuda and max_cache_tokens is None else None,
                gpu_memory_utilization=gpu_memory_utilization,
                activation_bytes=(
                    activation_bytes_estimate(config, dtype, max_num_batched_tokens)
                    + self._prefill_graph_copies(enforce_eager)
                    * graph_memory_estimate(config, dtype, max_num_batched_tokens)
                    if cuda
                    else 0
                ),
            )
        self.kv_cache = PagedLatentCache(
            config,
            num_blocks=num_blocks,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            dtype=dtype,
            device=self.device,
            max_blocks_per_seq=blocks_needed(max_model_len, block_size),
        )
        logger.info("KV cache: %s", self.kv_cache.describe())
        # Decode steps replay CUDA graphs (graphs.decode) on CUDA: one per step with the in-process exchange, one
        # per piece between exchanges with a disaggregated one (it crosses processes at every boundary layer and
        # runs eagerly between replays); `enforce_eager` turns graphs off.
        self.cuda_graphs: DecodeGraphRunner | None = None
        if not enforce_eager and self.device.type == "cuda":
            local = isinstance(exchange, LocalExchange)
            if local and not capture_safe_moe(exchange.ffn_model):
                logger.info("decode CUDA graphs off: the routed experts of %s have no fixed-shape path", dtype)
            else:
                whole = local or exchange.capturable  # the async 1A1F exchange captures whole
                self.cuda_graphs = DecodeGraphRunner(model, exchange, self.kv_cache, max_num_seqs, segmented=not whole)
                logger.info(
                    "decode CUDA graphs on (%s), batch buckets %s",
                    "whole step" + ("" if local else ", exchanges included") if whole else "pieces between exchanges",
                    self.cuda_graphs.buckets,
                )
        # Steps with prompt tokens (or more decodes than a decode graph holds) replay their row-wise pieces from CUDA
        # graphs at padded token counts, the attention core and the exchanges eagerly between them
        # (afd.engine.graphs.prefill); one runner per micro-batch, as micro-batches in flight need their own buffers.
        self.prefill_graphs = [
            PrefillGraphRunner(model, self.kv_cache, max_num_batched_tokens)
            for _ in range(self._prefill_graph_copies(enforce_eager))
        ]
        if self.prefill_graphs:
            logger.info("prefill CUDA graphs on, token buckets %s", self.prefill_graphs[0].buckets)
        self.waiting: deque[SequenceState] = deque()
        self.running: list[SequenceState] = []
        self._live: dict[int, SequenceState] = {}  # request id -> its sequence, waiting or running
        self.cache_tokens_used = 0  # tokens reserved by running sequences (their capacities)
        self._next_id = 0
        self.last_step_tokens: list[StepToken] = []  # every token the last step appended, in batch order
        self.ubatched_steps = 0  # steps run as micro-batches in ping-pong
        self.last_launch_decode = False  # whether the step launched last was all single-token decodes
        if overlap_steps is None:
            overlap_steps = self.device.type == "cuda" and isinstance(exchange, LocalExchange) and not enforce_eager
        if overlap_steps and self.num_ubatches > 1:
            raise ValueError("overlap_steps cannot be combined with micro-batches (async_moe_ubatching); turn one off")
        self.overlap_steps = overlap_steps
        self._in_flight: LaunchedStep | None = None  # a pure decode step launched, its tokens not read yet
        self.overlapped_steps = 0  # steps launched before the tokens of the step before them were read

    # --- requests ---

    def validate(self, request: Request) -> None:
        vocab = self.model.config.vocab_size
        if not request.prompt_ids:
            raise ValueError("a prompt is empty; every prompt needs at least one token id")
        bad = [t for t in request.prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if request.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {request.max_new_tokens}")
        cache = self.kv_cache
        tokens = SequenceState(-1, request).capacity
        if cache.blocks_for(tokens) > cache.num_blocks:
            raise ValueError(
                f"a request of {len(request.prompt_ids)} prompt tokens and {request.max_new_tokens} new tokens "
                f"needs {cache.blocks_for(tokens)} KV-cache blocks of {cache.block_size} tokens ({tokens} tokens) "
                f"but the whole cache holds {cache.num_blocks} blocks ({cache.num_tokens} tokens); shorten it, "
                "lower max_new_tokens or give the cache more memory"
            )

    def add(self, request: Request) -> int:
        """Queue a request; returns its id (carried by its Output)."""
        self.validate(request)
        seq = SequenceState(self._next_id, request, stop_ids=frozenset(int(t) for t in request.stop_token_ids))
        self._next_id += 1
        self.waiting.append(seq)
        self._live[seq.request_id] = seq
        return seq.request_id

    def abort(self, request_id: int) -> Output | None:
        """Stop a waiting or running request now and free its cache blocks; its Output (reason "abort")
        holds what it generated so far: not the token of a step still in flight, which is dropped when that
        step is finalized. An unknown or finished id is a no-op (None): a client's abort may cross its
        request's end."""
        seq = self._live.get(request_id)
        if seq is None:
            return None
        if seq in self.running:
            return self._finish(seq, "abort")
        self.waiting.remove(seq)
        return self._output(seq, "abort")

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._in_flight)

    @property
    def step_in_flight(self) -> bool:
        """Whether a step was launched whose tokens the host has not read yet (`overlap_steps`)."""
        return self._in_flight is not None

    def load(self) -> EngineLoad:
        pool = self.kv_cache.pool
        return EngineLoad(len(self.running), len(self.waiting), 1.0 - pool.num_free / pool.num_blocks)

    # --- scheduling and cache bookkeeping ---

    def can_allocate(self, seq: SequenceState) -> bool:
        return self.kv_cache.can_allocate(seq.capacity)

    def allocate(self, seq: SequenceState) -> None:
        seq.slot = self.kv_cache.allocate(seq.capacity)
        self.cache_tokens_used += seq.capacity

    def free(self, seq: SequenceState) -> None:
        self.kv_cache.free(seq.slot)
        self.cache_tokens_used -= seq.capacity

    def schedule(self) -> list[Scheduled]:
        """One decode token per running sequence that finished its prompt, then the next chunk of every
        running prompt, then new prompts, while the token budget and the free cache blocks last. A chunk
        is the rest of its prompt or the rest of the budget, whichever is smaller. The queue is first
        come, first served: when its head does not fit the cache, it waits."""
        budget = self.max_num_batched_tokens
        out = [Scheduled(seq, seq.token_ids[-1:], seq.num_cached) for seq in self.running if not seq.prefilling]
        out = out[:budget]
        budget -= len(out)
        for seq in self.running:
            if budget == 0:
                break
            if seq.prefilling:
                out.append(self._chunk(seq, budget))
                budget -= len(out[-1].input_ids)
        while budget > 0 and self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self.can_allocate(seq):
                break
            self.waiting.popleft()
            self.allocate(seq)
            self.running.append(seq)
            out.append(self._chunk(seq, budget))
            budget -= len(out[-1].input_ids)
        return out

    @staticmethod
    def _chunk(seq: SequenceState, budget: int) -> Scheduled:
        """The next `budget` (at most) uncached prompt tokens of `seq`."""
        start = seq.num_cached
        return Scheduled(seq, list(seq.request.prompt_ids[start : start + budget]), start)

    # --- the step ---

    @torch.inference_mode()
    def step(self) -> list[Output]:
        """Run one step; returns the requests that finished.

        Host->device: one copy (token ids, positions, sampled rows and the cache metadata together);
        device->host: one copy of the sampled tokens and their logprobs. With `overlap_steps`:
        1. a step in flight whose successor is known (`_follow`): launch the successor, then finalize the
           step in flight (read its tokens, append, finish); the successor stays in flight;
        2. a step in flight otherwise: finalize it, launch nothing (the next call schedules);
        3. nothing in flight: schedule and launch; a pure decode step stays in flight (returns []), any
           other step is finalized at once.
        """
        flight, self._in_flight = self._in_flight, None
        if flight is not None:
            follow = self._follow(flight)
            if follow is not None:
                self._in_flight = self._launch(*follow)
                self.overlapped_steps += 1
            return self._finalize(flight)
        scheduled = self.schedule()
        if not scheduled:
            return self._idle_step()
        launched = self._launch(scheduled)
        if self.overlap_steps and all(s.is_decode for s in scheduled):
            self._in_flight = launched
            self.last_step_tokens = []
            return []
        return self._finalize(launched)

    @torch.inference_mode()
    def drain(self) -> list[Output]:
        """Finalize the step in flight, if any, without launching another; returns the requests it finished."""
        flight, self._in_flight = self._in_flight, None
        return self._finalize(flight) if flight is not None else []

    def _follow(self, flight: LaunchedStep) -> tuple[list[Scheduled], LaunchedStep, list[int]] | None:
        """The step `schedule()` will pick once `flight`'s tokens are in, when the host can know it now; as
        `_launch`'s arguments: the decodes, `flight`, and each decode's row of `flight`'s sampled tokens.

        Known when `flight` (a pure decode step) held every running sequence and no queued request could
        be admitted after it: then the next step is the decodes of the sequences that do not end by length
        in `flight`. A stop token is not known yet: such a sequence is decoded once more in vain (its row
        is skipped in `_finalize`), the price of overlapping. Exactly `schedule()`'s choice when no
        sequence of `flight` stops.
        """
        if not self.overlap_steps:
            return None
        live = [(row, s) for row, s in enumerate(flight.sampled) if self._live.get(s.seq.request_id) is s.seq]
        if len(live) != len(self.running):  # a running sequence the step did not hold (budget-capped decodes)
            return None
        cont, ending = [], []  # (row, decode): sequences that go on after `flight`, and those it ends by length
        for row, s in live:
            (cont if len(s.seq.token_ids) + 1 < s.seq.request.max_new_tokens else ending).append((row, s))
        if not cont:
            return None
        if self.waiting and len(cont) < min(self.max_num_seqs, self.max_num_batched_tokens):
            cache = self.kv_cache
            freed = sum(cache.blocks_for(s.seq.capacity) for _, s in ending)
            if cache.blocks_for(self.waiting[0].capacity) <= cache.pool.num_free + freed:
                return None  # the queue's head is admitted after `flight`: schedule normally
        # Cache safety. A sequence that stops (or is aborted) in `flight` has its blocks freed on the host by
        # `_finalize(flight)` while this step, already queued on the same stream, may still write its row. Every
        # later use of those blocks (another sequence's writes and reads, a block-table row) is launched after this
        # step on that stream, so it is ordered after that write. The row is inside the sequence's reservation: a
        # sequence goes on only if it holds j < max_new_tokens tokens after `flight`, and this step feeds its j-th
        # token at position prompt + j - 1 <= prompt + max_new_tokens - 2, below its capacity (`SequenceState.capacity`)
        # of prompt + max_new_tokens - 1 rows (`prepare` checks it too, before the blocks are freed).
        decodes = [Scheduled(s.seq, [ON_DEVICE], s.start + 1) for _, s in cont]
        return decodes, flight, [row for row, _ in cont]

    def _launch(
        self, scheduled: list[Scheduled], after: LaunchedStep | None = None, after_rows: list[int] | None = None
    ) -> LaunchedStep:
        """Queue the forward and the sampling of `scheduled` on the device. `after`: the step in flight whose
        sampled tokens (rows `after_rows`) are this all-decode step's input ids."""
        timeline = self.exchange.timeline  # AFD_TIMELINE (afd.profiling.timeline): the step's ends
        if timeline is not None:
            timeline.mark("launch", on_device=False)
        query_lens = [len(s.input_ids) for s in scheduled]
        context_lens = [s.start for s in scheduled]
        # Only pure decode steps replay a graph; a step with a prompt chunk (even a one-token one) runs eager.
        pure_decode = all(s.is_decode for s in scheduled)
        self.last_launch_decode = pure_decode
        graphs = (
            self.cuda_graphs
            if self.cuda_graphs and pure_decode and self.cuda_graphs.handles(query_lens, context_lens)
            else None
        )
        batch = Batch(
            slots=[s.seq.slot for s in scheduled],
            query_lens=query_lens,
            context_lens=context_lens,
            batch_decodes=graphs is not None,
        )
        # launched ahead: the host sends the rows of `after`'s sampled tokens, gathered below on the device
        input_ids = after_rows if after is not None else [t for s in scheduled for t in s.input_ids]
        positions = [s.start + i for s in scheduled for i in range(len(s.input_ids))]
        last_rows = [  # the rows sampled: decodes and the last row of every chunk that ends its prompt
            start + n - 1 for s, start, n in zip(scheduled, batch.starts, query_lens, strict=True) if s.samples
        ]
        # A graphed step stays whole: its graphs hold one static batch, and micro-batches in flight at once
        # would each need their own buffers.
        ubatches = split_ubatches(query_lens, self.num_ubatches) if graphs is None else []
        if len(ubatches) > 1:
            hidden, last = self._forward_ubatches(batch, ubatches, input_ids, positions, last_rows)  # [T, H]
            return self._sample(scheduled, batch, hidden, last)
        ids, pos, last = self.kv_cache.prepare(
            batch, *(torch.tensor(v, dtype=torch.long) for v in (input_ids, positions, last_rows))
        )
        if after is not None:
            ids = after.tokens.index_select(0, ids)  # [T]: the tokens the step in flight sampled, never on the host
        self.exchange.begin_step(len(positions))
        hidden = graphs.forward(batch, ids, pos) if graphs is not None else None  # [T, H] replayed
        if hidden is None:
            hidden = run_segments(self._segments(0, batch, ids, pos), self.exchange)  # [T, H]
        return self._sample(scheduled, batch, hidden, last)

    def _segments(self, ubatch: int, batch: Batch, input_ids: torch.Tensor, positions: torch.Tensor) -> Segments:
        """The forward of a prepared (micro-)batch as `forward_segments`: replayed from micro-batch `ubatch`'s prefill
        graphs where they hold its token count, else eager."""
        runner = self.prefill_graphs[ubatch] if ubatch < len(self.prefill_graphs) else None
        if runner is not None and runner.handles(input_ids.shape[0]):
            segments = runner.segments(batch, input_ids, positions)
            if segments is not None:
                return segments
        return self.model.forward_segments(input_ids, positions, batch, self.kv_cache)

    def _prefill_graph_copies(self, enforce_eager: bool) -> int:
        """Prefill graph runners this engine holds: one per micro-batch on CUDA, none when eager or on CPU."""
        if enforce_eager or self.device.type != "cuda" or env.prefill_graphs_disabled():
            return 0
        return self.num_ubatches

    @property
    def num_ubatches(self) -> int:
        """Micro-batches a step is split into: the exchange's (`async_moe_ubatching`, `p2p_ubatching`), else 1. An
        exchange with more than one must have `send`/`recv` (`afd.model.attention_side.SendRecv`); a split step calls
        `begin_step(T, tokens per micro-batch)` where the exchange has one (p2p: the FFN ranks must know them)."""
        return self.exchange.num_ubatches

    def _forward_ubatches(
        self, batch: Batch, ubatches: list[range], input_ids: list[int], positions: list[int], last_rows: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's forward as micro-batches of consecutive sequences in ping-pong (`run_ubatches`): the
        attention of one overlaps the FFN work and transfers of the others. Returns the hidden states [T, H]
        in the step's row order and the sampled rows [B] on the device (they travel with the first
        micro-batch's metadata: one host->device copy per micro-batch)."""
        segments = []
        last: torch.Tensor | None = None
        starts = [*batch.starts, batch.num_tokens]
        for group in ubatches:
            part = Batch(
                slots=batch.slots[group.start : group.stop],
                query_lens=batch.query_lens[group.start : group.stop],
                context_lens=batch.context_lens[group.start : group.stop],
            )
            rows = slice(starts[group.start], starts[group.stop])
            host = [torch.tensor(v, dtype=torch.long) for v in (input_ids[rows], positions[rows])]
            if last is None:
                host.append(torch.tensor(last_rows, dtype=torch.long))
            ids, pos, *sampled = self.kv_cache.prepare(part, *host)
            last = sampled[0] if sampled else last
            segments.append(self._segments(len(segments), part, ids, pos))
        # p2p: the control plane announces every micro-batch's rows
        self.exchange.begin_step(batch.num_tokens, [starts[g.stop] - starts[g.start] for g in ubatches])
        self.ubatched_steps += 1
        return torch.cat(run_ubatches(segments, self.exchange)), last

    def _idle_step(self) -> list[Output]:
        """Nothing scheduled: what a zero-token forward shows the exchange — `begin_step(0)`, then every boundary
        layer with `[0, H]` rows (the p2p DP wave needs each layer from every replica) — without the forward
        itself, whose Python cost (~4 ms of CPU on tiny) an idle p2p server would pay on every wave."""
        model = self.model
        self.exchange.begin_step(0)
        x = torch.empty(0, model.config.hidden_size, dtype=model.dtype, device=self.device)  # [0, H]
        routing = None
        if model.gate_on_attention:
            k = model.config.num_experts_per_tok
            ids = torch.empty(0, k, dtype=torch.long, device=self.device)  # [0, K]
            routing = Routing(ids, torch.empty(0, k, dtype=torch.float32, device=self.device))
        for layer_idx in model.boundary_layers:
            self.exchange(layer_idx, x, routing)
        self.last_step_tokens = []
        return []

    def _sample(
        self, scheduled: list[Scheduled], batch: Batch, hidden: torch.Tensor, last_rows: torch.Tensor
    ) -> LaunchedStep:
        """Sample every sequence that ends its prompt or decodes, at once: one lm_head call, and one
        device->host copy started (read in `_finalize`); a chunk in the middle of a prompt is only cached
        (and scored, which reads its scores at once: such a step is never left in flight)."""
        sampled = [s for s in scheduled if s.samples]
        tokens = host = ready = None
        if sampled:
            sampling = [s.seq.request.sampling for s in sampled]
            # the index of the token each row samples, from the schedule: a decode launched ahead has not
            # appended its input token on the host yet
            positions = [s.start + len(s.input_ids) for s in sampled]
            tokens, host, ready = launch_sampling(self.model, hidden[last_rows], sampling, positions)
        for s, first, n in zip(scheduled, batch.starts, batch.query_lens, strict=True):
            prompt = s.seq.request.prompt_ids
            if s.is_decode or not s.seq.request.prompt_logprobs:
                continue  # prompt scoring is rare: its own lm_head call over the chunk
            if s.start == 0:
                s.seq.prompt_logprobs = [None]
            scored = min(n, len(prompt) - 1 - s.start)  # rows whose next token is still a prompt token
            if scored > 0:
                rows = torch.log_softmax(self.model.compute_logits(hidden[first : first + scored]), dim=-1)
                targets = torch.tensor(prompt[s.start + 1 : s.start + 1 + scored], device=rows.device)
                s.seq.prompt_logprobs += rows.gather(1, targets[:, None]).squeeze(1).tolist()
        return LaunchedStep(scheduled, sampled, tokens, host, ready)

    def _finalize(self, step: LaunchedStep) -> list[Output]:
        """Read a launched step's tokens (waiting for its copy only) and do its bookkeeping: append, finish
        by stop token or length, free. A sequence that ended while the step was in flight (a stop token in
        the step before, or an abort) is skipped: its row was computed in vain."""
        if step.ready is not None:
            step.ready.synchronize()
        timeline = self.exchange.timeline
        if timeline is not None:
            timeline.mark("tokens", on_device=False)
        tokens, token_logprobs = step.host.tolist() if step.host is not None else ([], [])
        for s in step.scheduled:
            s.seq.num_cached = s.start + len(s.input_ids)
        finished = []
        appended = []
        for s, token, logprob in zip(step.sampled, tokens, token_logprobs, strict=True):
            seq = s.seq
            if self._live.get(seq.request_id) is not seq:
                continue
            token = int(token)
            if len(seq.token_ids) < seq.request.max_new_tokens:
                seq.token_ids.append(token)
                seq.logprobs.append(float(logprob))
                appended.append(StepToken(seq.request_id, token, float(logprob)))
                if token in seq.stop_ids:
                    finished.append(self._finish(seq, "stop"))
                    continue
            if len(seq.token_ids) >= seq.request.max_new_tokens:
                finished.append(self._finish(seq, "length"))
        self.last_step_tokens = appended
        return finished

    def _finish(self, seq: SequenceState, reason: str) -> Output:
        self.running.remove(seq)
        self.free(seq)
        return self._output(seq, reason)

    def _output(self, seq: SequenceState, reason: str) -> Output:
        del self._live[seq.request_id]
        return Output(
            prompt_ids=list(seq.request.prompt_ids),
            token_ids=seq.token_ids,
            logprobs=seq.logprobs,
            prompt_logprobs=seq.prompt_logprobs if seq.request.prompt_logprobs else None,
            request_id=seq.request_id,
            finish_reason=reason,
        )

    def run(self) -> list[Output]:
        """Step until every queued request finished; outputs in request-id order."""
        outputs: dict[int, Output] = {}
        while self.has_work():
            for out in self.step():
                outputs[out.request_id] = out
        return [outputs[k] for k in sorted(outputs)]
