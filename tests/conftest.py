import uuid

import pytest
from hypothesis import settings

# CI has 2 slow cores: judge hypothesis tests on their examples, not on wall time.
settings.register_profile("afd", deadline=None, max_examples=200)
settings.load_profile("afd")


@pytest.fixture(autouse=True)
def afd_test_tag(monkeypatch: pytest.MonkeyPatch) -> str:
    """A tag in the environment of every process this test starts: the e2e helpers look at, wait for and
    clean up only processes (and their shared-memory segments) that carry the current test's tag."""
    tag = uuid.uuid4().hex[:12]
    monkeypatch.setenv("AFD_TEST_TAG", tag)
    return tag
