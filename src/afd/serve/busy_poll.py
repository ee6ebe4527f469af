"""`--busy-poll`: an event loop that never sleeps (the server's front end, and `afd bench serve`'s client)."""

from __future__ import annotations

import asyncio
import logging

logger = logging.getLogger(__name__)


async def spin() -> None:
    """A task that is always ready keeps the event loop out of a sleeping select, so a request or a replica's tokens
    are taken up on the next turn of the loop, not after a wake-up from idle (the server's front end; `afd bench
    serve`'s client too, so that its own wake-ups stay out of what it measures)."""
    logger.info("busy polling: the event loop never sleeps (--busy-poll)")
    while True:
        await asyncio.sleep(0)
