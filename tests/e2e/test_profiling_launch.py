"""`AFD_PROFILE_DIR` on a launch: every rank writes its profile."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


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
