"""From a scheduled step to sampled tokens: tensors, the forward through the exchange, CUDA graphs, sampling.

One launch = prepare the step's device metadata (one host->device copy) -> `exchange.begin_step(T)` -> the forward
of the flattened batch (replayed from a decode graph, from prefill graphs, or eager; as micro-batches in ping-pong
when the exchange has `num_ubatches` > 1) -> sample and start the device->host copy of the tokens. The tokens are
read later (`read_tokens`), so the engine may launch the next step before it waits for them (overlapped steps).
"""

from __future__ import annotations

import logging
import time
from collections import deque

import torch

from afd.connectors.base import Exchange
from afd.engine.graphs.decode import DecodeGraphRunner, capture_safe_moe
from afd.engine.graphs.prefill import PrefillGraphRunner, graph_memory_estimate
from afd.engine.sampling import sample
from afd.engine.sequence import ON_DEVICE, LaunchedStep, Scheduled
from afd.model.attention_side import AttentionModel, Segments, run_segments, run_ubatches, split_ubatches
from afd.model.batch import Batch
from afd.model.config import ModelConfig
from afd.model.ffn_side import FFNModel
from afd.model.kv_cache import PagedLatentCache, activation_bytes_estimate
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
        ready = torch.cuda.Event(enable_timing=True)  # also the end of the step (`StepClock`)
        ready.record()
    return tokens, host, ready


class StepClock:
    """The device time of every launched step, for comparing a served run's wall time with the steps it ran: two
    CUDA events around each step's work on the stream (from the first copy of its inputs to its sampling), read
    once both have passed, without waiting. A step's time includes any pause of the host inside it; what lies
    between two steps does not. `seconds` and `steps` count the steps read so far (nothing on CPU); `prompt_*`
    the part of them that held a prompt token (prefill or mixed steps).

    Beside it, the host's time per step, from the start of its scheduling (`scheduling`) to its work queued
    (`stop`), on every device; and on CUDA the device's idle time before each step that follows another with work
    left (`idle_seconds`; `idle_ahead_seconds` the part before steps launched ahead, where only a host slower than
    the device leaves a gap; `idle_prompt_seconds` the part before steps holding prompt tokens). A replica waiting
    for requests is not idle in this sense: a step after an empty engine counts no gap."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.seconds, self.steps = 0.0, 0
        self.prompt_seconds, self.prompt_steps = 0.0, 0
        self.host_seconds, self.host_steps = 0.0, 0
        self.prompt_host_seconds, self.prompt_host_steps = 0.0, 0
        self.idle_seconds, self.idle_ahead_seconds, self.idle_prompt_seconds = 0.0, 0.0, 0.0
        # per step queued: its start and end events, whether it holds prompt tokens, follows a step, was launched ahead
        self._pending: deque[tuple[torch.cuda.Event, torch.cuda.Event, bool, bool, bool]] = deque()
        self._started: torch.cuda.Event | None = None
        self._host_started: float | None = None
        self._follows = self._ahead = False
        self._last_ended: torch.cuda.Event | None = None

    def scheduling(self, follows: bool = False) -> None:
        """The host starts scheduling the next step; `follows`: the engine had work left after its last step."""
        self._host_started = time.perf_counter()
        self._follows = follows

    def start(self, ahead: bool = False) -> None:
        """The step's inputs are about to be queued; `ahead`: launched before its predecessor's tokens were read."""
        if self._host_started is None:
            self._host_started = time.perf_counter()
        self._ahead = ahead
        if self.cuda:
            self._started = torch.cuda.Event(enable_timing=True)
            self._started.record()

    def stop(self, ended: torch.cuda.Event | None = None, *, with_prompt: bool = False) -> None:
        """The step's work is queued; `ended`: an event just recorded after it (timing enabled), if any."""
        if self._host_started is not None:
            host = time.perf_counter() - self._host_started
            self.host_seconds += host
            self.host_steps += 1
            if with_prompt:
                self.prompt_host_seconds += host
                self.prompt_host_steps += 1
            self._host_started = None
        if self._started is not None:
            if ended is None:
                ended = torch.cuda.Event(enable_timing=True)
                ended.record()
            self._pending.append((self._started, ended, with_prompt, self._follows, self._ahead))
            self._started = None
        self._follows = self._ahead = False

    def collect(self) -> None:
        """Add the steps whose end the device has passed (in launch order)."""
        while self._pending and self._pending[0][1].query():
            started, ended, with_prompt, follows, ahead = self._pending.popleft()
            if follows and self._last_ended is not None:
                gap = max(0.0, self._last_ended.elapsed_time(started) / 1e3)
                self.idle_seconds += gap
                self.idle_ahead_seconds += gap if ahead else 0.0
                self.idle_prompt_seconds += gap if with_prompt else 0.0
            self._last_ended = ended
            seconds = started.elapsed_time(ended) / 1e3
            self.seconds += seconds
            self.steps += 1
            if with_prompt:
                self.prompt_seconds += seconds
                self.prompt_steps += 1


