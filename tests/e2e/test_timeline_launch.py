"""`AFD_TIMELINE=DIR` on a real launch: both ranks write their points."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from afd.profiling.timeline_report import main, report


@pytest.mark.timeout(120)
@pytest.mark.parametrize("connector, shared_here", [("async", False), ("async", True), ("p2p", False)])
def test_a_real_launch_writes_both_ranks_points(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, connector: str, shared_here: bool
):
    from helpers import e2e

    monkeypatch.setenv("AFD_TIMELINE", str(tmp_path))  # the launched ranks inherit it
    extra = {"shared_experts_on_attention": True} if shared_here else {}
    outputs, _ = e2e.launch_checked(connector, 1, 1, [[3, 5, 7]], max_new_tokens=2, max_num_batched_tokens=64, **extra)
    assert len(outputs[0].token_ids) == 2
    attention = json.loads((tmp_path / f"{connector}_attention0.json").read_text())["points"]
    ffn = json.loads((tmp_path / f"{connector}_ffn0.json").read_text())["points"]
    num_moe = sum(1 for p in attention if p[0] == "send")
    assert num_moe > 0 and sum(1 for p in ffn if p[0] == "answered") == num_moe  # every exchange, both sides
    result = report(tmp_path)
    split = result[f"{connector}_attention0 <-> {connector}_ffn0"]
    assert split["FFN pass + reply writes"]["n"] == num_moe
    assert result[f"{connector}_attention0"]["step"]["n"] == 2  # a prefill step, then a decode step
    shared = result[f"{connector}_attention0"].get("shared experts here", {"n": 0})
    assert shared["n"] == (num_moe if shared_here else 0)  # timed only where the attention rank runs them
    assert main([str(tmp_path), "--json", str(tmp_path / "summary.json.out")]) == 0
