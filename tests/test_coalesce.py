"""Auto-batching: concurrent lookups share round trips, and each caller gets its own answer."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from guard import CuckooFilter
from guard.coalesce import LookupCoalescer


class Recorder:
    """A stand-in for the Redis read: answers "present" for items starting with 'p'."""

    def __init__(self, fail_on: bytes | None = None) -> None:
        self.batches: list[list[bytes]] = []
        self.fail_on = fail_on

    async def __call__(self, items: list[bytes]) -> list[bool]:
        self.batches.append(items)
        await asyncio.sleep(0.01)  # a round trip, during which more callers arrive
        if self.fail_on in items:
            raise ConnectionError("redis went away")
        return [x.startswith(b"p") for x in items]


class TestLookupCoalescer:
    async def test_first_call_goes_alone_then_waiters_share_one_trip(self) -> None:
        rec = Recorder()
        co = LookupCoalescer(rec)
        first = asyncio.ensure_future(co.lookup_many([b"p", b"a"]))
        await asyncio.sleep(0.001)  # the first trip is in flight
        calls = [co.lookup_many([f"p{k}".encode(), f"a{k}".encode()]) for k in range(49)]
        results = await asyncio.gather(first, *calls)
        assert results == [[True, False]] * 50
        assert [len(b) for b in rec.batches] == [2, 98]

    async def test_calls_made_together_share_the_second_trip(self) -> None:
        rec = Recorder()
        co = LookupCoalescer(rec)
        results = await asyncio.gather(*(co.lookup_many([b"p"]) for _ in range(30)))
        assert results == [[True]] * 30
        # The first goes at once; the 29 that arrived while it was out go together.
        assert [len(b) for b in rec.batches] == [1, 29]

    async def test_idle_lookup_is_sent_at_once(self) -> None:
        rec = Recorder()
        co = LookupCoalescer(rec)
        assert await co.lookup_many([b"p1"]) == [True]
        assert await co.lookup_many([b"a1"]) == [False]
        assert rec.batches == [[b"p1"], [b"a1"]]

    async def test_trips_hold_at_most_max_items(self) -> None:
        rec = Recorder()
        co = LookupCoalescer(rec, max_items=10)
        await asyncio.gather(*(co.lookup_many([b"p", b"a", b"p"]) for _ in range(12)))
        assert all(len(b) <= 10 for b in rec.batches)
        assert sum(len(b) for b in rec.batches) == 36

    async def test_a_failure_reaches_every_waiter_and_the_next_trip_works(self) -> None:
        rec = Recorder(fail_on=b"boom")
        co = LookupCoalescer(rec)
        first = asyncio.ensure_future(co.lookup_many([b"p0"]))
        await asyncio.sleep(0)  # the first trip is now in flight
        waiters = [co.lookup_many([b"boom"]), co.lookup_many([b"p1"])]
        outcome = await asyncio.gather(*waiters, return_exceptions=True)
        assert await first == [True]
        assert all(isinstance(o, ConnectionError) for o in outcome)
        assert await co.lookup_many([b"p2"]) == [True]

    async def test_waiters_fail_at_once_when_redis_is_unreachable(self) -> None:
        async def unreachable(items: list[bytes]) -> list[bool]:
            await asyncio.sleep(0.01)
            raise ConnectionError("connection refused")

        co = LookupCoalescer(unreachable)
        first = asyncio.ensure_future(co.lookup_many([b"p0"]))
        await asyncio.sleep(0)  # the first trip is in flight
        queued = asyncio.ensure_future(co.lookup_many([b"p1"]))
        with pytest.raises(ConnectionError):
            await first
        await asyncio.sleep(0)
        # Failed together with the trip, not sent again into a dead connection.
        assert queued.done()
        with pytest.raises(ConnectionError):
            await queued

    async def test_a_cancelled_caller_does_not_disturb_the_others(self) -> None:
        rec = Recorder()
        co = LookupCoalescer(rec)
        first = asyncio.ensure_future(co.lookup_many([b"p0"]))
        await asyncio.sleep(0)
        doomed = asyncio.ensure_future(co.lookup_many([b"a1"]))
        kept = asyncio.ensure_future(co.lookup_many([b"p2"]))
        await asyncio.sleep(0)
        doomed.cancel()
        assert await first == [True]
        assert await kept == [True]


class TestFilterCoalescing:
    async def test_concurrent_lookups_are_correct_and_batched(
        self, async_redis: aioredis.Redis, prefix: str
    ) -> None:
        cf = CuckooFilter(async_redis, "co", prefix=prefix)
        await cf.reserve(1000)
        await cf.insert_many([f"p{k}" for k in range(400)])
        trips: list[int] = []
        real = cf._lookup_now

        async def counting(data: list[bytes]) -> list[bool]:
            trips.append(len(data))
            return await real(data)

        cf._coalescer = LookupCoalescer(counting)
        probes = [f"p{k}" if k % 2 else f"absent{k}" for k in range(400)]
        results = await asyncio.gather(*(cf.lookup(x) for x in probes))
        # Each caller gets the answer one unbatched read gives. That read, not "absent items
        # are False", is the reference: about 1 in 25,000 absent items here shares a
        # fingerprint with a present one, and the filter's seed is new on every run.
        direct = await real([x.encode() for x in probes])
        assert results == direct
        assert all(results[1::2])  # every present item is found
        assert sum(results[0::2]) <= 2  # P(3 or more false positives of 200) is about 1e-7
        assert len(trips) < 400 / 4  # far fewer round trips than lookups

    async def test_bad_item_fails_only_its_caller(
        self, async_redis: aioredis.Redis, prefix: str
    ) -> None:
        cf = CuckooFilter(async_redis, "co", prefix=prefix)
        await cf.reserve(100)
        await cf.insert("x")
        good, bad = await asyncio.gather(cf.lookup("x"), cf.lookup(3), return_exceptions=True)  # type: ignore[arg-type]
        assert good is True
        assert isinstance(bad, TypeError)

    async def test_coalescing_can_be_turned_off(
        self, async_redis: aioredis.Redis, prefix: str
    ) -> None:
        cf = CuckooFilter(async_redis, "co", prefix=prefix, coalesce=False)
        await cf.reserve(100)
        await cf.insert("x")
        assert cf._coalescer is None
        assert await asyncio.gather(cf.lookup("x"), cf.lookup("y")) == [True, False]
