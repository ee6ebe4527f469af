"""`AFD_TIMELINE=DIR` on a real launch: both ranks write their points."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.e2e import emptied, module_env_dir

from afd.profiling.timeline_report import main, report

SHARED_TEST_TAG = True  # one zygote for the module's launches (tests/conftest.py)


@pytest.fixture(scope="module")
def timeline_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """AFD_TIMELINE for every launch of the module."""
    with module_env_dir(tmp_path_factory.mktemp("timeline"), "AFD_TIMELINE") as path:
        yield path


@pytest.fixture
def points_dir(timeline_dir: Path) -> Path:
    """The timeline directory, emptied: this test's launch writes the only points in it."""
    return emptied(timeline_dir)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("connector, shared_here", [("async", False), ("async", True), ("p2p", False)])
def test_a_real_launch_writes_both_ranks_points(points_dir: Path, connector: str, shared_here: bool):
    from helpers import e2e

    extra = {"shared_experts_on_attention": True} if shared_here else {}
    outputs, _ = e2e.launch_checked(connector, 1, 1, [[3, 5, 7]], max_new_tokens=2, max_num_batched_tokens=64, **extra)
    assert len(outputs[0].token_ids) == 2
    attention = json.loads((points_dir / f"{connector}_attention0.json").read_text())["points"]
    ffn = json.loads((points_dir / f"{connector}_ffn0.json").read_text())["points"]
    num_moe = sum(1 for p in attention if p[0] == "send")
    assert num_moe > 0 and sum(1 for p in ffn if p[0] == "answered") == num_moe  # every exchange, both sides
    result = report(points_dir)
    split = result[f"{connector}_attention0 <-> {connector}_ffn0"]
    assert split["FFN pass + reply writes"]["n"] == num_moe
    assert result[f"{connector}_attention0"]["step"]["n"] == 2  # a prefill step, then a decode step
    shared = result[f"{connector}_attention0"].get("shared experts here", {"n": 0})
    assert shared["n"] == (num_moe if shared_here else 0)  # timed only where the attention rank runs them
    assert main([str(points_dir), "--json", str(points_dir / "summary.json.out")]) == 0
