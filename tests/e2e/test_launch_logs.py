"""`AFD_LOG_DIR`: the rank logs of a run that ended well outlive its run directory (copied before it goes)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from helpers.e2e import MODEL, hand_config

from afd.config import parse_config
from afd.runtime.launch import free_port, launch
from afd.runtime.spec import RunSpec


@pytest.mark.timeout(120)
def test_rank_logs_are_kept_in_afd_log_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AFD_LOG_DIR", str(tmp_path))
    config = parse_config(hand_config("p2p", 1, 1, port=free_port()))
    outputs, _ = launch(config, RunSpec(model=MODEL, max_new_tokens=2, timeout_s=90), [[3, 1, 4]])
    assert len(outputs) == 1
    (kept,) = tmp_path.iterdir()
    assert kept.name.startswith("afd_run_")
    assert not (Path(tempfile.gettempdir()) / kept.name).exists()  # the run directory itself went
    logs = {p.name: p.read_text() for p in kept.iterdir()}
    assert set(logs) == {"attention0.log", "ffn0.log"}, sorted(logs)
    assert all(logs.values()), "a kept log is empty"
