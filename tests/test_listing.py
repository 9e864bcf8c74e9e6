"""Listing filters under a prefix that also holds keys no filter has (not valid UTF-8, not a
filter name, another type): such keys are skipped, damaged filters reported by name."""

from __future__ import annotations

import redis
import redis.asyncio as aioredis

from guard import (
    CuckooFilter,
    SyncCuckooFilter,
    SyncShardedCuckooFilter,
    list_filters_sync,
    list_sharded_filters_sync,
)
from guard.listing import FilterReport, read_all_filters_sync, read_unsharded_filters


class TestForeignKeys:
    def test_listings_skip_names_no_filter_can_have(
        self, sync_redis: redis.Redis, prefix: str
    ) -> None:
        SyncCuckooFilter(sync_redis, "ok", prefix=prefix).reserve(10)
        p = prefix.encode()
        sync_redis.set(p + b"{\xff\xfe}", b"x")  # not valid UTF-8
        sync_redis.set(p + b"{\xff:0}", b"x")  # a shard's shape, not valid UTF-8
        sync_redis.set(p + b"{not a name}", b"x")
        assert list_filters_sync(sync_redis, prefix) == ["ok"]
        assert list_sharded_filters_sync(sync_redis, prefix) == {}

    async def test_read_unsharded_filters_names_damaged_ones(
        self, async_redis: aioredis.Redis, prefix: str
    ) -> None:
        await CuckooFilter(async_redis, "ok", prefix=prefix).reserve(10)
        p = prefix.encode()
        await async_redis.set(p + b"{\xff\xfe}", b"x")
        await async_redis.hset(p + b"{hash}", "field", "value")  # a filter's name, another type
        await async_redis.set(p + b"{junk}", b"not a filter")

        def handle(name: str) -> CuckooFilter:
            return CuckooFilter(async_redis, name, prefix=prefix)

        report = await read_unsharded_filters(async_redis, handle, prefix)
        assert [i.name for i in report.infos] == ["ok"]
        assert report.damaged == ["hash", "junk"]
        first = await read_unsharded_filters(async_redis, handle, prefix, limit=1)
        assert (first.infos, first.damaged) == ([], ["hash"])


class TestReadAllFiltersSync:
    def test_plain_sharded_and_damaged(self, sync_redis: redis.Redis, prefix: str) -> None:
        SyncCuckooFilter(sync_redis, "plain", prefix=prefix).reserve(10)
        SyncShardedCuckooFilter(sync_redis, "wide", prefix=prefix, shards=3).reserve(30)
        sync_redis.set(prefix.encode() + b"{junk}", b"not a filter")
        cut = SyncShardedCuckooFilter(sync_redis, "cut", prefix=prefix, shards=3)
        cut.reserve(30)
        sync_redis.delete(cut.key(2))  # lost its last shard: it lists as 2 shards
        report = read_all_filters_sync(sync_redis, prefix)
        assert [i.name for i in report.infos] == ["plain", "wide"]
        assert report.damaged == ["cut", "junk"]
        assert read_all_filters_sync(sync_redis, prefix + "none:") == FilterReport()
