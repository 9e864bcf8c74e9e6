"""Many clients at once on one filter: nothing lost, counts exact, also while it grows."""

from __future__ import annotations

import asyncio
import threading

import redis
import redis.asyncio as aioredis

from guard import CuckooFilter, SyncCuckooFilter


def run_threads(target, count: int) -> None:
    errors: list[BaseException] = []

    def guarded(k: int) -> None:
        try:
            target(k)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(k,)) for k in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


class TestThreads:
    """Real Redis only: fakeredis serialises everything in-process and would prove little."""

    def test_distinct_inserts_while_growing(
        self, real_redis: redis.Redis, real_redis_url: str, prefix: str
    ) -> None:
        url = real_redis_url
        SyncCuckooFilter(real_redis, "conc", prefix=prefix).reserve(1000, expansion=2)

        def worker(k: int) -> None:
            client = redis.Redis.from_url(url)
            cf = SyncCuckooFilter(client, "conc", prefix=prefix)
            mine = [f"w{k}-{i}" for i in range(2000)]
            for start in range(0, len(mine), 50):
                assert all(cf.insert_many(mine[start : start + 50]))
            assert all(cf.lookup_many(mine))
            client.close()

        run_threads(worker, 8)
        cf = SyncCuckooFilter(real_redis, "conc", prefix=prefix)
        everything = [f"w{k}-{i}" for k in range(8) for i in range(2000)]
        assert all(cf.lookup_many(everything))
        info = cf.info()
        assert info.items == 16_000
        assert info.subfilters > 1  # growth happened under concurrency

    def test_mixed_ops_never_miss_a_live_item(
        self, real_redis: redis.Redis, real_redis_url: str, prefix: str
    ) -> None:
        url = real_redis_url
        SyncCuckooFilter(real_redis, "mixed", prefix=prefix).reserve(6000, expansion=0)
        counts: dict[int, int] = {}

        def worker(k: int) -> None:
            client = redis.Redis.from_url(url)
            cf = SyncCuckooFilter(client, "mixed", prefix=prefix)
            live: list[str] = []
            for i in range(600):
                item = f"m{k}-{i}"
                assert cf.insert(item)
                live.append(item)
                if i % 3 == 2:
                    assert cf.delete(live.pop(0))
                if i % 25 == 0:
                    # Every live item of this worker is found at every point, whatever the
                    # others are kicking around meanwhile.
                    assert all(cf.lookup_many(live))
            assert all(cf.lookup_many(live))
            counts[k] = len(live)
            client.close()

        run_threads(worker, 6)
        assert SyncCuckooFilter(real_redis, "mixed", prefix=prefix).info().items == sum(
            counts.values()
        )


class TestAsyncio:
    async def test_many_tasks_insert_distinct_items(
        self, async_redis: aioredis.Redis, prefix: str
    ) -> None:
        cf = CuckooFilter(async_redis, "tasks", prefix=prefix)
        await cf.reserve(500, expansion=2)

        async def task(k: int) -> list[str]:
            own = CuckooFilter(async_redis, "tasks", prefix=prefix)
            mine = [f"t{k}-{i}" for i in range(100)]
            for item in mine[:50]:
                assert await own.insert(item)
            assert all(await own.insert_many(mine[50:]))
            return mine

        batches = await asyncio.gather(*(task(k) for k in range(40)))
        everything = [x for batch in batches for x in batch]
        assert all(await cf.lookup_many(everything))
        assert (await cf.info()).items == 4000
