"""Shutdown steps that end in bounded time: stop a task or await a close even when a library
swallows the cancellation or a peer never answers (issue 41)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable

logger = logging.getLogger("kvserve.service")


async def stop_task(task: asyncio.Future, timeout: float, cancel_first: bool = True) -> bool:
    """Wait at most `timeout` for `task` (cancelled first, or only once the time is up); True
    if it ended. Never `await task` on its own: a task that swallows its cancellation would
    hold the caller forever; one still running past the time is left behind, and logged."""
    if cancel_first:
        task.cancel()
    done, _ = await asyncio.wait({task}, timeout=timeout)
    if not done:
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=timeout)
    if not done:
        logger.warning("%s did not stop within %.0f s of its cancellation; left behind",
                       getattr(task, "get_name", lambda: "a task")(), 2 * timeout)
        return False
    if not task.cancelled() and task.exception() is not None:
        logger.debug("%r ended with %r", task, task.exception())
    return True


async def within(work: Awaitable[object], timeout: float, what: str) -> bool:
    """Await `work` (a close, a last Redis write) for at most `timeout` seconds; True if it
    ended. Past the time it is cancelled and, if it ignores that too, left behind."""
    ended = await stop_task(asyncio.ensure_future(work), timeout, cancel_first=False)
    if not ended:
        logger.warning("%s did not end in time; going on with the shutdown", what)
    return ended
