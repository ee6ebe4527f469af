"""The front end's side of the replicas: send requests over their links, route answers to the waiting requests.

`ReplicaPool` lives on the server's event loop: it reads every replica's link there and sends from there
(`ReplicaPool.start` says how a busy replica still never blocks the loop); the request table, the load counts
the router reads and the metrics are touched on the loop's thread only. A request's answers
arrive on its own `asyncio.Queue` as `Event`s. A link that closes (the replica died) ends every request
on it with an error event, so no client waits forever. A restarted replica's new link replaces the old one
(`attach`); a replica that is not `accepting` (draining, restarting) gets no new request.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from afd.engine.sampling import SAMPLING_FIELDS, SamplingParams
from afd.runtime.link import RECV_BYTES, FrameSender, Message, decode_frames, encode_frame
from afd.serve.balancer import outstanding_tokens, pick_replica
from afd.serve.metrics import ServeMetrics

logger = logging.getLogger(__name__)

LOSS_CAUSE_WAIT_S = 0.5  # how long a lost replica's requests wait to be told the cause (a rank's death) at most


@dataclass
class Event:
    """`tokens`: `items` of (token_id, logprob); `finished`: `reason` stop | length | abort | error, where an
    error carries `message` and the HTTP `status` it maps to (400: the replica refused the request, 503: the
    replica or a rank is gone, or the server is stopping)."""

    kind: str
    items: list[tuple[int, float]] = field(default_factory=list)
    reason: str = ""
    message: str = ""
    status: int = 0
    prompt_logprobs: list[float | None] | None = None  # `finished`, when the request asked for them


@dataclass
class Submitted:
    """One request on one replica, as the front end tracks it."""

    rid: str
    replica: int
    prompt_len: int
    max_tokens: int
    arrival: float
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    generated: int = 0
    last_token_at: float = 0.0
    engine_ttft_s: float | None = None  # the replica's own time to this request's first token
    # moments on the way to the first token (`time.perf_counter()`, the host's CLOCK_MONOTONIC): `handler`, `sent`,
    # `replica_took`, `replica_stepped`, `front_got`, then the stream's `written` (`afd bench serve` cuts TTFT there)
    stamps: dict[str, float] = field(default_factory=dict)

    @property
    def outstanding(self) -> int:
        return outstanding_tokens(self.prompt_len, self.max_tokens, self.generated)


class ReplicaPool:
    """Every replica's link, what is running where, and how loaded each replica is."""

    def __init__(self, conns: dict[int, Connection], hellos: dict[int, Message]) -> None:
        self.num_replicas = len(conns)
        self.conns = [conns[r] for r in range(self.num_replicas)]
        self.hellos = [hellos[r] for r in range(self.num_replicas)]
        self.max_model_len = min(int(h["max_model_len"]) for h in self.hellos)
        self.vocab_size = min(int(h["vocab_size"]) for h in self.hellos)
        self.max_request_tokens = min(int(h["num_cache_tokens"]) for h in self.hellos)  # one request's cache rows
        self.max_num_seqs = [int(h["max_num_seqs"]) for h in self.hellos]
        self.alive = [True] * self.num_replicas  # its link is up
        self.accepting = [True] * self.num_replicas  # new requests may go to it (not draining, not restarting)
        self.metrics = ServeMetrics(self.num_replicas)
        self.requests: dict[str, Submitted] = {}  # through `_track` / `_untrack` only: they keep the sums below
        # per replica, over its requests: outstanding tokens (the balancer's load) and requests held; kept as
        # requests come, advance and end, so a burst of a thousand submits is not a thousand walks over the others
        self._load = [0] * self.num_replicas
        self._held = [0] * self.num_replicas
        self.stopping = False
        self._byes = [threading.Event() for _ in range(self.num_replicas)]
        self._socks: list[socket.socket] = []
        self._senders: list[FrameSender] = []
        self._inbuf = [bytearray() for _ in range(self.num_replicas)]
        self._loop: asyncio.AbstractEventLoop | None = None
        # why replica r's link may have closed, in one sentence (the server: a rank that died), or None
        self.cause_of_loss: Callable[[int], str | None] = lambda replica: None

    # --- the links, on the event loop
    def start(self) -> None:
        """Read and write every replica's link on the running event loop; call from the loop that serves.

        A reader callback takes whatever bytes arrived and hands each whole message on at once; sends go out
        straight from the loop when the socket takes them, and only what a busy replica's socket cannot take yet
        waits in a thread (`FrameSender`), so a large prompt never blocks the loop. No thread sits between a
        request and its replica: each hand-off between threads cost ~0.1-0.3 ms of time to first token."""
        self._loop = asyncio.get_running_loop()
        for r, conn in enumerate(self.conns):
            sock, sender = self._open(r, conn)
            self._socks.append(sock)
            self._senders.append(sender)

    def _open(self, replica: int, conn: Connection) -> tuple[socket.socket, FrameSender]:
        assert self._loop is not None
        sock = socket.socket(fileno=os.dup(conn.fileno()))  # ours to close; the Connection stays the link's
        sock.setblocking(False)
        sender = FrameSender(sock, functools.partial(self._broken, replica), f"afd-link-send-{replica}")
        self._loop.add_reader(sock.fileno(), self._readable, replica)
        return sock, sender

    def attach(self, replica: int, conn: Connection, hello: Message) -> bool:
        """On the loop: a restarted replica's new link replaces its lost one; it serves again at once. False (and
        the link left alone) when the replica is still alive or the pool is closed."""
        if self.alive[replica] or self.stopping or not self._socks:
            logger.warning("replica %d said hello while its link is up; ignored", replica)
            return False
        self._stop_reading(replica)
        self._senders[replica].close(0.0)
        self._socks[replica].close()
        self.conns[replica], self.hellos[replica] = conn, hello
        self._inbuf[replica] = bytearray()
        self._byes[replica] = threading.Event()
        self._socks[replica], self._senders[replica] = self._open(replica, conn)
        self.alive[replica] = self.accepting[replica] = True
        return True

    def serving(self) -> list[bool]:
        """Per replica: whether a new request may go to it."""
        return [a and b for a, b in zip(self.alive, self.accepting, strict=True)]

    def _readable(self, replica: int) -> None:
        try:
            data = self._socks[replica].recv(RECV_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # the replica's process ended, or its link was shut
            self._stop_reading(replica)
            self._gone(replica)
            return
        buffer = self._inbuf[replica]
        buffer += data
        for message in decode_frames(buffer):
            if isinstance(message, dict) and message.get("type") == "bye":
                self._stop_reading(replica)
                return
            try:
                self._on_message(replica, message)
            except Exception:  # one message that cannot be handled must not drop the rest of what arrived
                logger.exception("replica %d sent a message that could not be handled", replica)

    def _stop_reading(self, replica: int) -> None:
        self._byes[replica].set()  # nothing more will come: a shutdown need not wait for it
        if self._loop is not None and not self._loop.is_closed() and self._socks[replica].fileno() >= 0:
            self._loop.remove_reader(self._socks[replica].fileno())

    def _broken(self, replica: int) -> None:
        """From any thread: sending to the replica failed."""
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._gone, replica)
            except RuntimeError:  # the loop closed meanwhile
                pass

    def _gone(self, replica: int) -> None:
        """On the loop: the replica's link broke (unless the server is stopping, that is a failure). No request goes
        to it from now on; its requests end once the cause is known (`_end_lost`)."""
        if self.stopping or not self.alive[replica]:
            return
        self.alive[replica] = False
        assert self._loop is not None
        self._loop.create_task(self._end_lost(replica))

    def lose(self, replica: int, why: str) -> None:
        """On the loop: the replica cannot serve (a rank of it died, or it is being restarted): no request goes to
        it from now on, and its requests end with `why`."""
        self.alive[replica] = False
        self.fail(why, replica)

    async def _end_lost(self, replica: int) -> None:
        """End a lost replica's requests with the cause: a replica's link usually closes because a rank of its world
        died and the replica exited after it, so the death is looked for, briefly, before the requests are told."""
        deadline = time.monotonic() + LOSS_CAUSE_WAIT_S
        cause = self.cause_of_loss(replica)
        while cause is None and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
            cause = self.cause_of_loss(replica)
        why = cause or f"replica {replica} closed its link"
        logger.error("%s; the requests of replica %d end with an error", why, replica)
        self.fail(why, replica)

    def close(self) -> None:
        """Stop reading and sending (on the loop, at the end of serving); the links themselves stay the caller's."""
        for r, sock in enumerate(self._socks):
            self._stop_reading(r)
            self._senders[r].close()
            sock.close()
        self._socks, self._senders = [], []

    def _on_message(self, replica: int, message: Message) -> None:
        kind = message.get("type")
        if kind == "tokens":
            self._on_tokens(replica, message["items"], message.get("engine_stamps") or {})
        elif kind == "finished":
            self._on_finished(message)
        elif kind == "load":
            m = self.metrics.replicas[replica]
            m.running.set(int(message["running"]))
            m.waiting.set(int(message["waiting"]))
            m.cache_usage.set(float(message["cache_usage"]))
            m.graphs_captured.set(int(message.get("graphs_captured", 0)))
            m.step_device.set(float(message.get("step_device_s", 0.0)))
            m.steps.set(int(message.get("steps", 0)))
            m.step_idle.set(float(message.get("step_idle_s", 0.0)))
            m.prompt_step_device.set(float(message.get("prompt_step_device_s", 0.0)))
            m.prompt_steps.set(int(message.get("prompt_steps", 0)))
        else:
            logger.warning("replica %d sent an unknown message %r", replica, kind)

    def _on_tokens(self, replica: int, items: list, engine_stamps: dict[str, list[float]]) -> None:
        now = time.perf_counter()
        m = self.metrics.replicas[replica]
        grouped: dict[str, list[tuple[int, float]]] = {}
        for rid, token_id, logprob in items:
            grouped.setdefault(rid, []).append((int(token_id), float(logprob)))
        for rid, tokens in grouped.items():
            sub = self.requests.get(rid)
            if sub is None:
                continue  # aborted here already; the replica had not seen the abort yet
            if sub.generated == 0:
                m.ttft.observe(now - sub.arrival)
                if rid in engine_stamps:
                    took, stepped = engine_stamps[rid]
                    sub.stamps.update(replica_took=took, replica_stepped=stepped)
                    sub.engine_ttft_s = stepped - took
                    m.engine_ttft.observe(sub.engine_ttft_s)
                sub.stamps["front_got"] = now
            else:
                m.itl.observe(now - sub.last_token_at)
            before = sub.outstanding
            sub.generated += len(tokens)
            self._load[sub.replica] += sub.outstanding - before
            sub.last_token_at = now
            sub.queue.put_nowait(Event("tokens", items=tokens))
        m.generation_tokens.inc(len(items))  # once per message: a counter's lock per stream cost ~2 us each

    def _on_finished(self, message: Message) -> None:
        sub = self._untrack(message["rid"])
        if sub is None:
            return
        reason = message["reason"]
        status = 400 if reason == "error" else 503  # a replica aborts on its own only when it stops
        if reason == "abort":
            reason, text = "error", "the request was aborted by its replica (the server is stopping)"
        else:
            text = message.get("message", "")
        self._count_end(sub, reason)
        scored = message.get("prompt_logprobs")
        sub.queue.put_nowait(Event("finished", reason=reason, message=text, status=status, prompt_logprobs=scored))

    def _count_end(self, sub: Submitted, reason: str) -> None:
        m = self.metrics.replicas[sub.replica]
        m.finished(reason)
        m.e2e.observe(time.perf_counter() - sub.arrival)

    # --- requests
    def waiting(self, more: int = 0) -> int:
        """Requests beyond what the replicas run at once (they wait in a replica's queue); with `more`, how many
        would wait once `more` requests were added (they take the free running places first)."""
        pairs = list(zip(self._held, self.max_num_seqs, strict=True))
        waiting = sum(max(0, n - cap) for n, cap in pairs)
        free = sum(max(0, cap - n) for (n, cap), ok in zip(pairs, self.serving(), strict=True) if ok)
        return waiting + max(0, more - free)

    def loads(self) -> list[int]:
        """Outstanding tokens per replica (`afd.serve.balancer`)."""
        return list(self._load)

    def _track(self, sub: Submitted) -> None:
        self.requests[sub.rid] = sub
        self._load[sub.replica] += sub.outstanding
        self._held[sub.replica] += 1

    def _untrack(self, rid: str) -> Submitted | None:
        sub = self.requests.pop(rid, None)
        if sub is not None:
            self._load[sub.replica] -= sub.outstanding
            self._held[sub.replica] -= 1
        return sub

    def submit(
        self,
        rid: str,
        prompt_ids: list[int],
        max_tokens: int,
        sampling: SamplingParams,
        stop_token_ids: list[int],
        prompt_logprobs: bool = False,
        http_stamps: dict[str, float] | None = None,
    ) -> Submitted:
        """Send a request to the least loaded serving replica; its answers come on the returned `queue`.
        `http_stamps`: its moments in the HTTP layer (`arrived`, `handler`; `time.perf_counter()`), the first of its
        stamps.

        Raises LookupError when no replica is alive."""
        try:
            replica = pick_replica(self.loads(), self.serving())
        except ValueError:
            raise LookupError("no replica serves now") from None
        sub = Submitted(rid, replica, len(prompt_ids), max_tokens, time.perf_counter())
        self._track(sub)
        self.metrics.replicas[replica].prompt_tokens.inc(len(prompt_ids))
        message = {
            "type": "add",
            "rid": rid,
            "prompt_ids": prompt_ids,
            "max_tokens": max_tokens,
            "sampling": {name: getattr(sampling, name) for name in SAMPLING_FIELDS},  # asdict: a deep copy
            "stop_token_ids": stop_token_ids,
            "prompt_logprobs": prompt_logprobs,
        }
        sub.stamps["sent"] = time.perf_counter()  # before the send: the replica may take it before send returns
        self._send(replica, message)
        if http_stamps:
            sub.stamps.update(http_stamps)
        return sub

    def abort(self, rid: str, reason: str = "abort") -> None:
        """Stop a request (a stop string matched, or its client left): the replica frees its cache."""
        sub = self._untrack(rid)
        if sub is None:
            return
        self._count_end(sub, reason)
        self._send(sub.replica, {"type": "abort", "rid": rid})

    def _send(self, replica: int, message: Message) -> bool:
        """Queue a message for the replica's sender thread; False when the replica is gone."""
        if not self.alive[replica] or not self._senders:
            return False
        return self._senders[replica].send(encode_frame(message))

    # --- failures and shutdown
    def fail(self, why: str, replica: int | None = None) -> None:
        """End every request (of one replica, or all) with an error event carrying `why`."""
        for rid, sub in list(self.requests.items()):
            if replica is None or sub.replica == replica:
                self._untrack(rid)
                self._count_end(sub, "error")
                sub.queue.put_nowait(Event("finished", reason="error", message=why, status=503))

    def shutdown(self, timeout_s: float) -> list[int]:
        """Send `shutdown` to every live replica and wait (bounded) for each `bye`; returns the replicas that
        did not answer. Blocking: call it off the event loop (`asyncio.to_thread`)."""
        self.stopping = True
        for r in range(self.num_replicas):
            self._send(r, {"type": "shutdown"})
        deadline = time.monotonic() + timeout_s
        silent = []
        for r in range(self.num_replicas):
            if self.alive[r] and not self._byes[r].wait(max(0.0, deadline - time.monotonic())):
                silent.append(r)
        return silent