def prefill_graph_copies(device: torch.device, exchange: Exchange, enforce_eager: bool) -> int:
    """Prefill graph runners an engine holds: one per micro-batch on CUDA, none when eager or on CPU."""
    if enforce_eager or device.type != "cuda":
        return 0
    return exchange.num_ubatches


def prefill_moe_inside(exchange: Exchange) -> bool:
    """Whether prefill graph pieces run each boundary layer's MoE inside them (afd.engine.graphs.prefill): with the
    in-process exchange whose FFN model takes the fixed-shape, host-sync-free path; a disaggregated exchange stays
    eager between the pieces."""
    return isinstance(exchange, LocalExchange) and capture_safe_moe(exchange.ffn_model)


def step_activation_bytes(
    config: ModelConfig, dtype: torch.dtype, max_num_batched_tokens: int, copies: int, *, moe_inside: bool = True
) -> int:
    """The activation peak of one full step plus `copies` prefill graphs' private memory (what the cache leaves).
    `moe_inside` (`prefill_moe_inside`): the graphs' pool also holds the MoE's temporaries; it defaults to the larger
    estimate, for callers that do not know their exchange."""
    graphs = graph_memory_estimate(config, dtype, max_num_batched_tokens, moe_inside=moe_inside)
    return activation_bytes_estimate(config, dtype, max_num_batched_tokens) + copies * graphs


