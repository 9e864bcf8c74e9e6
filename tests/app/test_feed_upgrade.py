"""An installed change log of the earlier kind (numbered under a lock every writer took) is
upgraded in place at start-up: the changes it still holds keep their ids, a filter that stood
at one of them follows on, and writers stop waiting for each other."""

from __future__ import annotations

from pathlib import Path

import asyncpg
import redis.asyncio as aioredis

from app.db import open_database
from app.feed import Follower
from app.settings import Settings
from guard import Change, CuckooFilter

OLD_LOG = Path(__file__).with_name("old_change_log.sql")
SOURCE = 4242


async def test_an_old_log_is_upgraded_in_place(
    pg_url: str, async_redis: aioredis.Redis, prefix: str
) -> None:
    conn = await asyncpg.connect(pg_url)
    await conn.execute("CREATE TABLE records (key text PRIMARY KEY, value text NOT NULL)")
    await conn.execute(OLD_LOG.read_text())
    await conn.execute("INSERT INTO guard_feed VALUES ($1, 0)", SOURCE)
    for n in range(1, 6):
        await conn.execute("INSERT INTO records VALUES ($1, '1')", f"r{n}")  # ids 1..5
    await conn.execute("DELETE FROM records WHERE key = 'r2'")  # id 6
    await conn.execute("DELETE FROM guard_changes WHERE id <= 2")  # compacted by a follower
    # A filter that had applied ids 1..4 when the service stopped.
    cf = CuckooFilter(async_redis, "records", prefix)
    await cf.bulk_load(["r1", "r2", "r3", "r4"], 100, error_rate=1e-6, applied=4, source=SOURCE)

    db = await open_database(pg_url)
    try:
        assert await conn.fetchval("SELECT to_regclass('guard_changes')") is None
        assert await db.feed_source() == SOURCE
        assert await db.oldest_change() == 3
        assert await db.changes_after(4, 10) == [Change(5, True, "r5"), Change(6, False, "r2")]
        assert await db.newest_change() == 6
        await conn.execute("INSERT INTO records VALUES ('r7', '1')")
        assert await Follower(cf, db, Settings()).catch_up() == 7
        assert [await cf.count(k) for k in ("r1", "r2", "r3", "r4", "r5", "r7")] == [
            1, 0, 1, 1, 1, 1,
        ]  # fmt: skip
        # The new triggers: no lock on guard_feed, which lost its counter.
        columns = await conn.fetch(
            "SELECT attname FROM pg_attribute WHERE attrelid = 'guard_feed'::regclass "
            "AND attnum > 0 AND NOT attisdropped"
        )
        assert [c[0] for c in columns] == ["source"]
    finally:
        await db.close()
        await conn.close()
