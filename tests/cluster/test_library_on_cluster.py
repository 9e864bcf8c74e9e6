"""The single-filter library tests, run unchanged against a real Redis Cluster.

The classes are imported from the main suite; the cluster conftest replaces their client
fixtures with ``RedisCluster`` clients (each test's keys share one hash tag, hence one slot).
"""

from __future__ import annotations

from redis.cluster import RedisCluster

from guard import SyncCuckooFilter
from tests.test_filter import (
    TestFullAndGrowth,
    TestItems,
    TestMissingAndBroken,
    TestReserve,
    TestScriptsAndListing,
)
from tests.test_filter import cf as cf  # the imported classes' fixture

__all__ = [
    "TestFullAndGrowth",
    "TestItems",
    "TestMissingAndBroken",
    "TestReserve",
    "TestScriptsAndListing",
]


class TestClusterPlacement:
    def test_filter_keys_share_one_slot(self, sync_redis: RedisCluster, prefix: str) -> None:
        """Every sub-filter of a grown filter lives in the slot of its hash tag."""
        f = SyncCuckooFilter(sync_redis, "grown", prefix=prefix)
        f.reserve(50, expansion=2)
        f.insert_many([f"k{i}" for i in range(600)])
        n = f.info().subfilters
        assert n >= 3
        assert len({sync_redis.keyslot(f.key(i)) for i in range(n)}) == 1
