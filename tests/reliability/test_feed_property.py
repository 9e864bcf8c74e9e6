"""The change feed, exactly once and in commit order, under the worst a real PostgreSQL and
its writers do: a property test.

Each example runs, for a few seconds and from a random seed: six writer connections doing
random transactions on an overlapping set of keys (inserts, deletes, key changes, inserts of a
key just deleted), a fifth of them rolled back, some held open for seconds, some failing on
their own (unique violations, deadlocks between writers: the application's, not ours), COPYs
of a hundred rows; followers applying the feed, cancelled at random points (mid-batch: a
script that ran without its answer heard) and started again, two at once at times; and a
checker that keeps reading rows in a snapshot, waiting for the followers to apply that far,
and looking them up. The properties:

* no check ever reads a row the snapshot holds as absent, once the filter has applied the
  snapshot's position, unless a later change of that very key explains it;
* at the end, the filter's count of every key ever written equals the table's (1 or 0), and
  its items equal the table's rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import random

import asyncpg
import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.db import Database, open_database
from app.feed import Follower
from app.settings import Settings
from devkit.keys import delete_prefixed_at
from devkit.postgres import temporary_database
from guard import Change, CuckooFilter
from guard.packing import use_hiredis_packing

KEYS = [f"k{i}" for i in range(40)]  # overlapping: every writer touches the same keys
WRITERS = 6
SECONDS = 4.0
PG_PREFIX = "feedprop_"


class Run:
    """One example: the database, the filter, what the checker saw."""

    def __init__(self, db: Database, cf: CuckooFilter, url: str, rng: random.Random) -> None:
        self.db, self.cf, self.url, self.rng = db, cf, url, rng
        self.stop = asyncio.Event()
        self.false_negatives: list[tuple[str, int]] = []
        self.checks = 0
        self.rolled_back = 0
        self.copied: list[str] = []
        self.kills = 0

    async def writer(self, n: int) -> None:
        conn = await asyncpg.connect(self.url)
        rng = random.Random(self.rng.random())
        try:
            i = 0
            while not self.stop.is_set():
                i += 1
                if rng.random() < 0.04:
                    await self.copy(conn, f"c{n}-{i}")
                    continue
                tx = conn.transaction()
                await tx.start()
                try:
                    for _ in range(rng.randint(1, 4)):
                        await self.op(conn, rng)
                    if rng.random() < 0.05:
                        await asyncio.sleep(rng.uniform(0.5, 2.0))  # held open
                    if rng.random() < 0.2:
                        self.rolled_back += 1
                        await tx.rollback()
                    else:
                        await tx.commit()
                except asyncpg.PostgresError:  # the application's own conflicts
                    self.rolled_back += 1
                    with contextlib.suppress(asyncpg.InterfaceError):
                        await tx.rollback()
        finally:
            await conn.close()

    @staticmethod
    async def op(conn: asyncpg.Connection, rng: random.Random) -> None:
        key, other = rng.choice(KEYS), rng.choice(KEYS)
        kind = rng.random()
        if kind < 0.4:
            await conn.execute(
                "INSERT INTO records VALUES ($1, '1') ON CONFLICT (key) DO NOTHING", key
            )
        elif kind < 0.7:
            await conn.execute("DELETE FROM records WHERE key = $1", key)
        elif kind < 0.9:
            await conn.execute("UPDATE records SET key = $2 WHERE key = $1", key, other)
        else:
            await conn.execute("UPDATE records SET value = '2' WHERE key = $1", key)

    async def copy(self, conn: asyncpg.Connection, tag: str) -> None:
        keys = [f"{tag}-{j}" for j in range(100)]
        await conn.copy_records_to_table(
            "records", records=[(k, "1") for k in keys], columns=["key", "value"]
        )
        self.copied += keys
        if self.rng.random() < 0.5:  # and some go again
            await conn.execute("DELETE FROM records WHERE key = ANY($1::text[])", keys[::3])

    async def followers(self) -> None:
        """Followers run, and are cancelled mid-work at random, and started again."""
        rng = random.Random(self.rng.random())
        cfg = Settings(feed_batch=rng.choice([3, 50, 1000]), feed_compact_interval=0.5,
                       feed_retain=rng.choice([0, 50]))  # fmt: skip
        while not self.stop.is_set():
            tasks = [
                asyncio.create_task(Follower(self.cf, self.db, cfg).run())
                for _ in range(rng.choice([1, 1, 2]))
            ]
            await asyncio.sleep(rng.uniform(0.0, 0.4))
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.kills += len(tasks)

    async def checker(self) -> None:
        rng = random.Random(self.rng.random())
        while not self.stop.is_set():
            sample = rng.sample(KEYS, 10) + rng.sample(self.copied, min(5, len(self.copied)))
            position, present = await self.db.present_at(sample)
            for _ in range(200):
                if await self.cf.applied_change() >= position:
                    break
                await asyncio.sleep(0.01)
            else:
                continue  # no follower came by in time: nothing to judge
            found = await self.cf.lookup_many(present) if present else []
            upto = await self.cf.applied_change()
            missed = {k for k, hit in zip(present, found, strict=True) if not hit}
            if missed:
                changes = await read(self.db, position, upto)
                if changes is None:
                    continue  # compacted before it could be read: no verdict either way
                touched = {str(c.item) for c in changes}
                self.false_negatives += [(k, position) for k in missed - touched]
            self.checks += 1


async def read(db: Database, after: int, upto: int) -> list[Change] | None:
    """The changes in (after, upto]; None when some are compacted away already."""
    out: list[Change] = []
    while after < upto:
        changes = await db.changes_after(after, upto - after)
        if not changes or changes[0].id != after + 1:
            return None
        out += changes
        after = changes[-1].id
    return out


async def one_example(seed: int, redis: aioredis.Redis, prefix: str) -> None:
    rng = random.Random(seed)
    async with temporary_database(PG_PREFIX) as url:
        db = await open_database(url)
        try:
            cf = CuckooFilter(redis, f"prop{seed % 10_000}", prefix)
            with contextlib.suppress(Exception):
                await cf.drop()
            # Fingerprints wide enough that counts are exact for a few thousand keys.
            await cf.reserve(4096, error_rate=1e-7, source=await db.feed_source())
            run = Run(db, cf, url, rng)
            tasks = [asyncio.create_task(run.writer(n)) for n in range(WRITERS)]
            tasks += [asyncio.create_task(run.followers()), asyncio.create_task(run.checker())]
            await asyncio.sleep(SECONDS)
            run.stop.set()
            await asyncio.gather(*tasks)
            # A last follower, never cancelled, brings the filter to the end of the feed.
            applied = await Follower(cf, db, Settings()).catch_up()
            assert applied == await db.newest_change()
            conn = await asyncpg.connect(url)
            rows = {r[0] for r in await conn.fetch("SELECT key FROM records")}
            await conn.close()
            everything = sorted(set(KEYS) | set(run.copied))
            counts = [await cf.count(k) for k in everything]
            wrong = [(k, c) for k, c in zip(everything, counts, strict=True)
                     if c != (1 if k in rows else 0)]  # fmt: skip
            assert wrong == []
            assert (await cf.info()).items == len(rows)
            assert run.false_negatives == []
            # The example exercised what it claims to.
            assert run.checks > 5 and run.kills > 5 and run.rolled_back > 10
            await cf.drop()
        finally:
            await db.close()


@pytest.mark.realredis
@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(min_value=0, max_value=2**32 - 1))
def test_the_filter_follows_the_table_exactly_once(
    seed: int, real_redis_url: str, prefix: str
) -> None:
    async def run() -> None:
        client = use_hiredis_packing(aioredis.Redis.from_url(real_redis_url))
        try:
            await one_example(seed, client, prefix)
        finally:
            await client.aclose()

    try:
        asyncio.run(run())
    finally:
        delete_prefixed_at(real_redis_url, prefix)
