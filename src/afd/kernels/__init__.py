"""Triton kernels for the CUDA step; the eager PyTorch code they replace stays the CPU path and the test oracle.

Every kernel module imports triton at its top, so import them lazily, inside a branch that `enabled` allowed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

import torch

_eager_depth = 0  # > 0 inside `eager_ops()`


@cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def int_kind(value: int) -> str:
    """How Triton specializes an integer argument when it compiles: equal to 1, a multiple of 16, or neither
    (a kernel compiles once per kind of each such argument; the warm-ups reach every kind a server meets)."""
    return "one" if value == 1 else "div16" if value % 16 == 0 else "any"


def enabled(device: torch.device) -> bool:
    """Whether the Triton kernels run on `device`: CUDA, triton importable, and not inside `eager_ops()`."""
    return device.type == "cuda" and _eager_depth == 0 and _triton_importable()


@contextmanager
def eager_ops() -> Iterator[None]:
    """Inside, every device runs the eager PyTorch ops the kernels replace: the kernels' oracle on CUDA."""
    global _eager_depth
    _eager_depth += 1
    try:
        yield
    finally:
        _eager_depth -= 1
