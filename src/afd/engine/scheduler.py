"""What runs in the next step: admission, chunked prefill under a token budget, and what a step's tokens finish.

Pure bookkeeping over `SequenceState`s: no tensors. The queue is first come, first served; a request is admitted
when the `BlockManager` can reserve every block it will ever need, so a running sequence is never preempted (the
queue's head waits instead). A step is the running decodes (one token each, first), then the next chunk of every
running prompt, then new prompts, while `max_num_batched_tokens` lasts: a long prompt never stalls the decodes,
and no step is larger than the budget.
"""

from __future__ import annotations

from collections import deque

from afd.engine.block_manager import BlockManager
from afd.engine.request import Output, Request, StepToken
from afd.engine.sequence import ON_DEVICE, Scheduled, SequenceState


class Scheduler:
    """The waiting queue and the running sequences of one engine, and the rules between them."""

    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int, max_num_seqs: int) -> None:
        self.block_manager = block_manager
        self.max_num_batched_tokens, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        self.waiting: deque[SequenceState] = deque()
        self.running: list[SequenceState] = []
        self._live: dict[int, SequenceState] = {}  # request id -> its sequence, waiting or running
        self._next_id = 0

    # --- requests ---

    def add(self, request: Request) -> SequenceState:
        """Queue a request (already validated) as a new sequence with the next request id."""
        seq = SequenceState(self._next_id, request, stop_ids=frozenset(int(t) for t in request.stop_token_ids))
        self._next_id += 1
        self.waiting.append(seq)
        self._live[seq.request_id] = seq
        return seq

    def is_live(self, seq: SequenceState) -> bool:
        """Whether `seq` is still waiting or running (not finished, not aborted)."""
        return self._live.get(seq.request_id) is seq

    def abort(self, request_id: int) -> Output | None:
        """End a waiting or running request now (its blocks freed); None when the id is unknown or finished."""
        seq = self._live.get(request_id)
        if seq is None:
            return None
        if seq in self.running:
            return self.finish(seq, "abort")
        self.waiting.remove(seq)
        return self._output(seq, "abort")

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --- the next step ---

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
            if not self.block_manager.can_allocate(seq):
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq)
            self.running.append(seq)
            out.append(self._chunk(seq, budget))
            budget -= len(out[-1].input_ids)
        return out

    @staticmethod
    def _chunk(seq: SequenceState, budget: int) -> Scheduled:
        """The next `budget` (at most) uncached prompt tokens of `seq`."""
        start = seq.num_cached
        return Scheduled(seq, list(seq.request.prompt_ids[start : start + budget]), start)

    def schedule_ahead(self, sampled: list[Scheduled]) -> tuple[list[Scheduled], list[int]] | None:
        """The step `schedule()` will pick once the tokens of a pure decode step in flight (`sampled`, in row
        order) are in, when it is known before they are: the decodes of the sequences that do not end by length
        in that step (input ids `ON_DEVICE`), with each one's row of the step's sampled tokens; else None.

        Known when the step held every running sequence and no queued request could be admitted after it. A
        stop token is not known yet: such a sequence is decoded once more in vain (its row is skipped in
        `postprocess`). Exactly `schedule()`'s choice when no sequence of the step stops.
        """
        live = [(row, s) for row, s in enumerate(sampled) if self.is_live(s.seq)]
        if len(live) != len(self.running):  # a running sequence the step did not hold (budget-capped decodes)
            return None
        cont, ending = [], []  # (row, decode): sequences that go on after the step, and those it ends by length
        for row, s in live:
            (cont if len(s.seq.token_ids) + 1 < s.seq.request.max_new_tokens else ending).append((row, s))
        if not cont:
            return None
        if self.waiting and len(cont) < min(self.max_num_seqs, self.max_num_batched_tokens):
            if self.block_manager.fits_after_freeing(self.waiting[0], (s.seq for _, s in ending)):
                return None  # the queue's head is admitted after the step: schedule normally
        # Cache safety. A sequence that stops (or is aborted) in the step in flight has its blocks freed by its
        # `postprocess` while the step launched ahead, already queued on the same stream, may still write its row.
        # Every later use of those blocks is launched after it on that stream, so it is ordered after that write.
        # The row is inside the sequence's reservation: a sequence goes on only if it holds j < max_new_tokens
        # tokens after the step, and the step ahead feeds its j-th token at position prompt + j - 1 <= prompt +
        # max_new_tokens - 2, below its capacity (`SequenceState.capacity`) of prompt + max_new_tokens - 1 rows.
        decodes = [Scheduled(s.seq, [ON_DEVICE], s.start + 1) for _, s in cont]
        return decodes, [row for row, _ in cont]

    # --- after a step ---

    def postprocess(
        self, scheduled: list[Scheduled], sampled: list[Scheduled], tokens: list[float], logprobs: list[float]
    ) -> tuple[list[Output], list[StepToken]]:
        """A step's bookkeeping once its sampled `tokens` and their `logprobs` (one per `sampled` row) are on the
        host: advance every scheduled sequence's cache, append, finish by stop token or length (freeing its
        blocks). A sequence that ended while the step was in flight is skipped: its row was computed in vain.
        Returns the finished requests and every token appended, in row order."""
        for s in scheduled:
            s.seq.num_cached = s.start + len(s.input_ids)
        finished: list[Output] = []
        appended: list[StepToken] = []
        for s, token, logprob in zip(sampled, tokens, logprobs, strict=True):
            seq = s.seq
            if not self.is_live(seq):
                continue
            token = int(token)
            if len(seq.token_ids) < seq.request.max_new_tokens:
                seq.token_ids.append(token)
                seq.logprobs.append(float(logprob))
                appended.append(StepToken(seq.request_id, token, float(logprob)))
                if token in seq.stop_ids:
                    finished.append(self.finish(seq, "stop"))
                    continue
            if len(seq.token_ids) >= seq.request.max_new_tokens:
                finished.append(self.finish(seq, "length"))
        return finished, appended

    def finish(self, seq: SequenceState, reason: str) -> Output:
        """End a running sequence: out of `running`, its blocks freed."""
        self.running.remove(seq)
        self.block_manager.free(seq)
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
