"""The end-to-end helpers look only at the current test's own processes and segments.

Before, `worker_pids()` listed every `afd worker` on the machine and `Leftovers.cleanup()` SIGKILLed every new
one and deleted every new `/dev/shm/afd_*`: running the suite beside an afd service killed the service.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.e2e import TEST_TAG_VAR, Leftovers, afd_worker, hand_config, kill_all, shm_segments, worker_pids

from afd.runtime.launch import free_port


@pytest.mark.timeout(60)
def test_another_runs_worker_and_segment_are_never_touched() -> None:
    leftovers = Leftovers()
    config = hand_config("p2p", 1, 1, port=free_port(), timeout_s=60)
    # a rank of somebody else's run (another test session, a service): another tag, waiting for its peer
    foreign_env = {**os.environ, TEST_TAG_VAR: "someone-else"}
    cmd = [sys.executable, "-m", "afd", "worker", "--config", json.dumps(config), "--role", "ffn"]
    foreign = subprocess.Popen(
        [*cmd, "--rank", "0", "--model", "tiny"],
        env=foreign_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    foreign_segment = Path("/dev/shm/afd_someoneelse_0")
    foreign_segment.write_bytes(b"\0" * 16)
    ours = afd_worker(hand_config("p2p", 1, 1, port=free_port(), timeout_s=60), "ffn", 0)
    try:
        deadline = time.monotonic() + 30
        while ours.pid not in worker_pids():
            assert time.monotonic() < deadline, "our own worker never showed up"
            time.sleep(0.1)
        assert foreign.pid not in worker_pids(), "another run's worker is listed as this test's"
        assert str(foreign_segment) not in shm_segments()
        leftovers.cleanup()  # kills this test's worker only
        ours.wait(10)
        assert foreign.poll() is None, "cleanup killed another run's worker"
        assert foreign_segment.exists(), "cleanup deleted another run's segment"
    finally:
        kill_all([ours])
        if foreign.poll() is None:
            os.killpg(foreign.pid, signal.SIGKILL)
            foreign.wait(10)
        foreign_segment.unlink(missing_ok=True)
