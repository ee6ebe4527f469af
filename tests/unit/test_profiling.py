"""`afd.profiling.profiler.profiled`: off without a folder, and with one the tables and the timeline of the block."""

from __future__ import annotations

import json
from pathlib import Path

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
