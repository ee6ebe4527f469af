"""The event loop `afd serve` and its benchmark client run on: uvloop's where it is installed (it comes with
uvicorn[standard], in the `afd[serve]` extra), asyncio's otherwise."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` on uvloop's loop when uvloop imports."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)
