import os
import sys
import uuid
from pathlib import Path

import pytest
import torch
from hypothesis import settings

# Both tiers (tests/unit, tests/e2e) import their shared helpers as `helpers.<module>` from tests/helpers, whichever
# folder or file pytest is given.
TESTS_DIR = str(Path(__file__).resolve().parent)
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)

# CI has 2 slow cores: judge hypothesis tests on their examples, not on wall time.
settings.register_profile("afd", deadline=None, max_examples=200)
settings.load_profile("afd")

# Without a GPU the Triton kernels' tests run them in Triton's interpreter (fp32 on CPU tensors). Set before any
# kernel module is imported, so its @triton.jit functions are built for the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _interpreter_reads_one_element_scalars() -> None:
    """Triton 3.6's interpreter turns a scalar (a one-element NumPy array) into a loop bound with `int(array)`,
    which NumPy >= 2.4 refuses (triton-lang/triton#9171), so every loop with a run-time bound fails on CPU.
    Read the one element instead. Test-only: compiled kernels never see it."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = interpreter._patch_lang_tensor
    if getattr(original, "_afd_patched", False):
        return

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._afd_patched = True
    interpreter._patch_lang_tensor = patched


_interpreter_reads_one_element_scalars()


@pytest.fixture(scope="module")
def afd_module_tag() -> str:
    """The tag of a module whose tests share one (`SHARED_TEST_TAG = True` in the module)."""
    return uuid.uuid4().hex[:12]


@pytest.fixture(autouse=True)
def afd_test_tag(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """A tag in the environment of every process this test starts: the e2e helpers look at, wait for and
    clean up only processes (and their shared-memory segments) that carry the current test's tag.

    A module that sets `SHARED_TEST_TAG = True` gives all its tests one tag. Its tests then share the launcher's
    zygote (`afd.runtime.zygote`, which is replaced whenever the environment changes, and so per test under a tag
    of its own), as `afd demo`'s launches do: each launch forks its ranks from it instead of paying `import torch`
    again (~1.3 s per launch on a 2-core host). Only for modules whose tests check what their own launches leave
    against what was there when they started (`Leftovers`), never an absolute count of the tag's processes."""
    shared = getattr(request.module, "SHARED_TEST_TAG", False)
    tag = request.getfixturevalue("afd_module_tag") if shared else uuid.uuid4().hex[:12]
    monkeypatch.setenv("AFD_TEST_TAG", tag)
    return tag


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function):
    """In a `SHARED_TEST_TAG` module, the test body runs without pytest's PYTEST_CURRENT_TEST (the test's name,
    which nothing of afd reads): the zygote compares environments, so a variable that names each test would
    replace it per test all the same."""
    if not getattr(pyfuncitem.module, "SHARED_TEST_TAG", False):
        return (yield)
    name = os.environ.pop("PYTEST_CURRENT_TEST", None)
    try:
        return (yield)
    finally:
        if name is not None:
            os.environ["PYTEST_CURRENT_TEST"] = name


@pytest.fixture(scope="module")
def models():
    """The tiny preset's attention and FFN sides (fp32, CPU), loaded once per module."""
    from afd.model.weights import load_attention_model, load_ffn_model

    return load_attention_model("tiny"), load_ffn_model("tiny")
