"""cf.pipeline(): the handle's own operations, queued and sent in as few round trips as possible."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from guard import (
    CuckooFilter,
    FilterNotFoundError,
    ShardedCuckooFilter,
    SyncCuckooFilter,
    SyncShardedCuckooFilter,
)


class Trips:
    """Counts what a client (blocking or asyncio) sends: each pipeline executed, each
    command sent alone."""

    def __init__(self, client: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        make_pipeline = client.pipeline

        def pipeline(*args: Any, **kwargs: Any) -> Any:
            pipe = make_pipeline(*args, **kwargs)
            pipe.execute = self._counted(pipe.execute)
            return pipe

        monkeypatch.setattr(client, "pipeline", pipeline)
        monkeypatch.setattr(client, "execute_command", self._counted(client.execute_command))

    def _counted(self, send: Any) -> Any:
        if inspect.iscoroutinefunction(send):

            async def counted_async(*args: Any, **kwargs: Any) -> Any:
                self.count += 1
                return await send(*args, **kwargs)

            return counted_async

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return send(*args, **kwargs)

        return counted

    def since(self, start: int) -> int:
        return self.count - start


@pytest.fixture
def cf(sync_redis: redis.Redis, prefix: str) -> SyncCuckooFilter:
    return SyncCuckooFilter(sync_redis, "piped", prefix=prefix)


class TestSyncPipeline:
    def test_results_come_back_in_call_order(self, cf: SyncCuckooFilter) -> None:
        cf.reserve(1000)
        cf.insert_many(["a", "b", "c", "d"])
        pipe = cf.pipeline()
        pipe.insert("x")
        pipe.insert_many(["y", "z"])
        pipe.insert_unique("a")
        pipe.lookup("a")
        pipe.lookup_many(["b", "never"])
        pipe.count("a")
        pipe.delete("c")
        pipe.delete_many(["d", "nope"])
        pipe.exists()
        assert len(pipe) == 9
        assert pipe.execute() == [
            True, [True, True], False, True, [True, False], 1, True, [True, False], True
        ]  # fmt: skip
        assert len(pipe) == 0  # executed: the queue is empty again
        assert cf.lookup_many(["x", "y", "z", "c", "d"]) == [True, True, True, False, False]
        info = cf.info()
        assert (info.items, info.deletes, info.missed_deletes) == (5, 2, 1)

    def test_single_item_calls_share_one_round_trip(
        self, cf: SyncCuckooFilter, sync_redis: redis.Redis, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        cf.reserve(10_000)
        trips = Trips(sync_redis, monkeypatch)
        # The handle learns the layout (and, on fakeredis, that it has no BITFIELD_RO nor
        # EVALSHA_RO): from now on each call takes one round.
        cf.lookup("warm-up")
        cf.count("warm-up")
        for method in ("insert", "lookup", "count", "delete"):
            start = trips.count
            pipe = cf.pipeline()
            for k in range(200):
                getattr(pipe, method)(f"item{k}")
            results = pipe.execute()
            assert trips.since(start) == 1, method
            assert len(results) == 200 and all(results), method
        assert cf.lookup_many([f"item{k}" for k in range(200)]) == [False] * 200

    def test_a_handle_that_must_learn_its_layout_still_batches(
        self, cf: SyncCuckooFilter, sync_redis: redis.Redis, prefix: str,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:  # fmt: skip
        cf.reserve(1000)
        fresh = SyncCuckooFilter(sync_redis, "piped", prefix=prefix)
        trips = Trips(sync_redis, monkeypatch)
        pipe = fresh.pipeline()
        for k in range(50):
            pipe.insert(f"item{k}")
        assert pipe.execute() == [True] * 50
        # Every insert starts by reading the stored layout: one MULTI read for all 50, then
        # the 50 inserts in one pipeline.
        assert trips.count == 2
        assert fresh.lookup_many([f"item{k}" for k in range(50)]) == [True] * 50

    def test_a_failure_is_raised_once_every_operation_ran(self, cf: SyncCuckooFilter) -> None:
        cf.reserve(1000)
        pipe = cf.pipeline()
        pipe.insert("a")
        pipe.insert(3)  # type: ignore[arg-type]
        pipe.insert("b")
        with pytest.raises(TypeError, match="str or bytes"):
            pipe.execute()
        assert cf.lookup_many(["a", "b"]) == [True, True]

    def test_failures_can_stand_in_their_place(self, cf: SyncCuckooFilter) -> None:
        cf.reserve(1000)
        pipe = cf.pipeline()
        pipe.insert("a")
        pipe.insert(3)  # type: ignore[arg-type]
        pipe.lookup("a")
        first, bad, found = pipe.execute(raise_on_error=False)
        assert first is True and found is True
        assert isinstance(bad, TypeError)

    def test_a_missing_filter_fails_each_operation(self, cf: SyncCuckooFilter) -> None:
        pipe = cf.pipeline()
        pipe.lookup("a")
        pipe.insert("a")
        results = pipe.execute(raise_on_error=False)
        assert [type(r) for r in results] == [FilterNotFoundError, FilterNotFoundError]

    def test_an_empty_pipeline_sends_nothing(
        self, cf: SyncCuckooFilter, sync_redis: redis.Redis, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        trips = Trips(sync_redis, monkeypatch)
        assert cf.pipeline().execute() == []
        assert trips.count == 0

    def test_queued_lookups_hand_over_in_place(
        self, cf: SyncCuckooFilter, sync_redis: redis.Redis, prefix: str
    ) -> None:
        """Queued lookups take a short path; a handle whose layout is stale, a server without
        BITFIELD_RO (fakeredis) and a damaged filter send them back to the general lookup,
        each answer in its own place, as single lookups answer."""
        items = [f"item{k}" for k in range(40)]
        cf.reserve(1000)
        cf.insert_many(items[:20])
        cf.lookup("warm-up")  # the handle now holds the 1000-item layout
        # Another handle replaces the filter with a larger one: cf's layout is stale.
        other = SyncCuckooFilter(sync_redis, "piped", prefix=prefix)
        other.drop()
        other.reserve(50_000)
        other.insert_many(items[10:30])
        fresh = SyncCuckooFilter(sync_redis, "piped", prefix=prefix)
        for handle in (cf, fresh):  # stale, and one that must learn the layout first
            pipe = handle.pipeline()
            for item in items:
                pipe.lookup(item)
            assert pipe.execute() == [other.lookup(item) for item in items]
        # A filter key of another type: each queued lookup fails in its place, with the
        # error a single lookup raises.
        sync_redis.delete(other.key(0))
        sync_redis.rpush(other.key(0), b"x")
        damaged = SyncCuckooFilter(sync_redis, "piped", prefix=prefix)
        with pytest.raises(Exception) as single:
            damaged.lookup("item1")
        pipe = cf.pipeline()
        pipe.lookup("item1")
        pipe.lookup("item2")
        results = pipe.execute(raise_on_error=False)
        assert [type(r) for r in results] == [type(single.value)] * 2

    def test_sharded_filter(self, sync_redis: redis.Redis, prefix: str) -> None:
        sf = SyncShardedCuckooFilter(sync_redis, "piped", prefix=prefix, shards=4)
        sf.reserve(4000)
        pipe = sf.pipeline()
        for k in range(100):
            pipe.insert(f"item{k}")
        pipe.info()
        *added, info = pipe.execute()
        assert added == [True] * 100
        assert info.shards == 4
        pipe = sf.pipeline()
        for k in range(100):
            pipe.lookup(f"item{k}")
        assert pipe.execute() == [True] * 100
        assert sf.info().items == 100


class TestAsyncPipeline:
    async def test_results_come_back_in_call_order(
        self, async_redis: aioredis.Redis, prefix: str
    ) -> None:
        cf = CuckooFilter(async_redis, "piped", prefix=prefix)
        await cf.reserve(1000)
        await cf.insert_many(["a", "b", "c"])
        pipe = cf.pipeline()
        pipe.insert("x")
        pipe.lookup("a")
        pipe.lookup_many(["b", "never"])
        pipe.delete("c")
        pipe.exists()
        assert await pipe.execute() == [True, True, [True, False], True, True]
        info = await cf.info()
        assert (info.items, info.deletes) == (3, 1)

    async def test_single_item_calls_share_one_round_trip(
        self, async_redis: aioredis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        cf = CuckooFilter(async_redis, "piped", prefix=prefix)
        await cf.reserve(10_000)
        await cf.info()
        trips = Trips(async_redis, monkeypatch)
        pipe = cf.pipeline()
        for k in range(200):
            pipe.insert(f"item{k}")
        assert await pipe.execute() == [True] * 200
        assert trips.count == 1

    async def test_sharded_filter(self, async_redis: aioredis.Redis, prefix: str) -> None:
        sf = ShardedCuckooFilter(async_redis, "piped", prefix=prefix, shards=3)
        await sf.reserve(3000)
        pipe = sf.pipeline()
        for k in range(60):
            pipe.insert(f"item{k}")
        assert await pipe.execute() == [True] * 60
        pipe = sf.pipeline()
        pipe.lookup_many([f"item{k}" for k in range(1, 60)])
        pipe.delete("item0")
        assert await pipe.execute() == [[True] * 59, True]
        assert not await sf.lookup("item0")
