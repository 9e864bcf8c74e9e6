"""A real 3-master Redis Cluster on loopback ports for the whole session, stopped by PID.

The fixtures ``sync_redis`` and ``async_redis`` are overridden here: library tests imported
into this folder run unchanged against ``RedisCluster`` clients.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio.cluster as aiocluster
from redis.cluster import RedisCluster

from guard.connect import connect, connect_async
from tests.cluster.server import LocalCluster


@pytest.fixture(scope="session")
def cluster() -> Iterator[LocalCluster]:
    started = LocalCluster.start(masters=3)
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture
def prefix() -> str:
    return f"test:{uuid.uuid4().hex[:12]}:"


def cleanup(client: RedisCluster, prefix: str) -> None:
    keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
    if keys:
        client.delete(*keys)  # redis-py splits a multi-key DEL per slot


@pytest.fixture
def sync_redis(cluster: LocalCluster, prefix: str) -> Iterator[RedisCluster]:
    client = connect(cluster.url)
    try:
        yield client
    finally:
        cleanup(client, prefix)
        client.close()


@pytest.fixture
async def async_redis(cluster: LocalCluster, prefix: str) -> AsyncIterator[aiocluster.RedisCluster]:
    client = connect_async(cluster.url)
    try:
        yield client
    finally:
        keys = [k async for k in client.scan_iter(match=f"{prefix}*", count=1000)]
        if keys:
            await client.delete(*keys)
        await client.aclose()


@pytest.fixture
def real_redis(sync_redis: RedisCluster) -> RedisCluster:
    return sync_redis
