"""A replica serving a front end: requests arrive at any time, tokens leave after every step.

`serve_replica` is the loop of one attention replica (or one whole-model replica, connector `none`):
between two steps it drains its link to the front end (`afd.runtime.link`: add / abort / shutdown), then
steps the engine and sends what the step made — one `tokens` message per step, a `finished` per ended
request, `load` whenever running / waiting / cache usage changed.

When idle, a replica of its own (`async`, `none`) blocks on its link, so an idle server burns no CPU (with
`--busy-poll` it polls without sleeping instead: a core, for a request taken up without a wake-up).
A `p2p` replica belongs to a DP wave: every replica and FFN rank steps together, so it keeps stepping
(0 tokens) while the server runs, pausing `IDLE_WAVE_S` between waves in which no replica had work.

The end — a `shutdown` message, the link closing, or SIGTERM / SIGINT / SIGHUP — aborts every request,
ends the wave (p2p: once every replica agrees) as the end of a prompts file does, and answers `bye`.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Protocol

from afd import env
from afd.distributed import signals
from afd.engine.engine import Engine, EngineLoad, Output, Request
from afd.engine.sampling import SAMPLING_FIELDS, SamplingParams
from afd.runtime.link import LinkError, Message, ReplicaLink, format_address
from afd.runtime.rank import RankJob, profile_rank

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.1  # an idle replica of its own blocks on its link this long at a time (a stop signal is seen within it)
IDLE_WAVE_S = 0.0015  # p2p: the pause after a DP wave in which no replica had work
LINGER_MS = 1  # with a step in flight: how long a link read waits for more of a burst (`ReplicaLink.poll`)


class Wave(Protocol):
    """The p2p DP wave (`P2pAttentionExchange`): `step_wave` is True while any replica wants to step."""

    wave_idle: bool

    def step_wave(self, has_work: bool, keep_alive: bool = False) -> bool: ...


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def request_from_message(msg: Message) -> Request:
    """The engine request of an `add` message; ValueError in one sentence for a malformed one (the engine's
    own checks — vocabulary, cache, model length — come after, in `Engine.add`)."""
    prompt = msg.get("prompt_ids")
    if not isinstance(prompt, list) or not all(_is_int(t) for t in prompt):
        raise ValueError("prompt_ids must be a list of integer token ids")
    max_tokens = msg.get("max_tokens")
    if not _is_int(max_tokens):
        raise ValueError(f"max_tokens must be an integer, got {max_tokens!r}")
    sampling = msg.get("sampling") or {}
    if not isinstance(sampling, dict) or not set(sampling) <= set(SAMPLING_FIELDS):
        raise ValueError(f"sampling must be an object with some of the fields {', '.join(SAMPLING_FIELDS)}")
    stop = msg.get("stop_token_ids") or []
    if not isinstance(stop, list) or not all(_is_int(t) for t in stop):
        raise ValueError("stop_token_ids must be a list of integer token ids")
    return Request(
        prompt_ids=prompt,
        max_new_tokens=max_tokens,
        prompt_logprobs=bool(msg.get("prompt_logprobs", False)),
        sampling=SamplingParams(**sampling),  # ValueError naming the bad value
        stop_token_ids=stop,
    )


class OnlineReplica:
    """The replica's side of the link: the front end's request ids against the engine's, and the messages."""

    def __init__(self, engine: Engine, link: ReplicaLink) -> None:
        self.engine, self.link = engine, link
        self.engine_ids: dict[str, int] = {}  # front-end rid -> engine request id, while it lives
        self.rids: dict[int, str] = {}
        self.stopping = False
        self.link_up = True
        self._sent_load: EngineLoad | None = None
        self._received_at: dict[str, float] = {}  # rid -> when its `add` was taken, until its first token

    # --- front end -> replica ---
    def receive(self, timeout_s: float) -> bool:
        """Handle every message waiting, waiting up to `timeout_s` for the first; whether any came. With a step in
        flight, a burst is read to its end (`LINGER_MS`) while the device works on it, never past its end."""
        try:
            messages = self.link.poll(
                timeout_s, LINGER_MS if self.engine.step_in_flight else 0, self.engine.step_running
            )
        except LinkError:
            self._link_lost("the front end closed its link")
            return False
        for msg in messages:
            kind = msg.get("type") if isinstance(msg, dict) else None
            if kind == "add":
                self._add(msg)
            elif kind == "abort":
                self._abort(msg.get("rid"))
            elif kind == "shutdown":
                log.info("the front end asked this replica to shut down")
                self.stopping = True
            else:
                log.warning("ignoring a link message of unknown type %r", kind)
        return bool(messages)

    def _add(self, msg: Message) -> None:
        received = time.perf_counter()  # the engine's share of TTFT starts here, as `Engine.add` is the engine's
        rid = msg.get("rid")
        try:
            if not isinstance(rid, str) or not rid:
                raise ValueError(f"an add message needs a non-empty string rid, got {rid!r}")
            if rid in self.engine_ids:
                raise ValueError(f"request {rid!r} is already running on this replica")
            engine_id = self.engine.add(request_from_message(msg))
        except ValueError as exc:  # a refused request ends alone; the replica keeps serving
            self.send({"type": "finished", "rid": rid, "reason": "error", "message": str(exc)})
            return
        self.engine_ids[rid], self.rids[engine_id] = engine_id, rid
        self._received_at[rid] = received

    def _abort(self, rid: object) -> None:
        engine_id = self.engine_ids.get(rid) if isinstance(rid, str) else None
        out = self.engine.abort(engine_id) if engine_id is not None else None
        if out is not None:  # else already finished (its `finished` is on the way) or never known: a no-op
            self._finished(out)

    def abort_all(self) -> None:
        for engine_id in list(self.rids):
            out = self.engine.abort(engine_id)
            if out is not None:
                self._finished(out)

    # --- replica -> front end ---
    def report(self, finished: list[Output]) -> None:
        """After a step: its tokens (in step order), then the requests it ended, then the load if it changed."""
        now = time.perf_counter()
        items = [[self.rids[t.request_id], t.token_id, t.logprob] for t in self.engine.last_step_tokens]
        if items:
            firsts = {rid: [t, now] for rid, _, _ in items if (t := self._received_at.pop(rid, None)) is not None}
            self.send({"type": "tokens", "items": items, "engine_stamps": firsts})
        for out in finished:
            self._finished(out)
        self.send_load()

    def _finished(self, out: Output) -> None:
        rid = self.rids.pop(out.request_id)
        del self.engine_ids[rid]
        self._received_at.pop(rid, None)
        msg = {"type": "finished", "rid": rid, "reason": out.finish_reason}
        if out.prompt_logprobs is not None:
            msg["prompt_logprobs"] = out.prompt_logprobs
        self.send(msg)

    def send_load(self) -> None:
        load = self.engine.load()
        if load != self._sent_load:
            self._sent_load = load
            self.send({"type": "load", "running": load.running, "waiting": load.waiting,
                       "cache_usage": load.cache_usage, "graphs_captured": load.graphs_captured,
                       "step_device_s": load.step_device_s, "steps": load.steps,
                       "step_idle_s": load.step_idle_s, "prompt_step_device_s": load.prompt_step_device_s,
                       "prompt_steps": load.prompt_steps})  # fmt: skip

    def send(self, msg: Message) -> None:
        if not self.link_up:
            return
        try:
            self.link.send(msg)
        except LinkError:
            self._link_lost("the front end closed its link")

    def _link_lost(self, why: str) -> None:
        if self.link_up:
            log.warning("%s; this replica stops serving", why)
        self.link_up, self.stopping = False, True


