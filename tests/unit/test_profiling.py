"""`afd.profiling.profiler.profiled`: off without a folder, and with one the tables and the timeline of the block."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from afd.profiling.profiler import profiled


def _work() -> torch.Tensor:
    a = torch.randn(64, 64)
    return (a @ a).relu().sum()


def test_profiled_without_a_folder_writes_nothing(tmp_path: Path):
    with profiled("rank", None):
        _work()
    with profiled("rank", ""):
        _work()
    assert list(tmp_path.iterdir()) == []


def test_profiled_writes_the_tables_and_the_timeline(tmp_path: Path):
    folder = tmp_path / "prof"
    with profiled("ffn0", str(folder)):
        _work()
    text = (folder / "ffn0.txt").read_text()
    assert "_work" in text  # cProfile's functions by own time
    assert "aten::mm" in text  # torch.profiler's operators
    trace = json.loads((folder / "ffn0.trace.json").read_text())
    assert any(e.get("name") == "aten::mm" for e in trace["traceEvents"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("connector", ["p2p", "async"])
def test_every_rank_of_a_launch_writes_its_profile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, connector: str):
    """`AFD_PROFILE=DIR`: each rank of a real 1A1F launch profiles its serving part, named by connector and role."""
    from helpers import e2e

    monkeypatch.setenv("AFD_PROFILE", str(tmp_path))  # the launched ranks inherit it
    outputs, _ = e2e.launch_checked(connector, 1, 1, [[3, 5, 7]], max_new_tokens=2, max_num_batched_tokens=64)
    assert len(outputs) == 1 and len(outputs[0].token_ids) == 2
    for role in ("attention0", "ffn0"):
        assert "Self CPU" in (tmp_path / f"{connector}_{role}.txt").read_text()  # torch.profiler's table
        assert json.loads((tmp_path / f"{connector}_{role}.trace.json").read_text())["traceEvents"]
