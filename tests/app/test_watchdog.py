"""The watchdog's rules (app/watchdog.py), on a real database of record and a real filter.

The tests drive the watchdog by hand (check, audit, tick) with a clock of their own: "a change
committed more than max_lag ago" is a clock setting here, never a wait. The change log is
applied by the follower's replay (app/feed.py) when the test says so, and a minimal rebuild
is written below, so each rule is seen on its own: the follower's normal window is not stale;
a change left unapplied past max_lag is; an id that moves back is at once; a missing key, a
filter of another change log, zeroed buckets (the audit) are; each is repaired by replay or
rebuild.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
import redis.asyncio as aioredis

from app.db import Database
from app.feed import Follower, replay
from app.settings import Settings
from app.watchdog import (
    AHEAD,
    AUDIT_MISS,
    BEHIND,
    CLEAN,
    INCONCLUSIVE,
    MISSING,
    OTHER_SOURCE,
    ROLLED_BACK,
    STARTUP,
    Watchdog,
    WatchdogSettings,
)
from guard import CuckooFilter
from guard.changes import Change
from guard.layout import HEADER_BYTES, TAG_BYTES
from tests.app.dbs import OpenDb, Other

MAX_LAG = 1.0
ROWS = 60


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Rig:
    db: Database
    cf: CuckooFilter
    redis: aioredis.Redis
    source: int
    clock: Clock
    watchdog: Watchdog
    catch_ups: int = 0
    rebuilds: int = 0

    async def catch_up(self) -> int:
        """The follower's replay (app/feed.py), counted."""
        self.catch_ups += 1
        return await replay(self.cf, self.db, self.source, batch=500)

    async def rebuild(self) -> None:
        """A minimal rebuild: the table's snapshot, bulk loaded, then caught up."""
        self.rebuilds += 1
        keys: list[str] = []
        snapshot: list[int] = []

        async def at(change_id: int) -> None:
            snapshot.append(change_id)

        async for batch in self.db.iter_keys(1000, at):
            keys += batch
        await self.cf.bulk_load(
            keys, 4 * ROWS, replace=True, applied=snapshot[0], source=self.source
        )
        await self.catch_up()

    async def keys(self) -> list[str]:
        return [k async for batch in self.db.iter_keys(1000) for k in batch]

    async def all_found(self) -> bool:
        return all(await self.cf.lookup_many(await self.keys()))

    def filter_keys(self) -> list[str]:
        return [self.cf.key(0)]


@pytest.fixture
async def rig(open_db: OpenDb, async_redis: aioredis.Redis, prefix: str) -> Rig:
    """ROWS rows written, a filter built from them (current), a watchdog not yet started."""
    db = await open_db()
    for i in range(ROWS):
        await db.put(f"row-{i}", '"v"')
    cf = CuckooFilter(async_redis, "records", prefix)
    clock = Clock()
    rig = Rig(db, cf, async_redis, await db.feed_source(), clock, None)  # type: ignore[arg-type]
    rig.watchdog = Watchdog(
        cf,
        db,
        rebuild=rig.rebuild,
        catch_up=rig.catch_up,
        settings=WatchdogSettings(interval=0.01, max_lag=MAX_LAG, audit_sample=ROWS),
        clock=clock,
    )
    await rig.rebuild()
    rig.rebuilds = rig.catch_ups = 0
    return rig


async def direct_insert(other: Other, *keys: str) -> None:
    """Rows written by another connection: logged by the triggers, the filter not told."""
    values = ", ".join(f"('{k}', '\"d\"')" for k in keys)
    await other(f"INSERT INTO records (key, value) VALUES {values}")


