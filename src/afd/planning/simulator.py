"""A discrete-event simulation of afd serving a workload: afd's own rules, a profile's costs.

Per replica, the scheduler's rules (`afd.engine.scheduler`): decodes first (one token each), then the next chunk of
every running prompt, then new prompts first come first served while the token budget lasts, a new prompt admitted
only when the blocks of its whole capacity (prompt + max_tokens - 1) are free and `max_num_seqs` allows; finished
requests free their blocks. Where afd overlaps steps (a whole replica on a GPU), each step is scheduled when the one
before it starts, so a request joins no step scheduled before it reached the engine: the step after next. Requests
reach the engines one at a time through the front end's FIFO queue (`engine_arrivals`) and go to the replica with
the fewest outstanding tokens (`afd.serve.balancer`); a request's first and last token reach the client after the
front end's write latency for the streams open then (`Calibration.stream_s`). Steps last what `StepCosts` says:
free-running replicas (none, async: each its own clock, async's FFN term from the tokens of every replica of its
group in flight) or lockstep waves (p2p per group, ep over every GPU). The result is `afd bench serve`'s: one
`run_record` per rate, so one report reads both.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

from afd.bench.serve_client import RequestResult, run_record
from afd.bench.workload import Workload
from afd.planning.costs import Shapes, chunk_pairs
from afd.planning.deployment import Deployment, StepCosts, StepLoad, memory_of
from afd.planning.profile import Profile, front_end_queue
from afd.serve.balancer import pick_replica

EP_SIMULATED_REPLICAS = 8  # ep over more GPUs: this many replicas simulated, the experts' load scaled up


class _Seq:
    __slots__ = (
        "idx", "prompt", "max_tokens", "cached", "generated", "blocks", "arrival", "reached", "last", "result",
    )  # fmt: skip

    def __init__(self, idx: int, prompt: int, max_tokens: int, arrival: float, blocks: int) -> None:
        self.idx, self.prompt, self.max_tokens, self.arrival, self.blocks = idx, prompt, max_tokens, arrival, blocks
        self.reached = arrival  # when it reached its engine
        self.cached = self.generated = 0
        self.last = arrival
        self.result = RequestResult(prompt)


@dataclass
class _Plan:
    decodes: list
    chunks: list  # (seq, tokens)
    load: StepLoad


class _Replica:
    """One engine's queue, running sequences and free blocks, stepped by the scheduler's rules."""

    def __init__(self, d: Deployment, num_blocks: int) -> None:
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.free_blocks = num_blocks
        self.max_seqs, self.budget = d.max_num_seqs, d.max_num_batched_tokens
        self.outstanding = 0  # the balancer's tokens: prompts until their first token, plus tokens left
        self.in_flight: _Plan | None = None
        self.step_tokens = 0
        self.last_start: float | None = None  # the start of the step before, while the replica steps back to back

    def schedule(self, cutoff: float = float("inf")) -> _Plan:
        """The next step by the scheduler's rules; `cutoff`: admit no request that reached the engine later."""
        budget = self.budget
        decodes = [q for q in self.running if q.cached >= q.prompt][:budget]
        budget -= len(decodes)
        ctx = sum(q.cached + 1 for q in decodes)
        chunks, prefill, pairs, done, admitted = [], 0, 0.0, 0, 0
        for q in self.running:
            if budget == 0:
                break
            if q.cached < q.prompt:
                n = min(q.prompt - q.cached, budget)
                chunks.append((q, n))
                done += q.cached + n == q.prompt
                prefill, pairs, budget = prefill + n, pairs + chunk_pairs(q.cached, n), budget - n
        while budget > 0 and self.waiting and len(self.running) < self.max_seqs:
            q = self.waiting[0]
            if q.blocks > self.free_blocks or q.reached > cutoff:
                break
            self.waiting.popleft()
            self.free_blocks -= q.blocks
            self.running.append(q)
            n = min(q.prompt, budget)
            chunks.append((q, n))
            done, admitted = done + (n == q.prompt), admitted + 1
            prefill, pairs, budget = prefill + n, pairs + chunk_pairs(0, n), budget - n
        seqs = len(decodes) + len(chunks)
        held = len(self.running) + len(self.waiting)
        load = StepLoad(len(decodes), ctx, prefill, pairs, seqs, len(decodes) + done, admitted, held)
        return _Plan(decodes, chunks, load)

    def finish(self, plan: _Plan, t: float, write_delay: float = 0.0) -> int:
        """Apply a step that ended at `t`; the number of requests it finished. `write_delay`: what the front end adds
        before it writes a token out (`Calibration.stream_s` per stream open), counted on the first and the last."""
        done = 0
        for q in plan.decodes:
            q.cached += 1
            self._token(q, t)
            done += self._maybe_end(q, write_delay)
        for q, n in plan.chunks:
            q.cached += n
            if q.cached == q.prompt:
                self.outstanding -= q.prompt
                q.result.ttft_s = t - q.arrival + write_delay
                self._token(q, t)
                done += self._maybe_end(q, write_delay)
        return done

    def _token(self, q: _Seq, t: float) -> None:
        if q.generated:
            q.result.itl_s.append(t - q.last)
        q.generated += 1
        q.last = t
        self.outstanding -= 1

    def _maybe_end(self, q: _Seq, write_delay: float) -> int:
        if q.generated < q.max_tokens:
            return 0
        self.running.remove(q)
        self.free_blocks += q.blocks
        r = q.result
        r.output_tokens, r.e2e_s = q.generated, q.last - q.arrival + write_delay
        return 1

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)


