"""One vLLM engine as one afd attention rank: its place in the AFD world and the exchange its MoE layers call.

Built while vLLM builds the model, in vLLM's worker process. It joins the world through the store at the AFD
config's `host:port` (every wait bounded by `connector_extra_config.timeout_s`: the FFN ranks must be up by
then) and builds the attention side of the connector:
- `async`: no control plane. Every MoE layer calls `AsyncAttentionExchange`; vLLM's scheduler needs nothing.
- `p2p`: `begin_step(T)` once per forward pass (`step`). vLLM runs no forward while it has no request, but a p2p
  FFN rank waits a bounded time for the next step count, so an idle engine sends a zero-token step every
  `keep_alive_s` from a thread (the lock keeps it out of a running forward pass).
At process exit (vLLM's worker is a `multiprocessing` child: no atexit handlers run there, its finalizers do)
`close` tells the FFN ranks the attention side is done (async: the shutdown flag; p2p: the end of the wave),
so they exit 0. A forward pass cut short makes `close` publish a failure instead: the FFN ranks exit 1 naming it.
"""

from __future__ import annotations

import logging
import multiprocessing.util
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, TypeVar

import torch

from afd.config import AFDConfig
from afd.connectors.base import Exchange
from afd.distributed.world import World, init_world
from afd.model.config import ModelConfig
from afd.routing import Routing
from afd.topology import AsyncTopology, SyncTopology

if TYPE_CHECKING:
    from afd.connectors.p2p.attention import P2pAttentionExchange

logger = logging.getLogger(__name__)

MAX_KEEP_ALIVE_S = 2.0  # p2p: the longest an idle engine waits before its next zero-token step
FINALIZER_PRIORITY = 100  # run before multiprocessing's own late finalizers
CLOSE_WAIT_S = 10.0  # at exit, how long to wait for a keep-alive step in flight
_T = TypeVar("_T")