def serve_replica(
    engine: Engine,
    link: ReplicaLink,
    wave: Wave | None = None,
    stop_requested: Callable[[], bool] = lambda: False,
    busy_poll: bool = False,
) -> None:
    """Serve the front end until it says `shutdown`, closes the link, or `stop_requested()` (a signal).

    `wave`: the p2p exchange whose DP wave this replica keeps going; None for a replica of its own. Returns
    after aborting every request and ending the wave; `bye` is the last message sent.
    """
    replica = OnlineReplica(engine, link)
    replica.send_load()
    while True:
        received = False
        if not replica.stopping:
            received = replica.receive(_poll_timeout(engine, wave, busy_poll))
            if stop_requested():
                log.info("a stop signal ends serving")
                replica.stopping = True
        if replica.stopping:
            replica.abort_all()
        # an add or an abort changed the load even when no step follows; with work, the step's report says it (after
        # the step, not before the first token). Only then: a busy-polling idle replica would spend most of each turn
        # of this loop on the check (~10 us), half of it on average before it takes up a request.
        if (received or replica.stopping) and not engine.has_work():
            replica.send_load()
        if replica.stopping and wave is not None and wave.wave_idle:
            time.sleep(IDLE_WAVE_S)  # the others may still serve: idle waves keep their pace
        if wave is not None:
            if not wave.step_wave(engine.has_work(), keep_alive=not replica.stopping):
                break
        elif not engine.has_work():
            if replica.stopping:
                break
            continue
        replica.report(engine.step())
    replica.send({"type": "bye"})
    log.info("served until the end; said bye")
    log.info("%s", step_summary(engine))