class TestWatermark:
    """The filter's applied id against the database's newest change."""

    async def test_a_current_filter_is_trusted_from_the_start(self, rig: Rig) -> None:
        await rig.watchdog.start()
        assert not rig.watchdog.stale and rig.watchdog.opened == 0

    async def test_behind_at_start_up_until_caught_up(self, rig: Rig, other: Other) -> None:
        await direct_insert(other, "late-1", "late-2")
        await rig.watchdog.start()
        assert rig.watchdog.incident is not None
        assert rig.watchdog.incident.reason == STARTUP
        await rig.watchdog.tick()
        assert not rig.watchdog.stale and rig.catch_ups == 1 and rig.rebuilds == 0
        assert await rig.all_found()

    async def test_the_followers_window_is_not_stale(self, rig: Rig, other: Other) -> None:
        """Changes committed and not yet applied, for less than max_lag: trusted."""
        await rig.watchdog.start()
        for n in range(5):
            await direct_insert(other, f"new-{n}")
            await rig.watchdog.check()
            rig.clock.now += MAX_LAG * 0.6
            await rig.watchdog.check()
            await rig.catch_up()  # the follower applies it within the window
            await rig.watchdog.check()
        assert rig.watchdog.opened == 0

    async def test_a_change_unapplied_past_max_lag_is_stale(self, rig: Rig, other: Other) -> None:
        await rig.watchdog.start()
        await direct_insert(other, "unapplied")
        await rig.watchdog.check()
        rig.clock.now += MAX_LAG * 0.9
        await rig.watchdog.check()
        assert not rig.watchdog.stale
        rig.clock.now += MAX_LAG * 0.2
        await rig.watchdog.check()
        assert rig.watchdog.incident is not None and rig.watchdog.incident.reason == BEHIND
        await rig.watchdog.tick()
        assert not rig.watchdog.stale and rig.catch_ups == 1
        assert await rig.cf.lookup("unapplied")

    async def test_an_id_moving_back_is_stale_at_once(self, rig: Rig, other: Other) -> None:
        """An older copy of the filter (as after an older RDB or a lagging replica)."""
        await rig.watchdog.start()
        copy = await rig.redis.dump(rig.cf.key(0))
        await direct_insert(other, "after-copy-1", "after-copy-2")
        await rig.catch_up()
        await rig.watchdog.check()
        await rig.redis.restore(rig.cf.key(0), 0, copy, replace=True)
        await rig.watchdog.check()  # no time passed
        assert rig.watchdog.incident is not None
        assert rig.watchdog.incident.reason == ROLLED_BACK
        assert not await rig.cf.lookup("after-copy-1")  # what the guard must not trust
        await rig.watchdog.tick()
        assert not rig.watchdog.stale and rig.catch_ups == 2 and rig.rebuilds == 0
        assert await rig.all_found()

    async def test_a_compacted_log_means_a_rebuild(self, rig: Rig, other: Other) -> None:
        await rig.watchdog.start()
        copy = await rig.redis.dump(rig.cf.key(0))
        await direct_insert(other, "gone-1", "gone-2")
        await rig.catch_up()
        await rig.watchdog.check()
        await rig.db.compact(await rig.db.newest_change())
        await rig.redis.restore(rig.cf.key(0), 0, copy, replace=True)
        await rig.watchdog.tick()
        assert rig.watchdog.history[-1].how == "rebuild" and rig.rebuilds == 1
        assert not rig.watchdog.stale and await rig.all_found()

    async def test_a_database_that_lost_commits_means_a_rebuild(
        self, rig: Rig, other: Other, db_url: str
    ) -> None:
        """The database goes back (a backup restored, a replica that lacked the last commits)
        while the filter keeps them: the positions come again, and a replay would skip the
        new rows under them as applied."""
        before = await rig.db.newest_change()
        await direct_insert(other, "lost-1", "lost-2", "lost-3")
        await rig.catch_up()
        await rig.watchdog.start()
        # The database as it was before the three inserts: rows, and its change feed.
        await other("DELETE FROM records WHERE key IN ('lost-1', 'lost-2', 'lost-3')")
        if db_url.startswith("sqlite:"):
            await other(f"DELETE FROM guard_changes WHERE id > {before}")
            await other(f"UPDATE guard_feed SET last_id = {before}")
        else:
            await other(f"DELETE FROM guard_ticks WHERE position > {before}")
            await other(
                "DELETE FROM guard_events e USING (SELECT snapshot FROM guard_ticks "
                "ORDER BY tick DESC LIMIT 1) t WHERE NOT pg_visible_in_snapshot(e.txid, t.snapshot)"
            )
        await direct_insert(other, "reborn-1")  # takes a position the filter holds as applied
        await rig.watchdog.check()
        assert rig.watchdog.incident is not None and rig.watchdog.incident.reason == AHEAD
        await rig.watchdog.tick()
        assert rig.rebuilds == 1 and not rig.watchdog.stale
        assert await rig.cf.lookup("reborn-1") and await rig.all_found()

    async def test_applied_past_the_feed_is_ahead_at_once(self, rig: Rig) -> None:
        """Changes reach the filter only from the feed: a filter one change past the newest
        has a change the database does not (no write in flight excuses it)."""
        await rig.watchdog.start()
        newest = await rig.db.newest_change()
        await rig.cf.apply_changes([Change(newest + 1, True, "ghost")], source=rig.source)
        await rig.watchdog.check()  # no time passed
        assert rig.watchdog.incident is not None and rig.watchdog.incident.reason == AHEAD


