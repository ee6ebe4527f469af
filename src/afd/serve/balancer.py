"""Which replica takes a new request: the one with the fewest outstanding tokens (pure functions).

A replica's outstanding tokens are the work it still owes: prompt tokens not yet prefilled plus tokens
still to generate, summed over its requests. Counting tokens, not requests, is what keeps one replica
from collecting every long prompt of an uneven mix while round-robin would hand them out blindly.
The front end sees a request's prefill end when its first token arrives, so a prompt counts whole until then.
"""

from __future__ import annotations

from collections.abc import Sequence


def outstanding_tokens(prompt_len: int, max_tokens: int, generated: int) -> int:
    """What one request still costs its replica: its prompt until its first token, plus what is left to generate."""
    return (prompt_len if generated == 0 else 0) + max(max_tokens - generated, 0)


def pick_replica(outstanding: Sequence[int], alive: Sequence[bool] | None = None) -> int:
    """The index of the live replica with the fewest outstanding tokens; ties go to the lowest index.

    Raises ValueError when no replica is alive (the caller answers 503)."""
    best = -1
    for i, load in enumerate(outstanding):
        if alive is not None and not alive[i]:
            continue
        if best < 0 or load < outstanding[best]:
            best = i
    if best < 0:
        raise ValueError("no replica is alive")
    return best
