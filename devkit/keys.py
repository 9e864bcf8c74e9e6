"""Deleting what a run wrote: every key under its prefix, on a server or a cluster."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any, TypeVar

from guard.connect import connect

Client = TypeVar("Client")


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


def delete_prefixed_at(url: str, prefix: str) -> int:
    """Delete every key under ``prefix`` on the server at ``url``."""
    client = connect(url)
    try:
        return delete_prefixed(client, prefix)
    finally:
        client.close()


@contextmanager
def cleaned_up(client: Client, prefix: str) -> Iterator[Client]:
    """``client``; afterwards every key under ``prefix`` is deleted and the client closed."""
    try:
        yield client
    finally:
        delete_prefixed(client, prefix)
        client.close()  # type: ignore[attr-defined]


@asynccontextmanager
async def acleaned_up(client: Client, prefix: str) -> AsyncIterator[Client]:
    """The same for an asyncio client."""
    try:
        yield client
    finally:
        await adelete_prefixed(client, prefix)
        await client.aclose()  # type: ignore[attr-defined]
