"""Device-driven FFN passes: the async FFN rank's host enqueues a whole forward pass ahead and leaves the
per-layer path.

Why: a host that discovers each layer's request (a flag read, a header read, a dozen launches, the reply's
copies) costs a few hundred µs per MoE layer, on the critical path of every decode step. Here, for each MoE
layer of a pass, the device runs, enqueued ahead of time: a stream wait until the request's flag is set, then
an item (two kernels around the experts, `asynchronous.chain_kernels`) that checks the request's header on the device,
computes the experts over a bucket of rows (rows past the header's count are masked out), writes the reply rows
and header into the attention rank's window, resets the local flag to 0 and publishes the reply's flag. A whole
pass (every layer's wait and item) is one captured graph, so the host launches once per pass (a pass started
mid-way replays one graph per layer, a wait before each). The host only retires finished passes and enqueues the
next.

Where: one attention rank, one FFN rank, no micro-batching (one ring stage), on CUDA with a device-side flag wait
(`Window.device_waits`). There the order of the attention rank's requests is known: the MoE layers of a forward
pass, in order, every layer with the same rows. With several attention ranks the host loop serves them, batching
their items of one layer into one expert pass.

Speculation and its check: the host learns a pass's rows from the first message it reads itself, then keeps
two passes queued (the next with the rows bucket of the last). An item serves its message only if the header
says request, this layer, at most the bucket's rows, the right seq, and no earlier item failed; otherwise
("abort") it publishes nothing and leaves the flag set, every later queued item fails too, and once they
drained the host serves that message itself and starts over. A misprediction costs time, never a wrong answer.

Flags: a slot served here has its flag reset to 0 by the item that consumed it (before the reply is published,
so before the next request can land), so every item waits for "flag >= 1"; the host poll skips the slot while
passes are queued and forgets the last value it saw when they are done (`Window.forget`).

Shutdown: the host cannot cancel a stream wait; `release()` sets the abort word and a nonzero flag from another
stream, so every queued item fails at once, and the device can be synchronized.

On CPU (`connector_extra_config.cpu_device_passes`, for tests) the same items run eagerly, each as soon as the
host loop finds its flag set (`pump`): the logic is tested without a GPU.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from afd import kernels
from afd.buckets import DEFAULT_BATCH_BUCKETS, pick_bucket
from afd.connectors.asynchronous.window import Window
from afd.connectors.asynchronous.wire import (
    FLAG_RESPONSE,
    MAGIC_WORD,
    VERSION,
    W_ECHO_SEQ,
    W_FLAGS,
    W_LAYER,
    W_MAGIC,
    W_ROWS,
    W_SEQ,
    W_SHARED,
    W_VERSION,
    SlotViews,
)
from afd.connectors.expert_pass import FFNModelLike
from afd.routing import Routing

logger = logging.getLogger(__name__)

QUEUED_PASSES = 2  # passes enqueued ahead: the next pass is waiting on the device while the host retires one


def pass_buckets(row_cap: int) -> list[int]:
    """The rows a chain's items are captured for: the decode batch buckets, then powers of two up to the slot's
    rows, and the slot's rows. Prefill-size steps stay on the device too (before: the host served every step
    above 256 rows, ~200 µs per layer). A bucket larger than a message costs little: its padding rows route to no
    expert and are never written back."""
    large = {1 << p for p in range(9, max(9, row_cap.bit_length()))}
    return sorted({b for b in (*DEFAULT_BATCH_BUCKETS, *large) if b < row_cap} | {row_cap})


@dataclass
class Ends:
    """Where an item reads its request and writes its reply: the real window slots, or scratch for warm-up."""

    header: torch.Tensor  # [HEADER_WORDS] int32: the request's header
    x: torch.Tensor  # [row_cap, H] model dtype
    topk_ids: torch.Tensor  # [row_cap, K] int32
    topk_weights: torch.Tensor  # [row_cap, K] fp32
    flag: torch.Tensor  # [1] int64: the request's flag (reset to 0 when served)
    reply: SlotViews  # the attention rank's slot (its header and out rows)
    reply_flag: torch.Tensor  # [1] int64


@dataclass
class QueuedPass:
    layers: list[int]
    bucket: int
    done: torch.cuda.Event | None  # recorded after its last item (CUDA)
    pending: deque[int] = field(default_factory=deque)  # CPU: the layers whose items have not run yet


class PassChain:
    """Serves one attention rank's requests (slot (region, stage 0) of an FFN rank's window) on the device, a pass
    at a time, on a stream of its own: the passes of several attention ranks never wait for each other."""

    def __init__(
        self,
        window: Window,
        region: int,
        attention_world_rank: int,
        ffn_rank: int,
        ffn_model: FFNModelLike,
        moe_layers: Sequence[int],
        *,
        buckets: Sequence[int] | None = None,
        timeout_s: float,
    ) -> None:
        self.window = window
        self.ffn_model = ffn_model
        self.moe_layers = sorted(moe_layers)
        cap = window.layout.row_cap
        self.buckets = sorted(b for b in (pass_buckets(cap) if buckets is None else buckets) if b <= cap) or [cap]
        self.timeout_s = timeout_s
        self.region = region
        self.device = window.device
        self.is_cuda = self.device.type == "cuda"
        self.slot_index = window.geometry.slot_index(region, 0)
        slot = window.local_slot(region, 0)
        reply, reply_flag = window.peer_slot(attention_world_rank, ffn_rank, 0)
        self.ends = Ends(
            slot.header, slot.x, slot.topk_ids, slot.topk_weights, window.local_flag(region, 0), reply, reply_flag
        )
        dev = self.device
        # device words: [abort, served, max rows] of the passes since the host last read them
        self.stats = torch.zeros(3, dtype=torch.int64, device=dev)
        top, k = self.buckets[-1], window.layout.topk
        self._ids = torch.zeros(top, k, dtype=torch.int64, device=dev)  # [n, K]: the rows' ids, -1 past the count
        self._mask = torch.zeros(top, dtype=torch.float32, device=dev)  # [n]: 1.0 on the rows with shared experts
        self._ok = torch.zeros(1, dtype=torch.int32, device=dev)  # whether this item serves its message
        self._arrive = torch.zeros(1, dtype=torch.int32, device=dev)  # reply_item's arrival count (0 between items)
        self.use_kernels = kernels.enabled(self.device)
        self.stream = torch.cuda.Stream(dev) if self.is_cuda else None
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        # bucket -> one graph of a whole pass, each layer's wait captured before its item: one launch per pass
        self._pass_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.is_cuda else None
        self.queued: deque[QueuedPass] = deque()
        self.next_bucket = self.buckets[0]
        self.items_served = 0
        self._served_read = 0  # the device's served count at the last read (the device only adds to it)
        self.aborts = 0  # passes that broke the prediction (the host served the message instead)

    # -- one item: check, compute, publish ------------------------------------------------------------

    def _item(self, ends: Ends, layer_idx: int, n: int) -> None:
        """Serve the request in `ends` if it is what this item expects; no host sync (graph-capturable)."""
        steps = _KERNEL_STEPS if self.use_kernels else _TORCH_STEPS
        ids, mask, ok = self._ids[:n], self._mask[:n], self._ok
        steps.check_request(ends.header, ends.flag, self.stats, ends.topk_ids, layer_idx, n, ids, mask, ok)
        x = ends.x[:n]
        routed = self.ffn_model.experts_topk(layer_idx, x, Routing(ids, ends.topk_weights[:n])).float()  # [n, H]
        shared = self.ffn_model.shared(layer_idx, x) if self.ffn_model.has_shared_experts else None  # [n, H]
        reply = ends.reply
        steps.reply_item(routed, shared, mask, reply.out, ends.header, reply.header, ends.flag, self.stats, ok,
                         ends.reply_flag, self._arrive)  # fmt: skip

    def _scratch_ends(self) -> Ends:
        """Ends of the same shapes that touch neither window: warming the kernels up writes no peer."""
        e = self.ends

        def like(t: torch.Tensor) -> torch.Tensor:
            return torch.zeros_like(t)

        reply = SlotViews(like(e.reply.header), like(e.reply.x), like(e.reply.out), like(e.reply.topk_ids),
                          like(e.reply.topk_weights))  # fmt: skip
        return Ends(like(e.header), like(e.x), like(e.topk_ids), like(e.topk_weights), like(e.flag), reply,
                    like(e.reply_flag))  # fmt: skip

    def capture_all(self) -> None:
        """Capture one graph per (MoE layer, bucket) before any work (CUDA); logs how long it took."""
        if not self.is_cuda:
            return
        start = time.perf_counter()
        scratch = self._scratch_ends()
        saved = self.stats.clone()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.inference_mode():
            for layer_idx in self.moe_layers:
                for n in self.buckets:
                    with torch.cuda.stream(side):  # compile and allocate outside the capture, on scratch
                        self._item(scratch, layer_idx, n)
                    side.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self._pool, stream=side):
                        self._item(self.ends, layer_idx, n)
                    self._graphs[(layer_idx, n)] = graph
            self._capture_passes(side)
            self.stats.copy_(saved)
        torch.cuda.synchronize(self.device)
        logger.info(
            "FFN device-driven passes: %d layers x buckets %s captured in %.1f s (%s)",
            len(self.moe_layers),
            self.buckets,
            time.perf_counter() - start,
            "and one graph per whole pass" if self._pass_graphs else "one graph per layer",
        )

    def _capture_passes(self, side: torch.cuda.Stream) -> None:
        """One graph per bucket of a whole pass (the items' kernels are compiled by then). A wait that cannot be
        captured leaves the per-layer graphs in charge, with a warning, instead of failing the rank."""
        try:
            for n in self.buckets:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool, stream=side):
                    for layer_idx in self.moe_layers:
                        self.window.wait_flag(self.region, 0, 1, side)
                        self._item(self.ends, layer_idx, n)
                self._pass_graphs[n] = graph
        except RuntimeError as exc:
            self._pass_graphs.clear()
            logger.warning("whole-pass FFN graphs could not be captured (%s); one graph per layer instead", exc)

    # -- host side: queue, retire, fall back ------------------------------------------------------------

    @property
    def owns_slot(self) -> bool:
        return bool(self.queued)

    def bucket_for(self, rows: int) -> int | None:
        return pick_bucket(rows, self.buckets)

    @torch.inference_mode()
    def start(self, layer_idx: int, rows: int) -> bool:
        """The host read a request for `layer_idx` with `rows` rows in the slot: serve it and the rest of its pass
        on the device, then queue the next pass. False (nothing queued) when no bucket holds the rows."""
        bucket = self.bucket_for(rows)
        if bucket is None or layer_idx not in self.moe_layers:
            return False
        self.next_bucket = bucket
        self._enqueue(self.moe_layers[self.moe_layers.index(layer_idx) :], bucket)
        self.top_up()
        return True

    @torch.inference_mode()
    def top_up(self) -> None:
        """Keep QUEUED_PASSES whole passes enqueued, at the bucket of the rows seen last."""
        while len(self.queued) < QUEUED_PASSES:
            self._enqueue(self.moe_layers, self.next_bucket)

    def _enqueue(self, layers: list[int], bucket: int) -> None:
        if not self.is_cuda:  # the items run when `pump` finds their flag set
            self.queued.append(QueuedPass(layers, bucket, None, deque(layers)))
            self.pump()
            return
        # after what the host enqueued on its own stream (a reply it served, the stats it reset after an abort)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        whole = self._pass_graphs.get(bucket) if layers == self.moe_layers else None
        with torch.cuda.stream(self.stream):
            if whole is not None:
                whole.replay()  # every layer's wait and item: one launch
            else:  # a pass the host started mid-way (after a hand-back)
                for layer_idx in layers:
                    self.window.wait_flag(self.region, 0, 1, self.stream)
                    self._graphs[(layer_idx, bucket)].replay()
            done = torch.cuda.Event()
            done.record(self.stream)
        self.queued.append(QueuedPass(layers, bucket, done))

    @torch.inference_mode()
    def pump(self) -> None:
        """CPU: run the queued items whose request is there (or that must fail: an earlier one did), in order; the
        host never blocks here, so an idle attention rank holds up nothing."""
        while self.queued and self.queued[0].pending:
            if int(self.ends.flag[0]) < 1 and int(self.stats[0]) == 0:
                return
            queued = self.queued[0]
            self._item(self.ends, queued.pending.popleft(), queued.bucket)
            if not queued.pending and len(self.queued) > 1:
                return  # a whole pass is done: the host retires it before the next one runs

    @staticmethod
    def _is_done(queued: QueuedPass) -> bool:
        return not queued.pending if queued.done is None else queued.done.query()

    @torch.inference_mode()
    def retire(self) -> bool:
        """Retire the passes that finished; True when the slot goes back to the host (a pass aborted: the message
        that broke the prediction is still in the slot, its flag set). Reads the stats back once per pass."""
        if not self.is_cuda:
            self.pump()
        retired = False
        while self.queued and self._is_done(self.queued[0]):
            self.queued.popleft()
            retired = True
        if not retired:
            return False
        abort, _, max_rows = self.stats.tolist()
        self._count_served()
        if not abort:
            self.next_bucket = self.bucket_for(max(max_rows, 1)) or self.next_bucket
            self.stats[2:].zero_()  # the next passes' largest rows (a queued item may race this: a hint only)
            self.top_up()
            return False
        self._drain()  # every queued item fails at once now: its wait passes on the message left in the slot
        self._count_served()
        self.aborts += 1
        self.stats.zero_()  # nothing runs on the device now
        self._served_read = 0
        if self.is_cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        self.window.forget(self.region, 0)
        logger.debug("device-driven pass handed back (%d so far): the host serves the next message", self.aborts)
        return True

    def _count_served(self) -> None:
        served = int(self.stats[1])
        self.items_served += served - self._served_read
        self._served_read = served

    def _drain(self) -> None:
        """Wait, bounded, for every queued item (after an abort: each fails at once)."""
        deadline = time.monotonic() + self.timeout_s
        while self.queued:
            if not self.is_cuda:
                self.pump()
            if not self._is_done(self.queued[0]):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"queued device-driven FFN passes did not drain within {self.timeout_s:.0f}s")
                time.sleep(2e-5)
                continue
            self.queued.popleft()
        if self.stream is not None:
            self.stream.synchronize()

    @torch.inference_mode()
    def release(self) -> None:
        """Shutdown: fail every queued item now (abort word, then a nonzero flag, from another stream) and wait for
        them; after this the device can be synchronized."""
        if not self.queued:
            return
        if self.is_cuda:
            poke = torch.cuda.Stream(self.device)
            with torch.cuda.stream(poke):
                self.stats[0:1].fill_(1)
                self.ends.flag.fill_(1)
        else:
            self.stats[0] = 1
        try:
            self._drain()
        except TimeoutError:
            logger.warning("device-driven FFN passes still queued at shutdown")
            self.queued.clear()
            return
        self._count_served()


class _TorchSteps:
    """An item's two steps in PyTorch: the CPU path and the oracle of `asynchronous.chain_kernels` (same arguments)."""

    @staticmethod
    def check_request(header, flag, stats, topk_ids, layer_idx, n, ids_out, mask_out, ok_out) -> None:  # noqa: ANN001
        h = header
        rows, shared = h[W_ROWS].long(), h[W_SHARED].long()
        seq = flag[0]
        ok = (
            (stats[0] == 0)
            & (seq >= 1)
            & (h[W_MAGIC] == MAGIC_WORD)
            & (h[W_VERSION] == VERSION)
            & (h[W_FLAGS] == 0)
            & (h[W_LAYER] == layer_idx)
            & (rows <= n)
            & (shared <= rows)
            & ((h[W_SEQ].long() & 0xFFFFFFFF) == (seq & 0xFFFFFFFF))
        )
        ok_out.copy_(ok.int().reshape(1))
        index = torch.arange(n, device=h.device)
        ids_out.copy_(torch.where((index < rows)[:, None], topk_ids[:n].long(), -1))  # rows past the count: nowhere
        mask_out.copy_((index < shared).float())

    @staticmethod
    def reply_item(routed, shared, mask, out, header, reply_header, flag, stats, ok, reply_flag, arrive) -> None:  # noqa: ANN001
        """The reply's rows and header, then the flags and counters (`arrive` is the kernel's; unused here)."""
        n = routed.shape[0]
        total = routed if shared is None else routed + mask[:, None] * shared.float()
        written = (torch.arange(n, device=out.device) < header[W_ROWS].long())[:, None]  # the message's rows only
        out[:n].copy_(torch.where(written, total.to(out.dtype), out[:n]))
        answer = header.clone()
        answer[W_FLAGS : W_FLAGS + 1].fill_(FLAG_RESPONSE)  # (item assignment copies a CPU scalar: not capturable)
        answer[W_ECHO_SEQ : W_ECHO_SEQ + 1].copy_(header[W_SEQ : W_SEQ + 1])
        reply_header.copy_(answer)
        served, seq, rows = ok[0] != 0, flag[0], header[W_ROWS].long()
        published = torch.where(served, seq, reply_flag[0])
        flag.copy_(torch.where(served, 0, seq))
        stats.copy_(torch.stack([torch.where(served, stats[0], 1), stats[1] + served, torch.maximum(stats[2], rows)]))
        reply_flag.copy_(published)  # last: the reply is visible once this lands


class _LazyKernels:
    """`afd.connectors.asynchronous.chain_kernels`, imported on first use (Triton is a CUDA path)."""

    def __getattr__(self, name: str):  # noqa: ANN204
        from afd.connectors.asynchronous import chain_kernels as chain

        return getattr(chain, name)


_TORCH_STEPS = _TorchSteps()
_KERNEL_STEPS = _LazyKernels()