class ModelRunner:
    """Runs scheduled steps of one `AttentionModel` over one paged cache, through `exchange` to the FFN side."""

    def __init__(
        self,
        model: AttentionModel,
        exchange: Exchange,
        kv_cache: PagedLatentCache,
        *,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        enforce_eager: bool = False,
    ) -> None:
        self.model, self.exchange, self.kv_cache = model, exchange, kv_cache
        self.device = model.embed_tokens.weight.device
        # Decode steps replay CUDA graphs (graphs.decode) on CUDA: one per step with the in-process exchange, one
        # per piece between exchanges with a disaggregated one (it crosses processes at every boundary layer and
        # runs eagerly between replays); `enforce_eager` turns graphs off.
        self.cuda_graphs: DecodeGraphRunner | None = None
        if not enforce_eager and self.device.type == "cuda":
            local = isinstance(exchange, LocalExchange)
            if local and not capture_safe_moe(exchange.ffn_model):
                dtype = model.embed_tokens.weight.dtype
                logger.info("decode CUDA graphs off: the routed experts of %s have no fixed-shape path", dtype)
            else:
                whole = local or exchange.capturable  # the async 1A1F exchange captures whole
                # a step decodes at most one token per sequence within the budget: no bucket above either
                largest = min(max_num_seqs, max_num_batched_tokens)
                self.cuda_graphs = DecodeGraphRunner(model, exchange, kv_cache, largest, segmented=not whole)
                logger.info(
                    "decode CUDA graphs on (%s), batch buckets %s",
                    "whole step" + ("" if local else ", exchanges included") if whole else "pieces between exchanges",
                    self.cuda_graphs.buckets,
                )
        # Steps with prompt tokens (or more decodes than a decode graph holds) replay their row-wise pieces from CUDA
        # graphs at padded token counts, the attention core eagerly between them (afd.engine.graphs.prefill); the
        # in-process exchange's MoE runs inside the pieces where it can be captured, any other exchange eagerly
        # between them. Decided here, once; one runner per micro-batch (micro-batches in flight need own buffers).
        moe_inside = prefill_moe_inside(exchange)
        self.prefill_graphs = [
            PrefillGraphRunner(
                model,
                kv_cache,
                max_num_batched_tokens,
                ffn_model=exchange.ffn_model if moe_inside else None,
                max_seqs=max_num_seqs,
            )
            for _ in range(prefill_graph_copies(self.device, exchange, enforce_eager))
        ]
        if self.prefill_graphs:
            logger.info(
                "prefill CUDA graphs on, token buckets %s; %s",
                self.prefill_graphs[0].buckets,
                "the MoE inside the pieces (they pause at the attention cores only)"
                if moe_inside
                else "the exchange eager between the pieces, on the real rows"
                + (" (the routed experts have no fixed-shape path)" if isinstance(exchange, LocalExchange) else ""),
            )
        self.ubatched_steps = 0  # steps run as micro-batches in ping-pong
        self.step_clock = StepClock(self.device)
        self.last_launch_decode = False  # whether the step launched last was all single-token decodes

    @property
    def num_ubatches(self) -> int:
        """Micro-batches a step is split into: the exchange's (`async_moe_ubatching`, `p2p_ubatching`), else 1. A
        split step calls `begin_step(T, tokens per micro-batch)` and drives the exchange's `send` / `recv`."""
        return self.exchange.num_ubatches

    def launch(
        self, scheduled: list[Scheduled], after: LaunchedStep | None = None, after_rows: list[int] | None = None
    ) -> LaunchedStep:
        """Queue the forward and the sampling of `scheduled` on the device. `after`: the step in flight whose
        sampled tokens (rows `after_rows`, in order) are the input ids of this step's `ON_DEVICE` decodes."""
        timeline = self.exchange.timeline  # AFD_TIMELINE (afd.profiling.timeline): the step's ends
        if timeline is not None:
            timeline.mark("launch", on_device=False)
        self.step_clock.start(ahead=after is not None)
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
            # a lone decode too, where graphs hold the step: their cores attend to decodes in the batched form
            batch_decodes=graphs is not None or bool(self.prefill_graphs),
        )
        input_ids = [t for s in scheduled for t in s.input_ids]
        # launched ahead: where the decodes' ids go and the rows of `after`'s sampled tokens they are, gathered on
        # the device below (their place in `input_ids` holds a placeholder)
        on_device = [i for i, t in enumerate(input_ids) if t == ON_DEVICE] if after is not None else []
        for i in on_device:
            input_ids[i] = 0
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
        host = (input_ids, positions, last_rows) + ((on_device, after_rows) if on_device else ())
        ids, pos, last, *ahead = self.kv_cache.prepare(batch, *(torch.tensor(v, dtype=torch.long) for v in host))
        if ahead:  # the tokens the step in flight sampled, never on the host
            ids.index_copy_(0, ahead[0], after.tokens.index_select(0, ahead[1]))
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

    def idle_step(self) -> None:
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

    def _sample(
        self, scheduled: list[Scheduled], batch: Batch, hidden: torch.Tensor, last_rows: torch.Tensor
    ) -> LaunchedStep:
        """Sample every sequence that ends its prompt or decodes, at once: one lm_head call, and one
        device->host copy started (read in `read_tokens`); a chunk in the middle of a prompt is only cached
        (and scored, which reads its scores at once: such a step is never left in flight)."""
        sampled = [s for s in scheduled if s.samples]
        tokens = host = ready = None
        if sampled:
            sampling = [s.seq.request.sampling for s in sampled]
            # the index of the token each row samples, from the schedule: a decode launched ahead has not
            # appended its input token on the host yet
            positions = [s.start + len(s.input_ids) for s in sampled]
            tokens, host, ready = launch_sampling(self.model, hidden[last_rows], sampling, positions)
        self.step_clock.stop(ready, with_prompt=not all(s.is_decode for s in scheduled))
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

    def read_tokens(self, step: LaunchedStep) -> tuple[list[float], list[float]]:
        """A launched step's sampled tokens and their logprobs on the host (waiting for their copy only)."""
        if step.ready is not None:
            step.ready.synchronize()
        self.step_clock.collect()
        timeline = self.exchange.timeline
        if timeline is not None:
            timeline.mark("tokens", on_device=False)
        if step.host is None:
            return [], []
        tokens, logprobs = step.host.tolist()
        return tokens, logprobs
