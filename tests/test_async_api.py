"""The asyncio API is the sync one, awaited: same answers, same errors."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from guard import (
    CuckooFilter,
    FilterExistsError,
    FilterFullError,
    FilterNotFoundError,
    InvalidParameterError,
    list_filters,
)


@pytest.fixture
def cf(async_redis: aioredis.Redis, prefix: str) -> CuckooFilter:
    return CuckooFilter(async_redis, "users", prefix=prefix)


class TestAsyncFilter:
    async def test_round_trip(self, cf: CuckooFilter) -> None:
        info = await cf.reserve(1000, error_rate=0.001, expansion=0)
        assert info.fingerprint_bits == 13
        assert await cf.exists()
        assert await cf.insert("a") is True
        assert await cf.insert_unique("a") is False
        assert await cf.insert_many(["b", "c"]) == [True, True]
        assert await cf.lookup("a") is True
        assert await cf.lookup_many(["a", "b", "zz"]) == [True, True, False]
        assert await cf.count("a") == 1
        assert await cf.delete("a") is True
        assert await cf.delete_many(["b", "nope"]) == [True, False]
        info = await cf.info()
        assert (info.items, info.deletes, info.missed_deletes) == (1, 2, 1)
        assert await cf.drop() is True
        assert not await cf.exists()

    async def test_errors(self, cf: CuckooFilter) -> None:
        with pytest.raises(FilterNotFoundError):
            await cf.lookup("x")
        with pytest.raises(InvalidParameterError, match="bucket_size"):
            await cf.reserve(10, bucket_size=5)
        await cf.reserve(10, expansion=0, bucket_size=1)
        with pytest.raises(FilterExistsError):
            await cf.reserve(10)
        with pytest.raises(FilterFullError) as full:
            await cf.insert_many([f"i{n}" for n in range(200)])
        added = sum(full.value.results)
        assert 0 < added < 200
        assert (await cf.info()).items == added

    async def test_staging_and_listing(
        self, cf: CuckooFilter, async_redis: aioredis.Redis, prefix: str
    ) -> None:
        await cf.reserve(100)
        await cf.insert("old")
        stage = cf.staging()
        await stage.reserve(100)
        await stage.insert("new")
        assert await list_filters(async_redis, prefix) == ["users"]
        await stage.promote()
        assert await cf.lookup_many(["old", "new"]) == [False, True]

    async def test_script_flush_is_invisible(
        self, cf: CuckooFilter, async_redis: aioredis.Redis
    ) -> None:
        await cf.reserve(100)
        await cf.insert("x")
        await async_redis.script_flush()
        assert await cf.lookup_many(["x", "y"]) == [True, False]
        await async_redis.script_flush()
        assert await cf.lookup("x")
