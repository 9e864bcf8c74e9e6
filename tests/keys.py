"""Deleting what a test wrote: every key under its prefix, on a server or a cluster."""

from __future__ import annotations

from typing import Any


def cleanup(client: Any, prefix: str) -> None:
    """A blocking client (Redis or RedisCluster: redis-py splits a multi-key DEL per slot)."""
    keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
    if keys:
        client.delete(*keys)


async def acleanup(client: Any, prefix: str) -> None:
    """The same over an asyncio client."""
    keys = [k async for k in client.scan_iter(match=f"{prefix}*", count=1000)]
    if keys:
        await client.delete(*keys)