class AFDSession(Exchange):
    """The attention side of one afd connector inside vLLM: the `Exchange` its MoE layers call."""

    def __init__(
        self,
        cfg: AFDConfig,
        model: ModelConfig,
        *,
        attn_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        max_num_batched_tokens: int,
    ) -> None:
        self.cfg, self.model, self.attn_rank = cfg, model, attn_rank
        self.dtype, self.device = dtype, device
        self.boundary_layers = model.moe_layers
        self.timeout_s = float(cfg.connector_extra_config.timeout_s)
        self.keep_alive_s = min(MAX_KEEP_ALIVE_S, self.timeout_s / 4)
        self.num_forwards = 0  # forward passes of vLLM (p2p: steps announced to the FFN ranks)
        self.num_exchanges = 0  # MoE layers handed to the FFN ranks
        self.num_idle_steps = 0  # p2p keep-alive steps
        self._lock = threading.Lock()  # held for a whole forward pass or keep-alive step
        self._in_step = False  # a step began and has not ended (cut short if still set at close)
        self._closed = False
        self._last_step = time.monotonic()
        self._stop = threading.Event()
        self.exchange: Exchange
        self._wave: P2pAttentionExchange | None = None  # p2p: the exchange whose DP wave `close` ends
        A, F = cfg.num_attention_ranks, cfg.num_ffn_ranks
        if cfg.connector == "async":
            from afd.connectors.asynchronous.attention import AsyncAttentionExchange

            topo = AsyncTopology(A, F, model.n_routed_experts)
            self.world = self._join(topo.world_rank("attention", attn_rank), topo.world_size, "gloo", "attention_first")
            self.exchange = self._build(
                lambda: AsyncAttentionExchange(
                    self.world.store,
                    topo,
                    attn_rank,
                    hidden_size=model.hidden_size,
                    topk=model.num_experts_per_tok,
                    num_layers=model.num_hidden_layers,
                    dtype=dtype,
                    device=device,
                    max_num_batched_tokens=max_num_batched_tokens,
                    extra_config=cfg.connector_extra_config,
                    timeout_s=self.timeout_s,
                )
            )
        else:
            from afd.connectors.p2p.attention import P2pAttentionExchange

            topo = SyncTopology(A, F)
            backend = "nccl" if device.type == "cuda" else "gloo"
            self.world = self._join(topo.world_rank("attention", attn_rank), topo.world_size, backend, "ffn_first")
            self.exchange = self._wave = self._build(
                lambda: P2pAttentionExchange(
                    self.world,
                    topo,
                    gate_on_attention=True,
                    topk=model.num_experts_per_tok,
                    boundary_layers=self.boundary_layers,
                )
            )
            threading.Thread(target=self._keep_alive, name="afd-p2p-keep-alive", daemon=True).start()
        multiprocessing.util.Finalize(self, self.close, exitpriority=FINALIZER_PRIORITY)
        logger.info(
            "afd attention rank %d of %dA%dF joined the AFD world at %s:%d (%s); MoE layers %s go to the FFN ranks, "
            "batches up to max_num_batched_tokens=%d (start the FFN ranks with --max-num-batched-tokens %d)",
            attn_rank,
            A,
            F,
            cfg.host,
            cfg.port,
            cfg.connector,
            self.boundary_layers,
            max_num_batched_tokens,
            max_num_batched_tokens,
        )

    def _join(self, world_rank: int, world_size: int, backend: str, order: str) -> World:
        return init_world(
            self.cfg.host,
            self.cfg.port,
            world_rank,
            world_size,
            backend,
            self.timeout_s,
            num_attention=self.cfg.num_attention_ranks,
            num_ffn=self.cfg.num_ffn_ranks,
            world_order=order,
            dtype=str(self.dtype).removeprefix("torch."),  # the FFN ranks take vLLM's (float32 runs as bfloat16 on CPU)
        )

    def _build(self, make: Callable[[], _T]) -> _T:
        """The exchange, or its failure published to the world: the FFN ranks then stop at once, naming it."""
        try:
            return make()
        except BaseException as exc:
            self.world.close(error=self.world.blame(exc))
            raise

    # --- the forward pass ---

    @contextmanager
    def step(self, num_tokens: int) -> Iterator[None]:
        """One vLLM forward pass over `num_tokens` rows: p2p announces it to the FFN ranks first."""
        with self._lock:
            self._in_step = True
            self.begin_step(num_tokens)
            yield
            self._in_step = False  # not reached when the forward raised: `close` then reports the cut
            self._last_step = time.monotonic()
            self.num_forwards += 1

    def begin_step(self, num_tokens: int, ubatch_tokens: Sequence[int] | None = None) -> None:
        """p2p: announce the forward pass's rows to the FFN ranks; async needs nothing (its exchange's no-op)."""
        self.exchange.begin_step(num_tokens, ubatch_tokens)

    def __call__(self, layer_idx: int, x: torch.Tensor, routing: Routing | None) -> torch.Tensor:
        """x: [T, H] model dtype, routing from afd's gate -> the layer's MoE output [T, H] (routed + shared)."""
        self.num_exchanges += 1
        return self.exchange(layer_idx, x, routing)

    # --- p2p while idle ---

    def _keep_alive(self) -> None:
        while not self._stop.wait(self.keep_alive_s / 2):
            if time.monotonic() - self._last_step < self.keep_alive_s:
                continue
            with self._lock:
                if self._closed or time.monotonic() - self._last_step < self.keep_alive_s:
                    continue
                try:
                    self._idle_step()
                except Exception:  # the world's watchdog ends the process and names the culprit
                    logger.exception("afd attention rank %d: the p2p keep-alive step failed", self.attn_rank)
                    return

    def _idle_step(self) -> None:
        """A zero-token step: `begin_step(0)`, then every MoE layer with `[0, H]` rows (what the FFN ranks expect)."""
        self._in_step = True
        self.exchange.begin_step(0)
        k = self.model.num_experts_per_tok
        x = torch.empty(0, self.model.hidden_size, dtype=self.dtype, device=self.device)  # [0, H]
        routing = Routing(
            torch.empty(0, k, dtype=torch.long, device=self.device),  # [0, K]
            torch.empty(0, k, dtype=torch.float32, device=self.device),  # [0, K]
        )
        for layer_idx in self.boundary_layers:
            self.exchange(layer_idx, x, routing)
        self._in_step = False
        self._last_step = time.monotonic()
        self.num_idle_steps += 1

    # --- the end ---

    def close(self) -> None:
        """Tell the FFN ranks the attention side is done, then leave the world. Never raises."""
        if self._closed:
            return
        self._stop.set()
        acquired = self._lock.acquire(timeout=CLOSE_WAIT_S)
        self._closed = True
        error: BaseException | None = None
        if not acquired or self._in_step:
            error = RuntimeError(f"vLLM stopped attention rank {self.attn_rank} in the middle of a forward pass")
        try:
            if self.cfg.connector == "async":
                self.exchange.close()  # the shutdown flag to every FFN rank
            elif error is None and self._wave is not None:
                self._wave.step_wave(False)  # the end of the wave: the FFN loops return
        except Exception as exc:  # noqa: BLE001 - reported through the world below
            error = error or exc
        logger.info(
            "afd attention rank %d: %d forward passes, %d MoE exchanges, %d idle steps; closing (%s)",
            self.attn_rank,
            self.num_forwards,
            self.num_exchanges,
            self.num_idle_steps,
            "cleanly" if error is None else error,
        )
        try:
            self.world.close(error=error)
        except Exception:  # noqa: BLE001 - nothing more to tell anyone at exit
            logger.exception("afd attention rank %d: leaving the AFD world failed", self.attn_rank)
        if acquired:
            self._lock.release()
