"""A hand-started `async` rank killed with SIGKILL leaves no shared-memory segment behind."""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest
from helpers import e2e
from helpers.async_fakes import segments_of
from helpers.e2e import Leftovers, afd_worker, hand_config, kill_all, wait_until_mapped

from afd.runtime.launch import free_port
from afd.transport.shm import cleanup_segments

# --------------------------------------------------------------------------------------------- segment leaks


@pytest.mark.timeout(90)
def test_kill9_of_a_hand_started_rank_leaves_no_segment() -> None:
    """1A1F `async` started by hand with its own run token; SIGKILL the FFN rank mid-run: the attention
    rank exits non-zero in bounded time and no /dev/shm/afd_<token>_* remains (the segments were unlinked
    as soon as both ranks had mapped them; before the fix the killed rank's segment stayed forever)."""
    token = f"{e2e.test_tag()}k{uuid.uuid4().hex[:8]}"
    config = hand_config("async", 1, 1, port=free_port(), recv_poll_timeout_ms=100)
    leftovers = Leftovers()
    ffn = afd_worker(config, "ffn", 0, "--run-token", token)
    attn = afd_worker(config, "attention", 0, "--prompt-ids", "1,2,3", "--max-new-tokens", "4000", "--run-token", token)
    try:
        wait_until_mapped({ffn.pid, attn.pid}, 2, [ffn, attn])
        time.sleep(1.0)  # let it decode
        assert attn.poll() is None and ffn.poll() is None, "a rank ended before the kill"
        killed = time.monotonic()
        os.killpg(ffn.pid, signal.SIGKILL)
        _, err = attn.communicate(timeout=30)
        assert time.monotonic() - killed < 30
        assert attn.returncode != 0, err
        assert "rank" in err and "Traceback" not in err, err
        ffn.wait(10)
        assert segments_of(token) == [], "shared-memory segments left behind after kill -9"
        leftovers.check()
    finally:
        kill_all([ffn, attn])
        leftovers.cleanup()
        cleanup_segments(token)
