"""The KV-cache flags (named as vLLM's) reach every engine: the single process, and each launched rank."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# two prompts that each need 3 blocks of 4 tokens (5 prompt + 7 new - 1 = 11 tokens)
PROMPTS = "5,17,33,2,9;4,8,100,3,77"
COMMON = ["--model", "tiny", "--prompt-ids", PROMPTS, "--max-new-tokens", "7", "--json", "--block-size", "4"]


def afd(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "afd", *args], capture_output=True, text=True, timeout=240)


def tokens(result: subprocess.CompletedProcess) -> list[list[int]]:
    assert result.returncode == 0, result.stderr[-2000:]
    return [o["token_ids"] for o in json.loads(result.stdout)["outputs"]]


@pytest.mark.parametrize("bad", ["0", "1.5", "nan", "x"])
def test_gpu_memory_utilization_is_a_fraction(bad: str) -> None:
    result = afd("generate", *COMMON, "--gpu-memory-utilization", bad)
    assert result.returncode == 2 and "fraction" in result.stderr and "Traceback" not in result.stderr


def test_a_request_larger_than_the_fixed_pool_is_refused_before_start() -> None:
    result = afd("generate", *COMMON, "--num-gpu-blocks-override", "2")
    assert result.returncode == 2, result.stderr
    assert "needs 3 KV-cache blocks of 4 tokens" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.timeout(240)
def test_a_pool_for_one_request_makes_the_next_wait_in_every_engine() -> None:
    """A pool of 3 blocks holds one request at a time: the second waits for the first's blocks, in the
    single process and in a launched p2p rank alike, and the tokens are those of an unbounded pool."""
    want = tokens(afd("generate", *COMMON))
    single = afd("-v", "generate", *COMMON, "--num-gpu-blocks-override", "3")
    assert tokens(single) == want
    assert "KV cache: 3 blocks x 4 tokens" in single.stderr, single.stderr[-2000:]
    launched = afd("-v", "generate", *COMMON, "--num-gpu-blocks-override", "3", "--connector", "p2p")
    assert tokens(launched) == want
    assert (
        "[attention rank 0 (world rank 1)] afd.engine.engine INFO KV cache: 3 blocks x 4 tokens" in launched.stderr
    ), launched.stderr[-3000:]
