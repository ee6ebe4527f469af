"""The event loop `afd serve` and `afd bench serve` run on: uvloop where it is installed, else asyncio's own.

Why: at one request a second the front end's share of time to first token is mostly the event loop's own
work (waking up, reading the sockets, scheduling the handler and the stream), paid on a cold CPU. uvloop
does that work in C (libuv); vLLM's and SGLang's servers run on it too. `AFD_UVLOOP=0` keeps asyncio's loop
(for comparisons).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from afd import env

logger = logging.getLogger(__name__)
T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop constructor, or None for asyncio's default (uvloop missing, or `AFD_UVLOOP=0`)."""
    if env.uvloop_disabled():
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def loop_name() -> str:
    return "asyncio" if loop_factory() is None else "uvloop"


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` on the loop `loop_factory` picks."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)
