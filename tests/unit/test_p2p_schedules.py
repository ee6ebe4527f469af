"""The p2p tests' step schedules: idle replicas and zero-share FFN ranks are covered."""

from __future__ import annotations

import multiprocessing as mp


def schedule(attn_rank: int, num_steps: int | None = None) -> list[int]:
    """Token counts of one replica's busy steps: ragged, with zeros, and some replicas idle."""
    n = (2 * attn_rank + 3) % 5 if num_steps is None else num_steps
    return [(3 * attn_rank + 5 * s + 1) % 7 for s in range(n)]


# --- harness -----------------------------------------------------------------------------------
_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "afd.distributed.world", "afd.connectors.p2p.attention"])


def test_schedules_cover_idle_and_zero_share_cases() -> None:
    assert schedule(0) == [1, 6, 4]  # T=1 over 2 or 4 FFN members: zero shares
    assert schedule(1) == []  # an idle replica for the whole wave
    assert 0 in schedule(2)  # a busy step with zero tokens
