"""The engine of one attention replica: a loop over a `Scheduler`, a `BlockManager` and a `ModelRunner`.

One step = schedule (`afd.engine.scheduler`) -> launch (`afd.engine.model_runner`: `exchange.begin_step(T)`, the
forward of the flattened batch through the exchange, sampling) -> read the tokens -> post-process (append, finish,
free the blocks: `afd.engine.block_manager`). The exchange is the only way to the FFN side, so the same engine
drives the local reference (`LocalExchange`) and every disaggregated connector.

Overlapped steps ("async scheduling", `overlap_steps`): the host's work between two steps (reading the
sampled tokens, bookkeeping, scheduling, building the next step's metadata, launching it) would leave
the GPU idle. So every step is left in flight: the next `step()` launches its successor first (decodes,
prompt chunks and admissions alike, `Scheduler.schedule_ahead`), the decodes' input ids gathered on the
device from the tokens the step in flight sampled, and only then waits for those tokens and does their
bookkeeping while the GPU runs the successor.
"""

from __future__ import annotations

import logging
from collections import deque

import torch

from afd.connectors.base import Exchange
from afd.engine.block_manager import BlockManager, size_cache
from afd.engine.graphs.decode import DecodeGraphRunner
from afd.engine.graphs.prefill import PrefillGraphRunner
from afd.engine.model_runner import (  # noqa: F401 - LocalExchange and launch_sampling: callers import them here
    LocalExchange,
    ModelRunner,
    launch_sampling,
    prefill_graph_copies,
    prefill_moe_inside,
    step_activation_bytes,
)
from afd.engine.request import EngineLoad, Output, Request, StepToken
from afd.engine.scheduler import Scheduler
from afd.engine.sequence import LaunchedStep, Scheduled, SequenceState
from afd.model.attention_side import AttentionModel
from afd.model.kv_cache import DEFAULT_BLOCK_SIZE, DEFAULT_GPU_MEMORY_UTILIZATION

logger = logging.getLogger(__name__)


