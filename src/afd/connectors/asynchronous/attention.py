"""The `async` connector: token-level dispatch/combine over symmetric windows, self-driven FFN.

Attention replicas never wait for each other: an attention rank writes each FFN rank's rows into
that rank's window (region == attn_rank) and waits only on the FFN ranks it wrote to. A token goes
once to each FFN rank owning one of its experts, its top-k ids and weights in band (wire version 4);
the answers are weighted partial sums that the attention side adds in FFN rank order (fp32). FFN
ranks know nothing beforehand: they poll their window, compute whatever arrives (any layer, any
replica, any order; the items of one layer that wait together in one expert pass) and write each
result back into its sender's window (region == ffn_rank).

Launch (every rank, same arguments except role/role_rank):

    exchange = AsyncAttentionExchange(store, topology, attn_rank, hidden_size=..., ...)
    hidden = model.forward(..., exchange=exchange); ...; exchange.close()

    server = AsyncFFNServer(store, topology, ffn_rank, hidden_size=..., ...)   # afd.connectors.asynchronous.ffn
    run_ffn_loop(server, ffn_model, stop_event)   # returns when every attention rank shut down

This module holds the attention side; the endpoint both roles share is in `afd.connectors.asynchronous.endpoint`,
the FFN side in `afd.connectors.asynchronous.ffn`, the peer liveness check in `afd.connectors.asynchronous.liveness`.

Shutdown: `close()` raises this rank's shutdown flag (its own flag per region, never a ring slot) in
every opposite-role peer's window; the FFN loop returns normally once all attention ranks announced
it. `recv_poll_timeout_ms` is the second line: every wait wakes up at that period to check the stop
event and whether its peers are alive.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from afd.connectors.asynchronous.dispatch import DispatchPlan, combine_scatter, plan_dispatch
from afd.connectors.asynchronous.endpoint import (  # noqa: F401 - the endpoint's errors are this connector's API
    AsyncEndpoint,
    ConnectorShutdown,
    PeerDied,
    RingExhausted,
    as_async_config,
)
from afd.connectors.asynchronous.window import Message
from afd.connectors.asynchronous.wire import (
    HEADER_WORDS,
    SlotHeader,
    WindowProtocolError,
    decode_header,
    seq32,
    seq_matches,
)
from afd.connectors.base import Exchange
from afd.routing import Routing
from afd.topology import AsyncTopology, Role

logger = logging.getLogger("afd.connectors.asynchronous.attention")


HEADER_RING = 64  # reply headers read back but not yet checked: how far the host may run ahead of its stream


@dataclass(frozen=True)
class InFlight:
    stage: int
    seq: int


@dataclass
class PendingExchange:
    """What the attention side keeps between send and recv."""

    layer_idx: int
    num_tokens: int
    dtype: torch.dtype
    plan: DispatchPlan  # which token each reply row adds to
    sent: dict[int, InFlight]  # ffn_rank → slot and seq; the only ranks recv waits on
    shared: torch.Tensor | None = None  # [T, H] the shared experts' output, run here (`shared_experts_on_attention`)


class AsyncAttentionExchange(AsyncEndpoint, Exchange):
    """Attention side: the model's `Exchange`.

    shared_experts: `(layer_idx, x) -> [T, H]`, the attention model's own shared experts; required with
    `shared_experts_on_attention`, when every send runs them on this rank while the FFN ranks compute the routed
    experts, and its recv adds them to the replies (fp32) before the one rounding to the model dtype.
    """

    role: Role = "attention"

    def __init__(
        self,
        store: dist.Store,
        topology: AsyncTopology,
        attn_rank: int,
        *,
        shared_experts: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> None:
        if as_async_config(kwargs.get("extra_config")).shared_experts_on_attention and shared_experts is None:
            raise ValueError(
                "connector_extra_config.shared_experts_on_attention needs the attention model's shared experts "
                "(load it with shared_experts=True and pass its `shared`)"
            )
        super().__init__(store, topology, attn_rank, **kwargs)
        self.shared_experts = shared_experts if self.config.shared_experts_on_attention else None
        # micro-batches of a step in ping-pong (attention_side.run_ubatches): each is one send in flight per FFN rank,
        # so each needs its own ring stage (the config makes ring_depth cover them)
        cfg = self.config
        self.num_ubatches = cfg.async_moe_num_ubatches if cfg.async_moe_ubatching else 1
        self._pending: deque[PendingExchange] = deque()
        self._in_flight: set[tuple[int, int]] = set()  # (ffn_rank, stage)
        self._early: dict[tuple[int, int], Message] = {}  # (ffn_rank, stage) -> a reply to a later pending send
        # device-side waits (NVSHMEM): reply headers read back behind the combine, checked later
        self._unchecked: deque[tuple[tuple[int, int], torch.cuda.Event, PendingExchange, int]] = deque()
        self._header_ring: torch.Tensor | None = None  # [HEADER_RING, HEADER_WORDS] pinned: reply headers read back
        self._header_turn = 0
        self._empty = torch.empty(0, device=self.device)
        self._device_waits = self.window.device_waits
        # captured decode steps (afd.engine.graphs.decode): a device seq counter, a device count of failed reply checks
        self._device_seq = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._errors = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._arrive = torch.zeros(1, dtype=torch.int32, device=self.device)  # send_request's arrival count
        self._graph_checks: deque[tuple[torch.cuda.Event, torch.Tensor]] = deque()
        self.captured_sends = 0
        try:  # the plan's counts: shared and other rows per FFN rank
            self._counts_host = torch.zeros(
                2 * self.topology.num_ffn, dtype=torch.int64, pin_memory=self.device.type == "cuda"
            )
            self._row_index = torch.arange(self.window.layout.token_cap, device=self.device)  # the plan's, at F = 1
        except BaseException:
            self._abandon()
            raise

    def __call__(self, layer_idx: int, x: torch.Tensor, routing: Routing | None) -> torch.Tensor:
        """x: [T, H] model dtype, routing (required) -> the MoE output [T, H] model dtype."""
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return self._exchange_in_graph(layer_idx, x, routing)
        self.send(layer_idx, x, routing)
        return self.recv()

    # -- inside a captured decode step (afd.engine.graphs.decode) ------------------------------------------------------

    @property
    def capturable(self) -> bool:
        """Whether a decode graph may capture this exchange whole (CUDA, device-side waits, one FFN rank, no
        micro-batches): the host then launches one graph per decode step."""
        return self._device_waits and self.topology.num_ffn == 1 and self.num_ubatches == 1

    def _exchange_in_graph(self, layer_idx: int, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """The exchange as device work only (being captured): one launch copies the rows into the FFN rank's slot
        and publishes the header and flag with the next seq of a device counter; then wait for the reply's flag,
        copy the reply out, check its header into a device error count and reset the flag. `before_replay` sets
        the counter from the host's; `after_replay` advances the host's and reads the error count back."""
        from afd.connectors.asynchronous import chain_kernels as chain

        if not self.capturable:
            raise RuntimeError("this async exchange cannot be captured in a CUDA graph")
        if routing is None or x.shape[0] > self.window.layout.token_cap:
            raise ValueError("a captured exchange needs the routing and at most max_num_batched_tokens rows")
        dst, flag = self.window.peer_slot(self.peer_world(0), self.role_rank, 0)
        shared = self.shared_experts is not None
        rows = x if x.stride(1) == 1 else x.contiguous()  # the kernel takes any row stride: no copy for a view
        chain.send_request(rows, routing.topk_ids.contiguous(), routing.topk_weights.contiguous(), dst.x,
                           dst.topk_ids, dst.topk_weights, self._device_seq, self._arrive, dst.header, flag, layer_idx,
                           shared_on_ffn=not shared)  # fmt: skip
        addend = self.shared_experts(layer_idx, x) if shared else None  # on this stream while the FFN rank works
        reply = self.window.wait_flag(0, 0, 1, torch.cuda.current_stream(self.device))
        out = torch.empty(x.shape, dtype=torch.float32 if shared else x.dtype, device=x.device)
        chain.take_reply(reply.header, self.window.local_flag(0, 0), reply.out, out, self._device_seq, self._errors,
                         layer_idx)  # fmt: skip
        self.captured_sends += 1
        return out if addend is None else out.add_(addend.float()).to(x.dtype)

    def warm_up_graph_kernels(self) -> None:
        """Compile the captured exchange's kernels on scratch (a compile must not happen during a capture)."""
        from afd.connectors.asynchronous import chain_kernels as chain

        lay = self.window.layout
        header = torch.zeros(HEADER_WORDS, dtype=torch.int32, device=self.device)
        flag = torch.zeros(1, dtype=torch.int64, device=self.device)
        counter, errors = torch.zeros_like(flag), torch.zeros_like(flag)
        rows = torch.zeros(2, self.hidden_size, dtype=lay.reply_dtype, device=self.device)
        shared = self.shared_experts is not None
        x = torch.zeros(2, self.hidden_size, dtype=self.dtype, device=self.device)
        ids = torch.zeros(2, lay.topk, dtype=torch.int64, device=self.device)
        weights = torch.zeros(2, lay.topk, dtype=torch.float32, device=self.device)
        chain.send_request(x, ids, weights, torch.empty_like(x), ids.int(), weights.clone(), counter, self._arrive,
                           header, flag, 0, shared_on_ffn=not shared)  # fmt: skip
        out_dtype = torch.float32 if shared else self.dtype
        chain.take_reply(header, flag, rows, torch.empty(2, self.hidden_size, dtype=out_dtype, device=self.device),
                         counter, errors, 0)  # fmt: skip
        torch.cuda.synchronize(self.device)

    def before_replay(self) -> None:
        """Before a captured step is replayed: its first request takes the seq after the host's last one; a reply
        check that failed in an earlier replay raises here."""
        self._check_graph_errors(block=False)
        with torch.inference_mode():  # the counter may be an inference tensor (made in the engine's inference mode)
            self._device_seq.fill_(self.window.seq)  # a fill kernel carries the value: no host buffer to keep alive

    def after_replay(self, sends: int) -> None:
        """After a captured step of `sends` exchanges was replayed: advance the host's seq past them; read the
        device error count back behind the step (checked at the next `before_replay`)."""
        self.window.advance_seq(sends)
        if len(self._graph_checks) >= HEADER_RING:
            self._check_graph_errors(block=True)
        host = torch.zeros(1, dtype=torch.int64, pin_memory=True)
        host.copy_(self._errors, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self._graph_checks.append((done, host))

    def _check_graph_errors(self, *, block: bool) -> None:
        while self._graph_checks:
            done, host = self._graph_checks[0]
            if not done.query():
                if not block:
                    return
                self._wait_done(done, "the reply check of a replayed decode step")
            self._graph_checks.popleft()
            if int(host[0]):
                raise WindowProtocolError(
                    f"{int(host[0])} replies to captured decode steps failed the device-side header check (magic, "
                    "version, response flag, echoed seq, layer, rows)"
                )

    def _free_stage(self, ffn_rank: int) -> int:
        for stage in range(self.window.geometry.ring_depth):
            if (ffn_rank, stage) not in self._in_flight:
                return stage
        raise RingExhausted(
            f"attention rank {self.role_rank} has {self.window.geometry.ring_depth} message(s) in flight to FFN "
            f"rank {ffn_rank} already (ring_depth={self.window.geometry.ring_depth}); every send needs its recv "
            "first — ring_depth must cover the stages in flight"
        )

    def send(self, layer_idx: int, x: torch.Tensor, routing: Routing | None) -> PendingExchange:
        """Dispatch x: [T, H] model dtype with routing (topk_ids [T, K] int64, topk_weights [T, K] fp32)."""
        if routing is None:
            raise ValueError("the async connector needs the gate on attention; set compute_gate_on_attention=true")
        if x.dim() != 2 or x.shape[1] != self.hidden_size or x.dtype != self.dtype:
            raise ValueError(
                f"exchange input must be [T, {self.hidden_size}] {self.dtype}, got {list(x.shape)} {x.dtype}"
            )
        topk_ids, topk_weights = routing.topk_ids, routing.topk_weights
        num_tokens = x.shape[0]
        if topk_ids.shape != (num_tokens, self.topk):
            raise ValueError(f"topk_ids must be [{num_tokens}, {self.topk}], got {list(topk_ids.shape)}")
        if num_tokens > self.window.layout.token_cap:
            raise ValueError(f"{num_tokens} tokens exceed max_num_batched_tokens={self.window.layout.token_cap}")
        if self.timeline is not None:
            self.timeline.mark("send", layer_idx)  # on the device: the layer's attention is done
        shared_here = self.shared_experts is not None
        plan = plan_dispatch(
            topk_ids,
            self.expert_map,
            counts_host=self._counts_host,
            shared_on_ffn=not shared_here,
            row_index=self._row_index,
        )
        headers = {
            f: SlotHeader(
                layer_idx=layer_idx, num_tokens=num_tokens, num_rows=plan.rows[f], shared_rows=plan.shared_rows[f]
            )
            for f in plan.dest_ranks()
        }
        # all or nothing: every destination must fit and have a free ring slot before the first write,
        # else an overflow on a later destination would leave earlier messages published and in flight
        for f, header in headers.items():
            self.window.layout.check_fits(header, self.peer_world(f))
        stages = {f: self._free_stage(f) for f in headers}
        # one gather of every destination's rows; each message is a segment of it (one FFN rank: the rows are x's)
        gather = (lambda t: t) if self.topology.num_ffn == 1 else (lambda t: t.index_select(0, plan.token_index))
        rows_x = gather(x)  # [N, H]
        rows_ids = gather(topk_ids)  # [N, K] int64: the copy into the slot converts (int32 there), no kernel of its own
        rows_w = gather(topk_weights)  # [N, K] fp32
        sent: dict[int, InFlight] = {}
        for f, header in headers.items():
            seg = plan.segment(f)
            seq = self.window.write_slot(
                self.peer_world(f),
                self.role_rank,
                stages[f],
                header,
                rows=rows_x[seg],
                topk_ids=rows_ids[seg],
                topk_weights=rows_w[seg],
            )
            self._in_flight.add((f, stages[f]))
            sent[f] = InFlight(stages[f], seq)
        pending = PendingExchange(layer_idx, num_tokens, x.dtype, plan, sent)
        self._pending.append(pending)
        if self.timeline is not None:
            self.timeline.mark("sent", layer_idx)  # on the device: the rows and flags are written
        if self.shared_experts is not None:  # on this rank's stream while the FFN ranks run the routed experts
            pending.shared = self.shared_experts(layer_idx, x)
            if self.timeline is not None:
                self.timeline.mark("shared", layer_idx)  # on the device: the shared experts are done
        return pending

    def recv(self) -> torch.Tensor:
        """Combine the oldest pending send: [T, H] in the model dtype. The partial sums of the FFN ranks
        are added in fp32 in ascending FFN rank order, whatever order they arrive in: the same bits on
        every run.

        With several sends in flight (micro-batches), an FFN rank may answer a later one first: that reply
        stays where it landed in this rank's window (its stage is not reused before it is combined) and is
        taken when its own `recv` comes.
        """
        pending = self._pending.popleft()
        if self._device_waits:
            result = self._recv_on_device(pending)
            if self.timeline is not None:
                self.timeline.mark("reply", pending.layer_idx)  # on the device: the reply is in and copied out
            return result
        plan = pending.plan
        waiting = dict(pending.sent)
        replies: dict[int, Message] = {}  # views into this rank's window: nobody writes there before the next send
        for f, sent in list(waiting.items()):  # answers that arrived while an earlier send was received
            msg = self._early.pop((f, sent.stage), None)
            if msg is not None:
                replies[f] = self._take_reply(pending, f, msg)
                del waiting[f]
        deadline = time.monotonic() + self.timeout_s
        while waiting:
            msg = self.window.poll(self.poll_timeout_s)
            if msg is None:
                self.check_peers_alive(sorted(waiting))
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"attention rank {self.role_rank} waited {self.timeout_s:.0f}s for layer {pending.layer_idx} "
                        f"results from FFN ranks {sorted(waiting)}"
                    )
                continue
            f, h = msg.region, msg.header
            if h.is_shutdown:
                self.peers_closed.add(f)
                raise ConnectorShutdown(f"FFN rank {f} announced shutdown")
            owner = self._sender_of(f, msg.stage, (pending, *self._pending))
            if owner is None or not h.is_response:
                raise WindowProtocolError(f"unexpected message from FFN rank {f} (stage {msg.stage}, flags {h.flags})")
            if owner is not pending:
                self._early[(f, msg.stage)] = msg
                continue
            replies[f] = self._take_reply(pending, f, msg)
            del waiting[f]
        acc = torch.zeros(pending.num_tokens, self.hidden_size, dtype=torch.float32, device=self.device)  # [T, H]
        for f in sorted(replies):
            combine_scatter(acc, replies[f].rows, plan.token_index[plan.segment(f)])
        if self.timeline is not None:
            self.timeline.mark("reply", pending.layer_idx)
        return self._with_shared(acc, pending)

    @staticmethod
    def _with_shared(acc: torch.Tensor, pending: PendingExchange) -> torch.Tensor:
        """The routed experts' fp32 sum `acc [T, H]` plus the shared experts run here, rounded once to the model
        dtype (the reference's order: routed, then shared). Never in place: `acc` may be a view of the window."""
        if pending.shared is not None:
            acc = acc + pending.shared.float()
        return acc.to(pending.dtype)

    def _recv_on_device(self, pending: PendingExchange) -> torch.Tensor:
        """`recv` without the host (NVSHMEM): the stream waits for each reply's flag (a reply is stamped with its
        request's seq, so the value is known) and the combine is enqueued behind it. The reply headers are read
        back behind the combine and checked at a later recv (`_check_replies`), off the critical path."""
        self._check_replies(block=False)
        plan, stream = pending.plan, torch.cuda.current_stream(self.device)
        if self.topology.num_ffn == 1 and pending.sent:  # one answer, row t for token t: it is the sum
            sent = pending.sent[0]
            views = self.window.wait_flag(0, sent.stage, sent.seq, stream)
            # a copy, never a view of the window: the next reply into this slot must not change the result
            reply = views.out[: pending.num_tokens]
            result = reply.to(pending.dtype, copy=True) if pending.shared is None else self._with_shared(reply, pending)
            self._read_back_header(pending, 0, views.header)
            self.window.local_flag(0, sent.stage).zero_()  # consumed (a graphed exchange waits for "nonzero")
            self._in_flight.discard((0, sent.stage))
            return result
        acc = torch.zeros(pending.num_tokens, self.hidden_size, dtype=torch.float32, device=self.device)  # [T, H]
        for f in sorted(pending.sent):
            sent = pending.sent[f]
            views = self.window.wait_flag(f, sent.stage, sent.seq, stream)
            combine_scatter(acc, views.out[: plan.rows[f]], plan.token_index[plan.segment(f)])
            self._read_back_header(pending, f, views.header)
            self.window.local_flag(f, sent.stage).zero_()  # consumed
            # the stage may take the next send now: that send's writes are enqueued after this combine, and the
            # FFN rank can only overwrite this reply after it has seen that send
            self._in_flight.discard((f, sent.stage))
        return self._with_shared(acc, pending)

    def _read_back_header(self, pending: PendingExchange, f: int, header: torch.Tensor) -> None:
        """Copy FFN rank f's reply header to the host behind the work on the stream; `_check_replies` checks it.
        Each copy has its own row of a ring of HEADER_RING host buffers, so the host runs that many replies ahead
        of its stream before it waits for one (a buffer per slot made it wait for the previous layer's reply)."""
        if self._header_ring is None:
            self._header_ring = torch.zeros(HEADER_RING, header.numel(), dtype=header.dtype, pin_memory=True)
        if len(self._unchecked) >= HEADER_RING:
            self._check_replies(block=True, count=1)  # the oldest holds the row about to be reused
        row = self._header_turn
        self._header_turn = (row + 1) % HEADER_RING
        self._header_ring[row].copy_(header, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self._unchecked.append(((f, pending.sent[f].stage), done, pending, row))

    def _check_replies(self, *, block: bool, count: int | None = None) -> None:
        """Check the reply headers read back so far (with `block`: all of them, or the oldest `count`): magic,
        version, echo of the request's seq, layer and row counts, as the host-polled path checks them."""
        checked = 0
        while self._unchecked and (count is None or checked < count):
            (f, stage), done, pending, row = self._unchecked[0]
            if not done.query():
                if not block:
                    return
                self._wait_done(done, f"the reply header of FFN rank {f} (layer {pending.layer_idx})")
            self._unchecked.popleft()
            checked += 1
            sent = pending.sent[f]
            header = decode_header(self._header_ring[row].tolist(), expect_seq=sent.seq)
            msg = Message(f, stage, header, self._empty, self._empty, self._empty)
            # the stage was freed when its wait was enqueued and may hold a later send by now: leave it in flight
            self._take_reply(pending, f, msg, free_stage=False)

    def _wait_done(self, event: torch.cuda.Event, what: str) -> None:
        """Wait for `event` from the host, bounded by the connector's timeout, checking the FFN ranks are alive."""
        deadline = time.monotonic() + self.timeout_s
        next_check = time.monotonic() + self.poll_timeout_s
        while not event.query():
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(f"attention rank {self.role_rank} waited {self.timeout_s:.0f}s for {what}")
            if now > next_check:
                self.check_peers_alive()
                next_check = now + self.poll_timeout_s
            time.sleep(2e-5)

    @staticmethod
    def _sender_of(ffn_rank: int, stage: int, candidates: tuple[PendingExchange, ...]) -> PendingExchange | None:
        """The pending send whose message to `ffn_rank` sits in ring `stage` (at most one: a stage in flight is
        never reused)."""
        return next((p for p in candidates if (s := p.sent.get(ffn_rank)) is not None and s.stage == stage), None)

    def _take_reply(self, pending: PendingExchange, f: int, msg: Message, *, free_stage: bool = True) -> Message:
        """Check FFN rank f's reply against what `pending` sent it, and free its ring stage (unless `free_stage` is
        False: a header checked late, whose stage may already carry a later send)."""
        h, sent, plan = msg.header, pending.sent[f], pending.plan
        if not seq_matches(h.echo_seq, sent.seq):
            raise WindowProtocolError(
                f"FFN rank {f}'s response echoes seq {h.echo_seq} but the request in flight in its stage "
                f"{sent.stage} had seq {sent.seq} (mod 2**32: {seq32(sent.seq)})"
            )
        if h.layer_idx != pending.layer_idx or h.num_rows != plan.rows[f] or h.shared_rows != plan.shared_rows[f]:
            raise WindowProtocolError(
                f"FFN rank {f} answered layer {h.layer_idx} with {h.num_rows} rows ({h.shared_rows} shared); "
                f"sent layer {pending.layer_idx} with {plan.rows[f]} ({plan.shared_rows[f]} shared)"
            )
        if free_stage:
            self._in_flight.discard((f, sent.stage))
        return msg
