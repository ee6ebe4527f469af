"""What runs in the next step: admission, chunked prefill under a token budget, and what a step's tokens finish.

Pure bookkeeping over `SequenceState`s: no tensors. The queue is first come, first served; a request is admitted
when the `BlockManager` can reserve every block it will ever need, so a running sequence is never preempted (the
queue's head waits instead). A step is the running decodes (one token each, first), then the next chunk of every
running prompt, then new prompts, while `max_num_batched_tokens` lasts: a long prompt never stalls the decodes,
and no step is larger than the budget.
"""

from __future__ import annotations

from collections import Counter, deque

from afd.engine.block_manager import BlockManager
from afd.engine.request import Output, Request, StepToken
from afd.engine.sequence import ON_DEVICE, Scheduled, SequenceState


class Scheduler:
    """The waiting queue and the running sequences of one engine, and the rules between them."""

    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int, max_num_seqs: int) -> None:
        self.block_manager = block_manager
        self.max_num_batched_tokens, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        self.not_ahead: Counter[str] = Counter()  # why `schedule_ahead` found no successor, by reason
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

    def schedule_ahead(
        self, scheduled: list[Scheduled], sampled: list[Scheduled]
    ) -> tuple[list[Scheduled], list[int]] | None:
        """The step `schedule()` will pick once the step in flight (`scheduled`, sampling `sampled` in row order) is
        post-processed, when it is known before its tokens are: every decode of a sequence that goes on after it
        (input id `ON_DEVICE`: that step's sampled token, whose row is returned for each such decode, in order),
        then the next prompt chunks, then the admissions, under the same budget and rules; else None.

        Known when the step held every running sequence and every admission `schedule()` would make fits in the
        blocks free now (not only in those the step frees, which its post-processing returns). A stop token is not
        known yet: such a sequence is decoded once more in vain (its row is skipped in `postprocess`). Exactly
        `schedule()`'s choice when no sequence of the step stops.
        """
        cached = {s.seq.request_id: s.start + len(s.input_ids) for s in scheduled}  # num_cached after the step
        if any(seq.request_id not in cached for seq in self.running):  # left out (budget-capped decodes)
            self.not_ahead["a running sequence was left out of the step"] += 1
            return None
        row_of = {s.seq.request_id: row for row, s in enumerate(sampled)}
        decodes, rows, ending = [], [], []
        for seq in self.running:
            start = cached[seq.request_id]
            if start < len(seq.request.prompt_ids):
                continue  # still prefilling after the step
            if len(seq.token_ids) + 1 >= seq.request.max_new_tokens:
                ending.append(seq)  # its token of the step in flight is its last: it ends by length
                continue
            decodes.append(Scheduled(seq, [ON_DEVICE], start))
            rows.append(row_of[seq.request_id])
        budget = self.max_num_batched_tokens - len(decodes)
        if budget < 0:
            self.not_ahead["decodes over the budget"] += 1
            return None
        out = list(decodes)
        for seq in self.running:
            start = cached[seq.request_id]
            if budget > 0 and start < len(seq.request.prompt_ids):
                out.append(Scheduled(seq, list(seq.request.prompt_ids[start : start + budget]), start))
                budget -= len(out[-1].input_ids)
        admitted = self._admissions_ahead(budget, len(self.running) - len(ending), ending)
        if admitted is None:
            self.not_ahead["an admission waits for the step's endings"] += 1
            return None
        for seq in admitted:
            self.waiting.popleft()
            self.block_manager.allocate(seq)
            self.running.append(seq)
            out.append(self._chunk(seq, budget))
            budget -= len(out[-1].input_ids)
        if not out:
            self.not_ahead["nothing to run after the step"] += 1
            return None
        return out, rows

    def _admissions_ahead(
        self, budget: int, num_running: int, ending: list[SequenceState]
    ) -> list[SequenceState] | None:
        """The queue heads `schedule()` admits after the step in flight (`num_running` sequences go on, `ending`
        end by length in it), when each fits in the blocks and slots free now; None when one fits only once the
        step's endings free theirs (schedule after the step instead)."""
        manager = self.block_manager
        free, freed = manager.num_free_blocks, sum(manager.blocks_for(s) for s in ending)
        slots = self.max_num_seqs - len(self.running)  # held now, also by the sequences that end
        admitted: list[SequenceState] = []
        for seq in self.waiting:
            if budget <= 0 or num_running + len(admitted) >= self.max_num_seqs:
                break
            need = manager.blocks_for(seq)
            if need > free + freed:
                break  # does not fit after the step either: `schedule()` stops here too
            if need > free or len(admitted) >= slots:
                return None
            free -= need
            admitted.append(seq)
            budget -= min(budget, len(seq.request.prompt_ids))
        return admitted

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
