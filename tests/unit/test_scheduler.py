"""`Scheduler` on its own: admission, chunked prefill under the token budget, post-processing, aborts and the step
scheduled ahead, over a counting stand-in for the block manager (no tensors anywhere)."""

from __future__ import annotations

from afd.engine.request import Request
from afd.engine.scheduler import Scheduler
from afd.engine.sequence import ON_DEVICE, SequenceState

BLOCK = 4


class CountingBlocks:
    """What the scheduler asks of a `BlockManager`, over a plain count of free blocks."""

    def __init__(self, num_free: int) -> None:
        self.num_free, self.next_slot, self.freed = num_free, 0, []

    def blocks_for(self, seq: SequenceState) -> int:
        return -(-seq.capacity // BLOCK)

    @property
    def num_free_blocks(self) -> int:
        return self.num_free

    def can_allocate(self, seq: SequenceState) -> bool:
        return self.blocks_for(seq) <= self.num_free

    def allocate(self, seq: SequenceState) -> None:
        self.num_free -= self.blocks_for(seq)
        seq.slot, self.next_slot = self.next_slot, self.next_slot + 1

    def free(self, seq: SequenceState) -> None:
        self.num_free += self.blocks_for(seq)
        self.freed.append(seq.request_id)


def scheduler(budget: int, num_free: int = 100, max_num_seqs: int = 8) -> tuple[Scheduler, CountingBlocks]:
    blocks = CountingBlocks(num_free)
    return Scheduler(blocks, budget, max_num_seqs), blocks  # type: ignore[arg-type]


def prompt(n: int, first: int = 1) -> list[int]:
    return list(range(first, first + n))


def shape(steps) -> list[tuple[int, int, int]]:
    """(request id, tokens, start) of each scheduled piece."""
    return [(s.seq.request_id, len(s.input_ids), s.start) for s in steps]


def run_step(sched: Scheduler, token: int = 7):
    """Schedule a step and post-process it as if every sampled row drew `token` (logprob -0.5)."""
    steps = sched.schedule()
    sampled = [s for s in steps if s.samples]
    return steps, sched.postprocess(steps, sampled, [float(token)] * len(sampled), [-0.5] * len(sampled))


def test_chunked_prefill_fills_the_budget_and_decodes_go_first() -> None:
    sched, _ = scheduler(budget=8)
    sched.add(Request(prompt(5), 3))
    sched.add(Request(prompt(6, 10), 3))
    steps, (finished, appended) = run_step(sched)
    assert shape(steps) == [(0, 5, 0), (1, 3, 0)]  # request 1's prompt is cut at the budget
    assert steps[0].input_ids == prompt(5) and steps[1].input_ids == [10, 11, 12]
    assert [(t.request_id, t.token_id) for t in appended] == [(0, 7)] and not finished  # only a whole prompt samples
    steps, _ = run_step(sched)
    assert shape(steps) == [(0, 1, 5), (1, 3, 3)]  # the decode first, then the rest of the prompt
    assert steps[0].input_ids == [7] and steps[1].input_ids == [13, 14, 15]
    steps, (finished, _) = run_step(sched)
    assert shape(steps) == [(0, 1, 6), (1, 1, 6)]
    assert [(o.request_id, o.finish_reason, o.token_ids) for o in finished] == [(0, "length", [7, 7, 7])]


def test_the_queue_head_waits_for_blocks_and_nothing_passes_it() -> None:
    sched, blocks = scheduler(budget=64, num_free=4)
    sched.add(Request(prompt(9), 4))  # capacity 12: 3 blocks
    sched.add(Request(prompt(9), 4))  # 3 blocks: does not fit beside the first
    sched.add(Request(prompt(1), 1))  # 1 block: would fit, but waits behind the head
    steps, _ = run_step(sched)
    assert shape(steps) == [(0, 9, 0)] and len(sched.waiting) == 2 and blocks.num_free == 1
    for _ in range(3):
        run_step(sched)
    assert blocks.freed == [0]  # length 4 reached: its blocks went back
    steps, _ = run_step(sched)
    assert shape(steps) == [(1, 9, 0), (2, 1, 0)]  # the head got in, and the small one behind it
    assert not sched.waiting and blocks.freed == [0, 2] and blocks.num_free == 1  # request 2 ended at once


def test_max_num_seqs_caps_the_running_sequences() -> None:
    sched, _ = scheduler(budget=64, max_num_seqs=2)
    for i in range(3):
        sched.add(Request(prompt(2, 10 * i + 1), 2))
    steps, _ = run_step(sched)
    assert [s.seq.request_id for s in steps] == [0, 1] and len(sched.waiting) == 1


def test_decodes_beyond_the_budget_wait() -> None:
    sched, _ = scheduler(budget=2)
    for i in range(3):
        sched.add(Request([i + 1], 5))
    steps, _ = run_step(sched)
    assert shape(steps) == [(0, 1, 0), (1, 1, 0)]
    run_step(sched)  # two decodes fill the budget: request 2 is not admitted yet
    assert [s.request_id for s in sched.running] == [0, 1] and len(sched.waiting) == 1


def test_a_stop_token_finishes_and_a_row_of_an_ended_sequence_is_skipped() -> None:
    sched, blocks = scheduler(budget=16)
    sched.add(Request(prompt(3), 5, stop_token_ids=[9]))
    sched.add(Request(prompt(3, 20), 5))
    steps = sched.schedule()
    aborted = sched.abort(1)
    assert aborted is not None and aborted.finish_reason == "abort" and blocks.freed == [1]
    finished, appended = sched.postprocess(steps, steps, [9.0, 4.0], [-0.1, -0.2])
    assert [(o.request_id, o.finish_reason, o.token_ids, o.logprobs) for o in finished] == [(0, "stop", [9], [-0.1])]
    assert [t.request_id for t in appended] == [0]  # request 1's row was computed in vain
    assert not sched.has_work() and blocks.freed == [1, 0]
    assert sched.abort(0) is None and sched.abort(99) is None  # finished or unknown: a no-op


def test_abort_of_a_waiting_request_leaves_the_blocks_alone() -> None:
    sched, blocks = scheduler(budget=16, num_free=10)
    rid = sched.add(Request(prompt(3), 2)).request_id
    out = sched.abort(rid)
    assert out is not None and out.token_ids == [] and out.finish_reason == "abort"
    assert blocks.num_free == 10 and blocks.freed == [] and not sched.has_work()


def ahead_of(sched: Scheduler, steps):
    """`schedule_ahead` of a step in flight (`steps`), its sampled rows as the engine launches them."""
    return sched.schedule_ahead(steps, [s for s in steps if s.samples])


def test_schedule_ahead_is_the_next_schedule_when_it_is_known() -> None:
    sched, _ = scheduler(budget=16)
    sched.add(Request(prompt(2), 4))
    sched.add(Request(prompt(3, 10), 2))
    run_step(sched)  # both prompts: one token each
    steps = sched.schedule()  # two decodes in flight; request 1 ends by length in them
    ahead = ahead_of(sched, steps)
    assert ahead is not None
    decodes, rows = ahead
    assert rows == [0] and shape(decodes) == [(0, 1, 3)] and decodes[0].input_ids == [ON_DEVICE]
    sched.postprocess(steps, steps, [5.0, 6.0], [0.0, 0.0])
    assert shape(sched.schedule()) == [(0, 1, 3)]  # what schedule() picks once the tokens are in


def test_schedule_ahead_of_a_mixed_step_holds_its_decodes_chunks_and_admissions() -> None:
    """A step with a prompt that ends in it and one that goes on: the step after it decodes the first (its input id
    on the device, from the step's row 0), takes the second's next chunk, and admits the queue's head, exactly as
    `schedule()` does once the step's tokens are in."""
    sched, _ = scheduler(budget=8)
    sched.add(Request(prompt(3), 4))
    sched.add(Request(prompt(12, 20), 2))
    steps = sched.schedule()
    assert shape(steps) == [(0, 3, 0), (1, 5, 0)]
    sched.add(Request(prompt(2, 50), 3))  # arrives while the step is in flight
    ahead = ahead_of(sched, steps)
    assert ahead is not None
    successor, rows = ahead
    assert shape(successor) == [(0, 1, 3), (1, 7, 5)] and rows == [0] and successor[0].input_ids == [ON_DEVICE]
    assert successor[1].input_ids == prompt(12, 20)[5:]  # the budget is spent: the new request waits
    sampled = [s for s in steps if s.samples]
    sched.postprocess(steps, sampled, [9.0], [0.0])
    normal = sched.schedule()
    assert shape(normal) == shape(successor) and normal[1].input_ids == successor[1].input_ids
    assert normal[0].input_ids == [9]  # the token the step in flight sampled


def test_schedule_ahead_admits_what_fits_now_and_gives_up_when_only_an_ending_frees_room() -> None:
    sched, blocks = scheduler(budget=16, num_free=3)
    sched.add(Request(prompt(5), 4))  # 8 rows: 2 blocks
    sched.add(Request(prompt(5), 4))  # waits: 2 blocks, 1 free
    run_step(sched)
    steps = sched.schedule()
    ahead = ahead_of(sched, steps)
    assert ahead is not None and shape(ahead[0]) == [(0, 1, 6)]  # the head does not fit after this step either
    blocks.num_free = 2  # now it fits: admitted into the step ahead, as schedule() would after this one
    ahead = ahead_of(sched, steps)
    assert ahead is not None and shape(ahead[0]) == [(0, 1, 6), (1, 5, 0)] and len(sched.waiting) == 0

    sched, blocks = scheduler(budget=16, num_free=3)
    sched.add(Request(prompt(5), 2))  # ends by length in its first decode
    sched.add(Request(prompt(5), 4))
    run_step(sched)
    steps = sched.schedule()
    assert ahead_of(sched, steps) is None  # the head fits only in the blocks that ending frees: schedule after it
    assert len(sched.waiting) == 1 and blocks.num_free == 1  # and nothing was admitted meanwhile
    sched.add(Request(prompt(1), 3))
    assert sched.schedule_ahead([], []) is None  # a running sequence the step did not hold