class TestLostFilter:
    """No filter, or one of another database: only a rebuild repairs it."""

    async def test_a_missing_key(self, rig: Rig) -> None:
        await rig.watchdog.start()
        await rig.redis.delete(*rig.filter_keys())
        await rig.watchdog.check()
        assert rig.watchdog.incident is not None and rig.watchdog.incident.reason == MISSING
        await rig.watchdog.tick()
        assert not rig.watchdog.stale and rig.rebuilds == 1
        assert await rig.all_found()

    async def test_a_filter_of_another_change_log(self, rig: Rig) -> None:
        await rig.watchdog.start()
        keys = await rig.keys()
        await rig.cf.bulk_load(
            keys, 4 * ROWS, replace=True, applied=await rig.db.newest_change(), source=12345
        )
        await rig.watchdog.check()
        assert not rig.watchdog.stale  # its id says nothing
        rig.clock.now += 10
        await rig.watchdog.tick()  # the audit reads its source
        incident = rig.watchdog.history[-1] if rig.watchdog.history else rig.watchdog.incident
        assert incident is not None and incident.reason == OTHER_SOURCE
        assert not rig.watchdog.stale and rig.rebuilds == 1
        assert (await rig.cf.info()).change_source == rig.source


class TestAudit:
    """Sampled existing keys looked up: a miss is confirmed before it counts."""

    async def test_zeroed_buckets_are_an_audit_miss(self, rig: Rig) -> None:
        await rig.watchdog.start()
        key = rig.cf.key(0)
        size = int(await rig.redis.strlen(key))
        await rig.redis.setrange(key, HEADER_BYTES, bytes(size - HEADER_BYTES - TAG_BYTES))
        await rig.watchdog.check()
        assert not rig.watchdog.stale  # the id is right: nothing in any counter
        rig.clock.now += 10
        await rig.watchdog.tick()
        assert rig.watchdog.history[-1].reason == AUDIT_MISS
        assert rig.watchdog.history[-1].how == "rebuild"
        assert not rig.watchdog.stale and await rig.all_found()

    async def test_rows_not_yet_applied_are_no_miss(
        self, rig: Rig, other: Other, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Rows in the follower's window read absent; the confirmation reads them again in a
        snapshot of known position, waits for the follower (started here only then) to
        apply that far, and finds them."""
        await rig.watchdog.start()
        await direct_insert(other, *[f"window-{i}" for i in range(ROWS)])
        present_at = rig.db.present_at
        followers: list[asyncio.Task[None]] = []

        async def read_then_follow(keys: list[str]) -> tuple[int, list[str]]:
            got = await present_at(keys)
            followers.append(asyncio.create_task(Follower(rig.cf, rig.db, Settings()).run()))
            return got

        monkeypatch.setattr(rig.db, "present_at", read_then_follow)
        try:
            assert await rig.watchdog.audit() == CLEAN
        finally:
            for task in followers:
                task.cancel()
        assert followers and rig.watchdog.opened == 0

    async def test_a_key_deleted_after_the_snapshot_is_no_miss(
        self, rig: Rig, other: Other, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Read present in the snapshot, deleted and applied before the lookup: the change
        after the snapshot explains the absence."""
        await rig.watchdog.start()
        present_at = rig.db.present_at

        async def read_then_delete(keys: list[str]) -> tuple[int, list[str]]:
            got = await present_at(keys)
            await other("DELETE FROM records WHERE key = 'row-7'")
            await rig.catch_up()
            return got

        monkeypatch.setattr(rig.db, "present_at", read_then_delete)
        assert await rig.watchdog._confirm(["row-7"]) == INCONCLUSIVE
        assert rig.watchdog.opened == 0

    async def test_unconfirmed_while_the_follower_is_behind(self, rig: Rig, other: Other) -> None:
        """No follower: the misses stay unconfirmed (the watchdog applies nothing itself),
        and the watermark rule names the filter BEHIND once max_lag has passed."""
        await rig.watchdog.start()
        await direct_insert(other, *[f"window-{i}" for i in range(ROWS)])
        assert await rig.watchdog.audit() == INCONCLUSIVE
        assert rig.catch_ups == 0 and not rig.watchdog.stale
        rig.clock.now += MAX_LAG
        await rig.watchdog.check()
        assert rig.watchdog.incident is not None and rig.watchdog.incident.reason == BEHIND
