"""Deleting what a run wrote: every key under its prefix, on a server or a cluster."""

from __future__ import annotations

from typing import Any


def delete_prefixed(client: Any, prefix: str) -> int:
    """Delete every key under ``prefix``; how many there were. A blocking client (Redis or
    RedisCluster: redis-py splits a multi-key DEL per slot)."""
    keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
    if keys:
        client.delete(*keys)
    return len(keys)


async def adelete_prefixed(client: Any, prefix: str) -> int:
    """The same over an asyncio client."""
    keys = [k async for k in client.scan_iter(match=f"{prefix}*", count=1000)]
    if keys:
        await client.delete(*keys)
    return len(keys)
