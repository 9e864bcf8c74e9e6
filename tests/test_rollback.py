"""A lookup never answers "absent" from a filter older than one its handle already read.

The filter's keys are replaced by an older copy of themselves (DUMP taken earlier, RESTORE:
what Redis restarted from an older RDB, or a failover to a lagging replica, leaves), on real
Redis and fakeredis; every item written since must still read present through every kind of
handle, the rollback is counted once and reported, and a dropped and re-created filter is not
a rollback (guard/ages.py, docs/consistency.md "Rollbacks").
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import redis
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from guard import (
    Change,
    CuckooFilter,
    ShardedCuckooFilter,
    SyncCuckooFilter,
    SyncShardedCuckooFilter,
)
from guard.ages import Rollback

BEFORE = [f"old-{i}" for i in range(60)]
SINCE = [f"new-{i}" for i in range(60)]  # written after the snapshot
ABSENT = [f"never-{i}" for i in range(200)]
SOURCE = 991


def snapshot(r: redis.Redis, prefix: str) -> dict[bytes, bytes]:
    """Every key under ``prefix`` (this test's only), as DUMP gives it."""
    return {k: r.dump(k) for k in r.scan_iter(match=f"{prefix}*")}  # type: ignore[misc]


def restore(r: redis.Redis, prefix: str, saved: dict[bytes, bytes]) -> None:
    """The keys under ``prefix`` replaced by ``saved``: keys made since are gone."""
    for key in list(r.scan_iter(match=f"{prefix}*")):
        if key not in saved:
            r.delete(key)
    for key, data in saved.items():
        r.restore(key, 0, data, replace=True)


async def asnapshot(r: aioredis.Redis, prefix: str) -> dict[bytes, bytes]:
    return {k: await r.dump(k) async for k in r.scan_iter(match=f"{prefix}*")}  # type: ignore[misc]


async def arestore(r: aioredis.Redis, prefix: str, saved: dict[bytes, bytes]) -> None:
    async for key in r.scan_iter(match=f"{prefix}*"):
        if key not in saved:
            await r.delete(key)
    for key, data in saved.items():
        await r.restore(key, 0, data, replace=True)


def roll_back(
    r: redis.Redis, prefix: str, cf: SyncCuckooFilter, read: Callable[[], object]
) -> None:
    """``cf`` (reserved) gets BEFORE, a snapshot is taken, SINCE is added, ``read()`` lets
    the handle read that newer filter, then the snapshot comes back."""
    cf.insert_many(BEFORE)
    saved = snapshot(r, prefix)
    cf.insert_many(SINCE)
    read()
    restore(r, prefix, saved)


def false_positives(cf: SyncCuckooFilter | SyncShardedCuckooFilter) -> int:
    return sum(cf.lookup_many(ABSENT))


class TestSync:
    def test_first_lookup_after_a_rollback_finds_every_item_written_since(
        self, sync_redis: redis.Redis, prefix: str
    ) -> None:
        cf = SyncCuckooFilter(sync_redis, "roll", prefix)
        met: list[Rollback] = []
        cf.on_rollback = met.append
        cf.reserve(1000)
        roll_back(sync_redis, prefix, cf, lambda: cf.lookup(SINCE[0]))
        assert all(cf.lookup(x) for x in SINCE)  # the first of these met the rollback
        assert cf.lookup_many(SINCE) == [True] * len(SINCE)
        pipe = cf.pipeline()
        for x in SINCE:
            pipe.lookup(x)
        assert pipe.execute() == [True] * len(SINCE)
        assert cf.rollbacks == 1 and cf.rolled_back
        assert len(met) == 1
        assert met[0].filter == "roll" and met[0].shard is None
        assert met[0].writes == len(BEFORE) < met[0].highest_writes == len(BEFORE) + len(SINCE)

    def test_a_batch_lookup_meets_it_first(self, sync_redis: redis.Redis, prefix: str) -> None:
        cf = SyncCuckooFilter(sync_redis, "roll", prefix)
        cf.reserve(1000)
        roll_back(sync_redis, prefix, cf, lambda: cf.lookup_many(BEFORE[:1]))
        assert cf.lookup_many(SINCE) == [True] * len(SINCE)
        assert cf.rollbacks == 1

    def test_an_api_fed_filter_is_not_trusted_again_until_acknowledged(
        self, sync_redis: redis.Redis, prefix: str
    ) -> None:
        cf = SyncCuckooFilter(sync_redis, "roll", prefix)
        cf.reserve(1000)
        roll_back(sync_redis, prefix, cf, lambda: cf.lookup(SINCE[0]))
        assert cf.lookup(SINCE[1])
        # Writes after the rollback take its write count past the highest read: the items
        # the older copy lacks are lacking all the same.
        cf.insert_many([f"later-{i}" for i in range(3 * len(SINCE))])
        assert cf.lookup_many(SINCE) == [True] * len(SINCE)
        assert cf.rolled_back and cf.rollbacks == 1
        assert false_positives(cf) == len(ABSENT)  # nothing is blocked
        cf.acknowledge_rollback()
        assert not cf.rolled_back
        assert false_positives(cf) < len(ABSENT) // 10  # answers from the filter again
        assert cf.rollbacks == 1

    def test_a_grown_filter_rolled_back_to_before_its_growth(
        self, sync_redis: redis.Redis, prefix: str
    ) -> None:
        cf = SyncCuckooFilter(sync_redis, "roll", prefix)
        cf.reserve(64, expansion=2)
        cf.insert_many(BEFORE[:30])
        saved = snapshot(sync_redis, prefix)
        grown = [f"grown-{i}" for i in range(400)]
        cf.insert_many(grown)
        assert cf.info().subfilters > 1
        assert cf.lookup_many(grown[:5]) == [True] * 5
        restore(sync_redis, prefix, saved)
        assert all(cf.lookup(x) for x in grown[:50])
        assert cf.rollbacks == 1

    def test_a_dropped_and_recreated_filter_is_no_rollback(
        self, sync_redis: redis.Redis, prefix: str
    ) -> None:
        cf = SyncCuckooFilter(sync_redis, "roll", prefix)
        cf.reserve(1000)
        cf.insert_many(BEFORE + SINCE)
        assert cf.lookup(SINCE[0])
        cf.drop()
        cf.reserve(1000)  # a new seed: a new filter
        cf.insert_many(BEFORE[:5])
        assert cf.lookup_many(BEFORE[:5]) == [True] * 5
        assert false_positives(cf) < len(ABSENT) // 10  # it blocks absent items
        assert cf.rollbacks == 0 and not cf.rolled_back
        # So is one replaced by a bulk load (a new seed as well).
        cf.bulk_load(BEFORE[:3], replace=True)
        assert cf.lookup_many(BEFORE[:3]) == [True] * 3
        assert false_positives(cf) < len(ABSENT) // 10
        assert cf.rollbacks == 0

    def test_a_table_backed_filter_is_trusted_again_once_the_feed_is_replayed(
        self, sync_redis: redis.Redis, prefix: str
    ) -> None:
        cf = SyncCuckooFilter(sync_redis, "rows", prefix)
        cf.reserve(1000, source=SOURCE)
        log = [Change(k + 1, True, x) for k, x in enumerate(BEFORE + SINCE)]
        cf.apply_changes(log[: len(BEFORE)], source=SOURCE)
        saved = snapshot(sync_redis, prefix)
        cf.apply_changes(log[len(BEFORE) :], source=SOURCE)
        assert cf.lookup(SINCE[-1])
        restore(sync_redis, prefix, saved)
        assert cf.applied_change() == len(BEFORE)
        assert all(cf.lookup(x) for x in SINCE)
        assert cf.rollbacks == 1 and cf.rolled_back
        cf.apply_changes(log[len(BEFORE) : -1], source=SOURCE)  # the replay, not yet done
        assert cf.lookup(SINCE[-1]) and cf.rolled_back
        assert false_positives(cf) == len(ABSENT)
        cf.apply_changes(log[-1:], source=SOURCE)
        assert cf.lookup_many(SINCE) == [True] * len(SINCE)
        assert not cf.rolled_back
        assert false_positives(cf) < len(ABSENT) // 10
        assert cf.rollbacks == 1

    def test_an_undone_change_is_no_rollback(self, sync_redis: redis.Redis, prefix: str) -> None:
        """undo_change moves ``applied`` back by one (a write whose transaction failed), and
        counts a write: newer, not older."""
        cf = SyncCuckooFilter(sync_redis, "rows", prefix)
        cf.reserve(1000, source=SOURCE)
        log = [Change(k + 1, True, x) for k, x in enumerate(BEFORE)]
        cf.apply_changes(log, source=SOURCE)
        assert cf.lookup(BEFORE[-1])
        assert cf.undo_change(log[-1], source=SOURCE)
        cf.lookup(BEFORE[0])
        assert cf.rollbacks == 0 and not cf.rolled_back
        assert false_positives(cf) < len(ABSENT) // 10

    def test_sharded(self, sync_redis: redis.Redis, prefix: str) -> None:
        cf = SyncShardedCuckooFilter(sync_redis, "roll", prefix, shards=3)
        met: list[Rollback] = []
        cf.on_rollback = met.append
        cf.reserve(1000)
        cf.insert_many(BEFORE)
        saved = snapshot(sync_redis, prefix)
        cf.insert_many(SINCE)
        assert cf.lookup_many(SINCE[:1]) == [True]
        cf.lookup_many(ABSENT)  # every shard read
        restore(sync_redis, prefix, saved)
        assert all(cf.lookup(x) for x in SINCE)
        assert cf.rolled_back and cf.rollbacks == len(met) >= 1
        assert {r.shard for r in met} <= {0, 1, 2}


class TestAsync:
    @pytest.mark.parametrize("coalesce", [True, False])
    async def test_first_lookup_after_a_rollback(
        self, async_redis: aioredis.Redis, prefix: str, coalesce: bool
    ) -> None:
        cf = CuckooFilter(async_redis, "roll", prefix, coalesce=coalesce)
        await cf.reserve(1000)
        await cf.insert_many(BEFORE)
        saved = await asnapshot(async_redis, prefix)
        await cf.insert_many(SINCE)
        assert await cf.lookup(SINCE[0])
        await arestore(async_redis, prefix, saved)
        for x in SINCE:
            assert await cf.lookup(x)
        assert await cf.lookup_many(SINCE) == [True] * len(SINCE)
        pipe = cf.pipeline()
        for x in SINCE:
            pipe.lookup(x)
        assert await pipe.execute() == [True] * len(SINCE)
        assert cf.rollbacks == 1 and cf.rolled_back

    async def test_sharded(self, async_redis: aioredis.Redis, prefix: str) -> None:
        cf = ShardedCuckooFilter(async_redis, "roll", prefix, shards=2)
        await cf.reserve(1000)
        await cf.insert_many(BEFORE)
        saved = await asnapshot(async_redis, prefix)
        await cf.insert_many(SINCE)
        await cf.lookup_many(ABSENT)
        await arestore(async_redis, prefix, saved)
        for x in SINCE:
            assert await cf.lookup(x)
        assert cf.rolled_back and cf.rollbacks >= 1


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    ops=st.lists(
        st.sampled_from(["insert", "delete", "snapshot", "restore", "lookup"]), max_size=30
    ),
    salt=st.integers(0, 2**32 - 1),
)
def test_no_present_item_is_ever_answered_absent(
    ops: list[str], salt: int, sync_redis: redis.Redis, prefix: str
) -> None:
    """Fault injection: writes, snapshots and restores of older copies in any order; every
    item the handle has seen present in the newest filter it read, and not deleted since
    then, reads present through every lookup path."""
    rng = random.Random(salt)
    pre = f"{prefix}{salt}:"
    for key in list(sync_redis.scan_iter(match=f"{pre}*")):
        sync_redis.delete(key)
    cf = SyncCuckooFilter(sync_redis, "prop", pre)
    cf.reserve(2000)
    live: list[str] = []  # what the current keys hold
    writes = 0  # the current keys' write count: an insert or a delete adds one
    highest = 0  # the highest write count a lookup of the handle read
    owed: set[str] = set()  # what the keys held when the handle read that
    saved: list[tuple[dict[bytes, bytes], list[str], int]] = []
    for k, op in enumerate(ops):
        if op == "insert":
            new = [f"{salt}-{k}-{j}" for j in range(rng.randrange(1, 8))]
            cf.insert_many(new)
            live += new
            writes += len(new)
        elif op == "delete" and live:
            cf.delete(live.pop(rng.randrange(len(live))))
            writes += 1
        elif op == "snapshot":
            saved.append((snapshot(sync_redis, pre), list(live), writes))
        elif op == "restore" and saved:
            keys, items, writes = rng.choice(saved)
            restore(sync_redis, pre, keys)
            live = list(items)
        else:
            if writes >= highest:
                highest, owed = writes, set(live)
            probe = sorted(owed)
            assert cf.lookup_many(probe) == [True] * len(probe)
            assert all(cf.lookup(x) for x in probe)
    for key in list(sync_redis.scan_iter(match=f"{pre}*")):
        sync_redis.delete(key)
