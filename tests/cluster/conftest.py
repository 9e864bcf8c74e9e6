"""A real 3-master Redis Cluster on loopback ports for the whole session, stopped by PID.

The fixtures ``sync_redis`` and ``async_redis`` are overridden here: library tests imported
into this folder run unchanged against ``RedisCluster`` clients.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio.cluster as aiocluster
from redis.cluster import RedisCluster

from devkit.cluster import LocalCluster
from devkit.keys import acleaned_up, cleaned_up
from guard.connect import connect, connect_async


@pytest.fixture(scope="session")
def cluster() -> Iterator[LocalCluster]:
    started = LocalCluster.start(masters=3)
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture
def sync_redis(cluster: LocalCluster, prefix: str) -> Iterator[RedisCluster]:
    with cleaned_up(connect(cluster.url), prefix) as client:
        yield client


@pytest.fixture
async def async_redis(cluster: LocalCluster, prefix: str) -> AsyncIterator[aiocluster.RedisCluster]:
    async with acleaned_up(connect_async(cluster.url), prefix) as client:
        yield client


@pytest.fixture
def real_redis(sync_redis: RedisCluster) -> RedisCluster:
    return sync_redis
