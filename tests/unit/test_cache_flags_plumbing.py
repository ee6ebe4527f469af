"""The KV-cache flags' plumbing in this process: co-located ranks split the GPU memory fraction, the launcher hands a
rank the same options, and `--enforce-eager` reaches the single-process engine."""

from __future__ import annotations

import subprocess
import sys

import pytest

from afd.cli.main import build_parser
from afd.model.kv_cache import CacheOptions
from afd.runtime.launch import cache_flags


def afd(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "afd", *args], capture_output=True, text=True, timeout=240)


def test_co_located_ranks_split_the_gpu_memory_fraction() -> None:
    assert CacheOptions(gpu_memory_utilization=0.9).shared_by(2).gpu_memory_utilization == pytest.approx(0.45)
    assert CacheOptions(gpu_memory_utilization=0.9).shared_by(1).gpu_memory_utilization == pytest.approx(0.9)


def test_the_launcher_hands_a_rank_the_same_options() -> None:
    options = CacheOptions(block_size=8, gpu_memory_utilization=0.45, num_blocks=12, max_num_seqs=3)
    argv = ["worker", "--rank", "0", "--model", "tiny", *cache_flags(options)]
    args = build_parser().parse_args(argv)
    assert (args.block_size, args.gpu_memory_utilization, args.num_gpu_blocks_override, args.max_num_seqs) == (
        8,
        0.45,
        12,
        3,
    )


def test_enforce_eager_reaches_the_single_process_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--enforce-eager` is vLLM's switch; afd's CPU engine never captures, so check the plumbing."""
    import afd.engine.generate
    from afd.cli.main import main

    seen = {}
    real = afd.engine.generate.generate

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(afd.engine.generate, "generate", spy)
    assert main(["generate", "--model", "tiny", "--prompt-ids", "1,2", "--max-new-tokens", "1", "--enforce-eager"]) == 0
    assert seen["enforce_eager"] is True