class Engine:
    """Continuous batching with chunked prefill over one `AttentionModel` and an `exchange` to the FFN side.

    `max_num_batched_tokens` is the token budget of one step, as in vLLM: prompts longer than it (or than
    what the decodes leave of it) are prefilled over several steps.

    The MLA cache is one paged pool (`afd.model.kv_cache`), sized once here (`block_manager.size_cache`):
    `num_blocks` if given, else `max_cache_tokens` tokens, else on CUDA `gpu_memory_utilization` of the GPU's
    memory less the weights and the activation peak, else (CPU) a 4 GiB budget. A request reserves its blocks
    at admission; while the pool is full, new requests wait in the queue.

    `overlap_steps` (None: on with CUDA and the in-process `LocalExchange` unless `enforce_eager`): leave every
    step in flight and launch the next one before reading its tokens (module docstring). `step()` then returns
    the requests the previous step finished, and `last_step_tokens` are that step's, one call later than without
    overlap. Off by default with a disaggregated exchange: its forward already waits on the host at every
    exchange, and the p2p DP wave announces each step's token count before it runs. An explicit True also works
    on CPU (the tests compare it with False there), where it gains nothing.
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
        self.max_num_seqs, self.max_cache_tokens = max_num_seqs, max_cache_tokens
        self.device = model.embed_tokens.weight.device
        dtype, config = model.embed_tokens.weight.dtype, model.config
        self.max_model_len = max_model_len or config.max_position_embeddings
        copies = prefill_graph_copies(self.device, exchange, enforce_eager)
        self.kv_cache = size_cache(
            config,
            dtype,
            self.device,
            num_blocks=num_blocks,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_model_len=self.max_model_len,
            max_cache_tokens=max_cache_tokens,
            gpu_memory_utilization=gpu_memory_utilization,
            activation_bytes=step_activation_bytes(
                config, dtype, max_num_batched_tokens, copies, moe_inside=prefill_moe_inside(exchange)
            ),
        )
        logger.info("KV cache: %s", self.kv_cache.describe())
        self.block_manager = BlockManager(self.kv_cache)
        self.scheduler = Scheduler(self.block_manager, max_num_batched_tokens, max_num_seqs)
        self.runner = ModelRunner(
            model,
            exchange,
            self.kv_cache,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            enforce_eager=enforce_eager,
        )
        self.last_step_tokens: list[StepToken] = []  # every token the last step appended, in batch order
        if overlap_steps is None:
            overlap_steps = self.device.type == "cuda" and isinstance(exchange, LocalExchange) and not enforce_eager
        if overlap_steps and self.num_ubatches > 1:
            raise ValueError("overlap_steps cannot be combined with micro-batches (async_moe_ubatching); turn one off")
        self.overlap_steps = overlap_steps
        self._in_flight: LaunchedStep | None = None  # a step launched, its tokens not read yet
        self._work_left = False  # the last finalized step left work: the next launch follows it
        self.overlapped_steps = 0  # steps launched before the tokens of the step before them were read

    # --- the parts' state, under the names callers use ---

    @property
    def max_num_batched_tokens(self) -> int:
        return self.scheduler.max_num_batched_tokens

    @max_num_batched_tokens.setter
    def max_num_batched_tokens(self, value: int) -> None:
        self.scheduler.max_num_batched_tokens = value

    @property
    def waiting(self) -> deque[SequenceState]:
        return self.scheduler.waiting

    @property
    def running(self) -> list[SequenceState]:
        return self.scheduler.running

    @property
    def cache_tokens_used(self) -> int:
        return self.block_manager.cache_tokens_used

    @property
    def cuda_graphs(self) -> DecodeGraphRunner | None:
        return self.runner.cuda_graphs

    @cuda_graphs.setter
    def cuda_graphs(self, runner: DecodeGraphRunner | None) -> None:
        self.runner.cuda_graphs = runner

    @property
    def graphs_captured_while_serving(self) -> int:
        """CUDA graphs (decode, and prefill pieces) captured inside a step, on a miss, rather than at warm-up (0
        without graphs)."""
        decode = self.cuda_graphs.captured_while_serving if self.cuda_graphs is not None else 0
        return decode + sum(runner.captured_while_serving for runner in self.prefill_graphs)

    @property
    def prefill_graphs(self) -> list[PrefillGraphRunner]:
        return self.runner.prefill_graphs

    @prefill_graphs.setter
    def prefill_graphs(self, runners: list[PrefillGraphRunner]) -> None:
        self.runner.prefill_graphs = runners

    @property
    def num_ubatches(self) -> int:
        """Micro-batches a step is split into (`ModelRunner.num_ubatches`)."""
        return self.runner.num_ubatches

    @property
    def ubatched_steps(self) -> int:
        return self.runner.ubatched_steps

    @property
    def last_launch_decode(self) -> bool:
        return self.runner.last_launch_decode

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
        self.block_manager.check_fits(SequenceState(-1, request))

    def add(self, request: Request) -> int:
        """Queue a request; returns its id (carried by its Output)."""
        self.validate(request)
        return self.scheduler.add(request).request_id

    def abort(self, request_id: int) -> Output | None:
        """Stop a waiting or running request now and free its cache blocks; its Output (reason "abort")
        holds what it generated so far: not the token of a step still in flight, which is dropped when that
        step is finalized. An unknown or finished id is a no-op (None): a client's abort may cross its
        request's end."""
        return self.scheduler.abort(request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None

    @property
    def step_in_flight(self) -> bool:
        """Whether a step was launched whose tokens the host has not read yet (`overlap_steps`)."""
        return self._in_flight is not None

    def step_running(self) -> bool:
        """Whether the step in flight is still running on the device (False without one, or once it ended)."""
        flight = self._in_flight
        return flight is not None and flight.ready is not None and not flight.ready.query()

    def load(self) -> EngineLoad:
        usage = self.block_manager.usage
        clock = self.runner.step_clock
        return EngineLoad(
            len(self.running),
            len(self.waiting),
            usage,
            self.graphs_captured_while_serving,
            clock.seconds,
            clock.steps,
            clock.idle_seconds,
            clock.prompt_seconds,
            clock.prompt_steps,
        )

    # --- scheduling and cache bookkeeping (the parts' check-then-act pairs) ---

    def can_allocate(self, seq: SequenceState) -> bool:
        return self.block_manager.can_allocate(seq)

    def allocate(self, seq: SequenceState) -> None:
        self.block_manager.allocate(seq)

    def free(self, seq: SequenceState) -> None:
        self.block_manager.free(seq)

    def schedule(self) -> list[Scheduled]:
        """The next step's pieces (`Scheduler.schedule`)."""
        return self.scheduler.schedule()

    # --- the step ---

    @torch.inference_mode()
    def step(self) -> list[Output]:
        """Run one step; returns the requests that finished.

        Host->device: one copy (token ids, positions, sampled rows and the cache metadata together);
        device->host: one copy of the sampled tokens and their logprobs. With `overlap_steps`:
        1. a step in flight whose successor is known (`Scheduler.schedule_ahead`): launch the successor, then
           finalize the step in flight (read its tokens, append, finish); the successor stays in flight;
        2. a step in flight otherwise: finalize it, launch nothing (the next call schedules);
        3. nothing in flight: schedule and launch; the step stays in flight (returns []).
        """
        flight, self._in_flight = self._in_flight, None
        self.runner.step_clock.scheduling(follows=flight is not None or self._work_left)
        if flight is not None:
            ahead = self.scheduler.schedule_ahead(flight.scheduled, flight.sampled) if self.overlap_steps else None
            if ahead is not None:
                successor, rows = ahead
                self._in_flight = self.runner.launch(successor, flight, rows)
                self.overlapped_steps += 1
            return self._finalize(flight)
        scheduled = self.schedule()
        if not scheduled:
            self.runner.idle_step()
            self.last_step_tokens = []
            return []
        launched = self.runner.launch(scheduled)
        if self.overlap_steps:
            self._in_flight = launched
            self.last_step_tokens = []
            return []
        return self._finalize(launched)

    @torch.inference_mode()
    def drain(self) -> list[Output]:
        """Finalize the step in flight, if any, without launching another; returns the requests it finished."""
        flight, self._in_flight = self._in_flight, None
        return self._finalize(flight) if flight is not None else []

    def _finalize(self, step: LaunchedStep) -> list[Output]:
        """Read a launched step's tokens and do its bookkeeping (`Scheduler.postprocess`)."""
        tokens, logprobs = self.runner.read_tokens(step)
        finished, self.last_step_tokens = self.scheduler.postprocess(step.scheduled, step.sampled, tokens, logprobs)
        self._work_left = self.has_work()  # the next launch follows this step at once (`StepClock` idle time)
        return finished

    def run(self) -> list[Output]:
        """Step until every queued request finished; outputs in request-id order."""
        outputs: dict[int, Output] = {}
        while self.has_work():
            for out in self.step():
                outputs[out.request_id] = out
        if self.cuda_graphs is not None:
            logger.info("CUDA graphs captured while serving: %d", self.graphs_captured_while_serving)
        return [outputs[k] for k in sorted(outputs)]
