"""`AFD_PROFILE_DIR` on a launch: every rank writes its profile."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.e2e import emptied, module_env_dir

SHARED_TEST_TAG = True  # one zygote for the module's launches (tests/conftest.py)


@pytest.fixture(scope="module")
def profile_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """AFD_PROFILE for every launch of the module."""
    with module_env_dir(tmp_path_factory.mktemp("profile"), "AFD_PROFILE") as path:
        yield path


@pytest.fixture
def profiles(profile_dir: Path) -> Path:
    """The profile directory, emptied: this test's launch writes the only profiles in it."""
    return emptied(profile_dir)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("connector", ["p2p", "async"])
def test_every_rank_of_a_launch_writes_its_profile(profiles: Path, connector: str):
    """`AFD_PROFILE=DIR`: each rank of a real 1A1F launch profiles its serving part, named by connector and role."""
    from helpers import e2e

    outputs, _ = e2e.launch_checked(connector, 1, 1, [[3, 5, 7]], max_new_tokens=2, max_num_batched_tokens=64)
    assert len(outputs) == 1 and len(outputs[0].token_ids) == 2
    for role in ("attention0", "ffn0"):
        assert "Self CPU" in (profiles / f"{connector}_{role}.txt").read_text()  # torch.profiler's table
        assert json.loads((profiles / f"{connector}_{role}.trace.json").read_text())["traceEvents"]
