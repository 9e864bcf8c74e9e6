"""Background tasks of the service: stopping them for good."""

from __future__ import annotations

import asyncio
from contextlib import suppress


async def cancel(task: asyncio.Task[None]) -> None:
    """Cancel `task` and wait for it to end."""
    # Cancelled again until it ends: a cancellation can be lost in a library call racing its
    # own timeout (Python 3.11), and a loop that goes on would hold the shutdown forever.
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=1.0)
    if not task.cancelled():
        with suppress(Exception):
            task.result()  # retrieved: a task's failure at shutdown is not news