def step_summary(engine: Engine) -> str:
    """One line on how the replica's steps ran: launched ahead of their predecessor's tokens or not (and why not),
    their device time, and for the steps holding prompt tokens the host's time to schedule and queue them."""
    clock = engine.runner.step_clock
    why = ", ".join(f"{n} {reason}" for reason, n in engine.scheduler.not_ahead.most_common())
    timed = f"; device time {clock.seconds:.2f} s over {clock.steps} steps" if clock.steps else ""
    if clock.steps:
        timed += (
            f", idle {clock.idle_seconds:.2f} s between them ({clock.idle_ahead_seconds:.2f} s before steps"
            f" launched ahead, {clock.idle_prompt_seconds:.2f} s before steps holding prompt tokens)"
        )
    if clock.prompt_steps:
        host = clock.prompt_host_seconds / clock.prompt_host_steps
        device = clock.prompt_seconds / clock.prompt_steps
        timed += (
            f"; steps with prompt tokens: {clock.prompt_steps}, {device * 1e3:.2f} ms of device time and"
            f" {host * 1e3:.2f} ms of host time each (host/device {host / device:.0%})"
        )
    cores = sum((runner.steps_by_cores for runner in engine.prefill_graphs), Counter())
    if cores:  # how the replayed prompt steps ran their attention cores (afd.engine.graphs.layout)
        timed += "; their attention cores: " + ", ".join(f"{kind} {n}" for kind, n in cores.most_common())
    return f"steps launched ahead: {engine.overlapped_steps}{f' (not ahead: {why})' if why else ''}{timed}"


def _poll_timeout(engine: Engine, wave: Wave | None, busy_poll: bool) -> float:
    if engine.has_work():
        return 0.0
    if wave is None:
        return 0.0 if busy_poll else IDLE_POLL_S
    return IDLE_WAVE_S if wave.wave_idle else 0.0  # another replica's work: do not hold up its wave


def stop_on_signals() -> threading.Event:
    """From now to the end of the process, SIGTERM, SIGINT and SIGHUP set the returned event: a rank of a server
    stops at the end of its step instead of raising wherever it is.

    The CLI turns those signals into an exception in the main thread; mid-step that would leave a p2p
    exchange half done (peers waiting for rows that never come), while here the loop ends the wave as a
    normal end does. The handler stays to the end: a signal that arrives while the rank closes its world
    (the front end stops every rank right after `bye`) must not turn exit 0 into 128 + signum. The CLI's
    signal watchdog still ends a rank that is not gone within its grace (3 s) after the signal.
    """
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.warning("%s: stopping at the end of this step", signals.signal_name(signum))
        stop.set()

    if threading.current_thread() is threading.main_thread():
        for sig in signals.HANDLED_SIGNALS:
            if signal.getsignal(sig) is not signal.SIG_IGN:
                signal.signal(sig, on_signal)
    return stop


def run_online(engine: Engine, job: RankJob, wave: Wave | None = None) -> None:
    """Connect to the front end at `job.serve_address` (authenticated by the run's secret), say hello, serve."""
    assert job.serve_address is not None
    hello = {
        "replica": job.role_rank,
        "max_num_seqs": engine.max_num_seqs,
        "max_model_len": engine.max_model_len,
        "vocab_size": engine.model.config.vocab_size,
        "num_cache_tokens": engine.kv_cache.num_tokens,
    }
    stop = stop_on_signals()
    link = ReplicaLink(job.serve_address, env.secret().encode(), hello)
    log.info("%s rank %d serves the front end at %s", job.role, job.role_rank, format_address(job.serve_address))
    try:
        with profile_rank(job):
            serve_replica(engine, link, wave, stop.is_set, busy_poll=job.spec.busy_poll)
    finally:
        link.close()
    if engine.num_ubatches > 1:
        log.info(
            "%s rank %d: %d steps ran as micro-batches while serving", job.role, job.role_rank, engine.ubatched_steps
        )