def engine_arrivals(arrivals: list[float], p: Profile, ep_scale: float = 1.0) -> list[float]:
    """When each request (client send times `arrivals`) reaches the engines: through the front end's FIFO queue
    (`calibration.arrival_s` per request, one at a time: one front end serves every replica, so with `ep_scale`
    simulated replicas standing for more, each simulated request carries that many requests' cost), then the
    profile's fixed latency before the engine (`front_end_s` and the calibration's)."""
    latency = p.front_end_s + p.calibration.front_end_s
    order = sorted(range(len(arrivals)), key=arrivals.__getitem__)
    done = front_end_queue([arrivals[i] for i in order], p.calibration.arrival_s * ep_scale)
    out = [0.0] * len(arrivals)
    for i, t in zip(order, done, strict=True):
        out[i] = t + latency
    return out


def simulate_rate(
    d: Deployment, s: Shapes, p: Profile, workload: Workload, prompt_lens: list[int], rate: float
) -> dict:
    """One rate's `run_record` (afd bench serve's shape) for the workload's requests with these prompt lengths."""
    arrivals = workload.arrivals(rate)
    max_tokens = workload.max_tokens_of()
    mem = memory_of(d, s, p.gpu_memory_bytes)
    num_blocks = mem.kv_tokens_per_replica // d.block_size
    n_rep = d.num_replicas
    ep_scale = 1.0
    if d.connector == "ep" and n_rep > EP_SIMULATED_REPLICAS:
        ep_scale, n_rep = n_rep / EP_SIMULATED_REPLICAS, EP_SIMULATED_REPLICAS
        arrivals = [a * ep_scale for a in arrivals]  # the simulated replicas get their share of the load
    cost = StepCosts(d, s, p, ep_scale)
    reach = engine_arrivals(arrivals, p, ep_scale)
    reps = [_Replica(d, num_blocks) for _ in range(n_rep)]
    if d.connector == "none" or d.connector == "async":
        per_group = 1 if d.connector == "none" else d.attention
    else:
        per_group = n_rep if d.connector == "ep" else d.attention
    groups = [list(range(g, min(g + per_group, n_rep))) for g in range(0, n_rep, per_group)]
    group_of = [gi for gi, g in enumerate(groups) for _ in g]
    seqs = []
    for i, (a, n, m) in enumerate(zip(arrivals, prompt_lens, max_tokens, strict=True)):
        cap = n + m - 1
        blocks = -(-cap // d.block_size)
        if blocks > num_blocks:
            raise ValueError(f"request {i} needs {blocks} cache blocks but a replica holds {num_blocks}")
        seqs.append(_Seq(i, n, m, a, blocks))
    events: list[tuple[float, int, int]] = []  # (time, kind: 0 step end, 1 arrival at the engine, 2 step start)
    for i in sorted(range(len(seqs)), key=lambda i: reach[i]):
        heapq.heappush(events, (reach[i], 1, i))
    lockstep = d.lockstep
    overlapped = d.connector == "none" and p.on_gpu  # afd.engine.engine's overlapped steps
    busy = [False] * (len(groups) if lockstep else n_rep)
    # summed over the stepping units, as StepClock; prompt_*: the steps holding a prompt token
    steps = {"count": 0, "device_s": 0.0, "replicas": len(busy), "prompt_count": 0, "prompt_device_s": 0.0}
    remaining = len(seqs)

    def start(unit: int, t: float) -> None:
        if lockstep:
            members = [reps[r] for r in groups[unit]]
            plans = [r.schedule() for r in members]
            for r, plan in zip(members, plans, strict=True):
                r.in_flight = plan
            dur = cost.wave([x.load for x in plans])
            prompt = any(x.load.prefill for x in plans)
        else:
            rep = reps[unit]
            # overlapped: scheduled when the step before started (if the replica stepped back to back)
            cutoff = rep.last_start if overlapped and rep.last_start is not None else t
            plan = rep.schedule(cutoff)
            if not plan.decodes and not plan.chunks:  # nothing to run after the step: afd schedules afresh
                plan = rep.schedule(t)
            rep.in_flight = plan
            rep.last_start = t
            rep.step_tokens = plan.load.tokens
            group_tokens = sum(reps[r].step_tokens for r in groups[group_of[unit]]) if d.connector == "async" else 0
            dur = cost.replica_step(plan.load, group_tokens)
            prompt = plan.load.prefill > 0
        busy[unit] = True
        steps["count"] += 1
        steps["device_s"] += dur
        if prompt:
            steps["prompt_count"] += 1
            steps["prompt_device_s"] += dur
        heapq.heappush(events, (t + max(dur, 1e-9), 0, unit))

    def has_work(unit: int) -> bool:
        return any(reps[r].has_work() for r in groups[unit]) if lockstep else reps[unit].has_work()

    while events and remaining:
        t, kind, x = heapq.heappop(events)
        if kind == 1:
            q = seqs[x]
            q.reached = t
            r = pick_replica([rep.outstanding for rep in reps])
            reps[r].waiting.append(q)
            reps[r].outstanding += q.prompt + q.max_tokens
            unit = group_of[r] if lockstep else r
            if not busy[unit]:  # its step starts once every arrival of this instant is queued
                if not lockstep:
                    reps[r].last_start = None  # an idle engine schedules its step at once
                busy[unit] = True
                heapq.heappush(events, (t, 2, unit))
            continue
        if kind == 2:
            start(x, t)
            continue
        members = groups[x] if lockstep else [x]
        streams = sum(len(rep.running) for rep in reps) * ep_scale  # one front end tends every replica's streams
        delay = p.calibration.stream_s * streams
        for r in members:
            rep = reps[r]
            plan, rep.in_flight = rep.in_flight, None
            rep.step_tokens = 0
            if plan is not None:
                remaining -= rep.finish(plan, t, delay)
        busy[x] = False
        if has_work(x):
            start(x, t)
    results = [q.result for q in seqs]  # times from the client's send, as the bench measures them
    end = max((q.arrival + (q.result.e2e_s or 0.0) for q in seqs), default=0.0)
    wall = end - min(arrivals, default=0.0)
    record = run_record(rate, results, wall / ep_scale)  # ep: the whole deployment serves ep_scale times as much
    record["summary"]["steps"] = steps  # in `afd bench serve`'s terms, to set beside a measured run's
    return record


def simulate(d: Deployment, s: Shapes, p: Profile, workload: Workload, rates: list[float], vocab_size: int = 2) -> dict:
    """`afd bench serve`'s result dict for one server: `{"name", "runs"}`, one run per rate."""
    prompt_lens = [len(x) for x in workload.prompts(vocab_size)]
    runs = [simulate_rate(d, s, p, workload, prompt_lens, rate) for rate in rates]
    return {"name": f"sim {d.name}", "runs": runs, "deployment": d.describe()}
