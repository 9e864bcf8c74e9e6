"""The records filter follows the change log: rows written by anyone, exactly once, through
rebuilds and compaction. Each test runs on SQLite and on PostgreSQL (tests/app/dbs.py)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import asyncpg
import pytest
from redis.exceptions import TimeoutError as RedisTimeoutError

from app.db import SnapshotHook
from app.feed import FilterMissing, Follower, OtherSource, ReplayImpossible
from devkit.processes import stop_process
from guard import CuckooFilter
from guard.changes import ApplyResult, Change
from tests.app.conftest import AUTH, Service, StartService, caught_up, until
from tests.app.dbs import Other

# Fingerprints wide enough that two keys colliding in a test is out of the question, so
# counts can be compared exactly; pages small enough that a rebuild reads several; a Redis
# timeout that a loaded machine does not trip.
EXACT = {"records_error_rate": 1e-6, "demo_records": 50, "rebuild_batch": 20, "redis_timeout": 5.0}


@pytest.fixture
def backend() -> str:
    """Real Redis only: these tests are about the databases (fakeredis runs the library's)."""
    return "redis"


async def table_keys(svc: Service) -> list[str]:
    return [k async for page in svc.db.iter_keys(1000) for k in page]


async def assert_filter_is_table(svc: Service, gone: tuple[str, ...] = ()) -> None:
    """One fingerprint per row, none for `gone`, nothing else; at the log's newest id."""
    cf = svc.records.filter
    keys = await table_keys(svc)
    assert [await cf.count(k) for k in keys] == [1] * len(keys)
    assert [await cf.count(k) for k in gone] == [0] * len(gone)
    assert (await cf.info()).items == len(keys)
    assert await cf.applied_change() == await svc.db.newest_change()


def new_follower(svc: Service) -> Follower:
    """Another follower of the records filter: another worker's, or a restarted one."""
    store = svc.records
    return Follower(store.filter, svc.db, store.settings, pinned=store.rebuilder.pinned)


async def start_on(start: StartService, db_url: str, **overrides: Any) -> Service:
    # No watchdog: these tests damage the filter to see what the follower and the rebuild
    # do, and the watchdog would repair it meanwhile (tests/app/test_watchdog.py).
    return await start(**{**EXACT, "database_url": db_url, "watchdog": False, **overrides})


class TestFollower:
    """Rows written behind the service's back reach the filter."""

    async def test_direct_writes_reach_the_filter(
        self, start: StartService, db_url: str, other: Other
    ) -> None:
        svc = await start_on(start, db_url)
        await other("INSERT INTO records (key, value) VALUES ('direct-1', '\"d\"')")
        await other("DELETE FROM records WHERE key = 'user-3'")
        await until(lambda: caught_up(svc), "the follower applied the direct writes")
        got = await svc.client.get("/records/direct-1")
        assert (got.status_code, got.headers["x-guard"]) == (200, "passed")
        got = await svc.client.get("/records/user-3")
        assert (got.status_code, got.headers["x-guard"]) == (404, "blocked")
        await assert_filter_is_table(svc, gone=("user-3",))
        assert svc.state["follower"].problem is None

    async def test_follower_outlives_database_errors(
        self, start: StartService, db_url: str, other: Other, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        svc = await start_on(start, db_url)
        real_wait = svc.db.wait_for_change
        failures = 0

        async def wait_or_fail(after: int, timeout: float) -> int | None:
            nonlocal failures
            if failures < 2:
                failures += 1
                raise OSError("connection to the database lost")
            return await real_wait(after, timeout)

        async def failed_twice() -> bool:
            return failures == 2

        monkeypatch.setattr(svc.db, "wait_for_change", wait_or_fail)
        await until(failed_twice, "the follower waited for changes again")
        await other("INSERT INTO records (key, value) VALUES ('later', '1')")
        await until(lambda: caught_up(svc), "the follower applied the write after the errors")
        assert await svc.records.filter.count("later") == 1

    async def test_replay_after_a_crash_applies_each_change_once(
        self, start: StartService, db_url: str, other: Other, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        svc = await start_on(start, db_url, feed=False, feed_batch=7)
        await other(
            "INSERT INTO records (key, value) SELECT 'd-' || n, '0' FROM "
            + ("generate_series(1, 40) AS g(n)" if "postgres" in db_url else _series(40))
        )
        await other("DELETE FROM records WHERE key IN ('d-3', 'd-9', 'user-1', 'user-2')")
        await other("INSERT INTO records (key, value) VALUES ('d-3', '1')")  # back again
        crashed = new_follower(svc)
        real_apply = CuckooFilter.apply_changes
        calls = 0

        async def apply_then_die(
            self: CuckooFilter, changes: list[Change], *, source: int
        ) -> ApplyResult:
            nonlocal calls
            calls += 1
            result = await real_apply(self, changes, source=source)
            if calls == 3:  # Redis ran the batch; the follower died before hearing of it
                raise RedisTimeoutError("Timeout reading from socket")
            return result

        monkeypatch.setattr(CuckooFilter, "apply_changes", apply_then_die)
        with pytest.raises(RedisTimeoutError):
            await crashed.catch_up()
        monkeypatch.undo()
        # The restarted follower, and a second one (another worker) at the same time.
        again = [new_follower(svc), new_follower(svc)]
        applied = await asyncio.gather(*(f.catch_up() for f in again))
        assert applied == [await svc.db.newest_change()] * 2
        await assert_filter_is_table(svc, gone=("d-9", "user-1", "user-2"))

    async def test_service_write_applies_the_direct_writes_before_it(
        self, start: StartService, db_url: str, other: Other
    ) -> None:
        svc = await start_on(start, db_url, feed=False)
        await other("INSERT INTO records (key, value) VALUES ('behind', '1')")
        await other("DELETE FROM records WHERE key = 'user-4'")
        r = await svc.client.put("/records/mine", json={"value": 1}, headers=AUTH)
        assert r.status_code == 201
        await assert_filter_is_table(svc, gone=("user-4",))

    async def test_guard_follow_process_applies_direct_writes(
        self, make_settings: Callable[..., Any], db_url: str, other: Other
    ) -> None:
        cfg = make_settings(**{**EXACT, "database_url": db_url, "demo_records": 0})
        env = {
            **os.environ,
            "GUARD_REDIS_URL": cfg.redis_url,
            "GUARD_KEY_PREFIX": cfg.key_prefix,
            "GUARD_DATABASE_URL": db_url,
            "GUARD_RECORDS_ERROR_RATE": "1e-6",
        }
        await other(
            "CREATE TABLE IF NOT EXISTS records (key TEXT PRIMARY KEY, value TEXT NOT NULL)"
        )
        await other("INSERT INTO records (key, value) VALUES ('before', '1')")
        proc = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "follow"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        try:
            from redis.asyncio import Redis

            redis = Redis.from_url(cfg.redis_url)
            cf = CuckooFilter(redis, cfg.records_filter, prefix=cfg.key_prefix)

            async def found(key: str) -> bool:
                assert proc.poll() is None, "guard follow exited"
                return await cf.exists() and await cf.lookup(key)

            await until(lambda: found("before"), "guard follow built the filter")
            await other("INSERT INTO records (key, value) VALUES ('after', '1')")
            await other("DELETE FROM records WHERE key = 'before'")
            await until(lambda: _not(found("before")), "guard follow applied the delete")
            assert await cf.count("after") == 1
            await redis.aclose()
        finally:
            stop_process(proc)
            out = proc.stdout.read().decode() if proc.stdout else ""
        assert "following the change log" in out
        assert proc.returncode == 0, out  # SIGTERM: a clean stop


class TestLongTransactions:
    """A transaction held open does not hold back the changes committed meanwhile."""

    async def test_the_others_are_applied_while_one_is_held(
        self, start: StartService, pg_url: str
    ) -> None:
        svc = await start_on(start, pg_url)
        cf = svc.records.filter
        holder = await asyncpg.connect(pg_url)
        others = await asyncpg.connect(pg_url, server_settings={"statement_timeout": "10s"})
        try:
            held = holder.transaction()
            await held.start()
            await holder.execute("INSERT INTO records VALUES ('held', '1')")
            for n in range(5):
                await others.execute("INSERT INTO records VALUES ($1, '1')", f"meanwhile-{n}")

            async def all_meanwhile() -> bool:
                return all(await cf.lookup_many([f"meanwhile-{n}" for n in range(5)]))

            await until(all_meanwhile, "the follower applied the others' rows")
            assert not await cf.lookup("held")  # not committed: not applied
            await held.commit()
            await until(lambda: cf.lookup("held"), "the held row applied once committed")
            await assert_filter_is_table(svc)
        finally:
            await holder.close()
            await others.close()


class TestWrites:
    """A service write is in the filter when it answers, through the feed, applied once."""

    async def test_a_write_is_in_the_filter_when_it_answers(
        self, start: StartService, db_url: str
    ) -> None:
        svc = await start_on(start, db_url, feed=False)  # no follower: the write's own round
        store = svc.records
        r = await svc.client.put("/records/new", json={"value": 1}, headers=AUTH)
        assert r.status_code == 201 and await store.filter.count("new") == 1
        r = await svc.client.delete("/records/user-5", headers=AUTH)
        assert r.status_code == 204 and await store.filter.count("user-5") == 0
        assert await store.filter.applied_change() == await svc.db.newest_change()
        # Another follower finds nothing left to apply: no change twice.
        await new_follower(svc).catch_up()
        await assert_filter_is_table(svc, gone=("user-5",))

    async def test_a_write_committed_before_redis_failed_answers_success(
        self, start: StartService, db_url: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Redis gone between the commit and the write's round: the row is written, so the
        write says so; the follower applies the change once Redis answers."""
        svc = await start_on(start, db_url)
        store = svc.records
        real_sync = store.follower.sync

        async def sync_fails() -> int:
            raise RedisTimeoutError("Timeout reading from socket")

        monkeypatch.setattr(store.follower, "sync", sync_fails)
        r = await svc.client.put("/records/late", json={"value": 1}, headers=AUTH)
        assert r.status_code == 201 and await svc.db.get("late") == "1"
        monkeypatch.setattr(store.follower, "sync", real_sync)
        await until(lambda: caught_up(svc), "the follower applied the write")
        await assert_filter_is_table(svc)


async def read_held_after_loading(
    svc: Service, monkeypatch: pytest.MonkeyPatch, key: str
) -> tuple[asyncio.Task[Any], asyncio.Event]:
    """A GET of `key` that has read its row from the database and is held there, before it
    caches anything, until the event returned is set; later reads are not held."""
    loaded, release = asyncio.Event(), asyncio.Event()
    db_get = svc.db.get

    async def held(*args: Any, **kwargs: Any) -> Any:
        row = await db_get(*args, **kwargs)
        loaded.set()
        await asyncio.wait_for(release.wait(), 30)
        return row

    monkeypatch.setattr(svc.db, "get", held)
    reading = asyncio.create_task(svc.client.get(f"/records/{key}"))
    await asyncio.wait_for(loaded.wait(), 30)
    monkeypatch.setattr(svc.db, "get", db_get)
    return reading, release


class TestCachesFollowTheFeed:
    """What the caches hold of a key goes when the feed applies a change of it, in every
    process, whoever wrote it."""

    async def test_a_row_inserted_behind_the_service_drops_its_negative_entry(
        self, start: StartService, db_url: str, other: Other
    ) -> None:
        svc = await start_on(start, db_url)
        await svc.records.filter.insert("ghost")  # a false positive, as far as the table goes
        got = await svc.client.get("/records/ghost")
        assert (got.status_code, got.headers["x-guard"]) == (404, "passed")  # now cached
        await other("INSERT INTO records (key, value) VALUES ('ghost', '\"here\"')")
        await until(lambda: caught_up(svc), "the follower applied the insert")
        got = await svc.client.get("/records/ghost")
        assert (got.status_code, got.json()) == (200, {"key": "ghost", "value": "here"})

    async def test_an_update_behind_the_service_is_read_at_once(
        self, start: StartService, db_url: str, other: Other
    ) -> None:
        """UPDATEs of other columns are not in the feed: rows are not cached by default."""
        svc = await start_on(start, db_url)
        assert (await svc.client.get("/records/user-3")).json()["value"] == "value-3"
        await other("UPDATE records SET value = '\"changed\"' WHERE key = 'user-3'")
        assert (await svc.client.get("/records/user-3")).json()["value"] == "changed"

    async def test_a_row_deleted_and_inserted_again_is_read_anew(
        self, start: StartService, db_url: str, other: Other
    ) -> None:
        """Rows cached on request: a delete and an insert of the key drop the cached row."""
        svc = await start_on(start, db_url, cache_ttl=300)
        assert (await svc.client.get("/records/user-4")).json()["value"] == "value-4"
        await other("DELETE FROM records WHERE key = 'user-4'")
        await other("INSERT INTO records (key, value) VALUES ('user-4', '\"again\"')")
        await until(lambda: caught_up(svc), "the follower applied both")
        assert (await svc.client.get("/records/user-4")).json()["value"] == "again"

    async def test_another_process_sees_the_entries_go(
        self, start: StartService, db_url: str, other: Other
    ) -> None:
        """Two service processes: the one without a follower caches, the other one's
        follower applies the change, and the first one's readers see the row."""
        following = await start_on(start, db_url)
        reader = await start_on(start, db_url, feed=False, cache_ttl=300)
        await reader.records.filter.insert("later")
        assert (await reader.client.get("/records/later")).status_code == 404  # cached
        assert (await reader.client.get("/records/user-6")).json()["value"] == "value-6"
        await other("INSERT INTO records (key, value) VALUES ('later', '1')")
        await other("DELETE FROM records WHERE key = 'user-6'")
        await until(lambda: caught_up(following), "the other process applied both")
        assert (await reader.client.get("/records/later")).json() == {"key": "later", "value": 1}
        assert (await reader.client.get("/records/user-6")).status_code == 404

    async def test_a_load_in_flight_during_a_change_caches_nothing(
        self, start: StartService, db_url: str, other: Other, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A read that loaded the row before a change applied meanwhile answers what it read,
        and does not cache it: the next read finds the change."""
        svc = await start_on(start, db_url, cache_ttl=300)
        reading, release = await read_held_after_loading(svc, monkeypatch, "user-5")
        await other("DELETE FROM records WHERE key = 'user-5'")
        await until(lambda: caught_up(svc), "the follower applied the delete")
        release.set()
        assert (await reading).json()["value"] == "value-5"  # what it read, before
        assert (await svc.client.get("/records/user-5")).status_code == 404

    async def test_an_earlier_versions_bump_still_stops_a_load(
        self, start: StartService, db_url: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """During a rolling upgrade a process of the earlier version bumps a key's version
        with INCR: a load version is a number, so the bump works and the load caches
        nothing."""
        svc = await start_on(start, db_url, cache_ttl=300)
        cache = svc.records.cache
        reading, release = await read_held_after_loading(svc, monkeypatch, "user-7")
        version_key, cache_key = cache._keys("user-7")
        await cache.redis.incr(version_key)  # what the earlier version's change did
        release.set()
        assert (await reading).status_code == 200
        assert await cache.redis.exists(cache_key) == 0

    async def test_changes_leave_nothing_in_redis(
        self, start: StartService, db_url: str, other: Other
    ) -> None:
        """Applying a change deletes its key's cache entries and load version, and writes
        nothing in their place: Redis holds nothing per change, however many there are."""
        svc = await start_on(start, db_url, cache_ttl=300)
        assert (await svc.client.get("/records/user-2")).status_code == 200  # cached
        rows = ", ".join(f"('bulk-{i}', '1')" for i in range(500))
        await other(f"INSERT INTO records (key, value) VALUES {rows}")
        await other("DELETE FROM records WHERE key = 'user-2'")
        await until(lambda: caught_up(svc), "the follower applied them")
        pattern = f"{svc.settings.key_prefix}app:cache:*"
        assert [k async for k in svc.records.cache.redis.scan_iter(match=pattern)] == []


class TestNeedsRebuild:
    """What the follower cannot repair by replay, it names; a rebuild repairs it."""

    async def test_missing_filter(self, start: StartService, db_url: str) -> None:
        svc = await start_on(start, db_url, feed=False)
        await svc.records.filter.drop()
        follower = new_follower(svc)
        with pytest.raises(FilterMissing):
            await follower.catch_up()
        await svc.records.rebuild()
        await follower.catch_up()
        await assert_filter_is_table(svc)

    async def test_filter_of_another_log(self, start: StartService, db_url: str) -> None:
        svc = await start_on(start, db_url, feed=False)
        cf = svc.records.filter
        await cf.drop()
        await cf.reserve(1000, applied=1, source=(await svc.db.feed_source()) ^ 1)
        with pytest.raises(OtherSource, match="follows change log"):
            await new_follower(svc).catch_up()

    async def test_log_compacted_past_an_older_copy(
        self, start: StartService, db_url: str, other: Other
    ) -> None:
        svc = await start_on(start, db_url, feed=False, feed_retain=0)
        cf, redis = svc.records.filter, svc.redis
        older = await redis.dump(cf.key(0))
        await other("INSERT INTO records (key, value) VALUES ('new-1', '1')")
        await other("INSERT INTO records (key, value) VALUES ('new-2', '1')")
        follower = new_follower(svc)
        applied = await follower.catch_up()
        assert await follower.compact() > 0
        assert await svc.db.oldest_change() == applied + 1
        await redis.restore(cf.key(0), 0, older, replace=True)  # Redis back from a snapshot
        with pytest.raises(ReplayImpossible, match="compacted"):
            await follower.catch_up()
        await svc.records.rebuild()
        await follower.catch_up()
        await assert_filter_is_table(svc)


class TestRebuild:
    """Rebuilds from the bulk builder, brought up to date from the log."""

    async def test_writes_during_a_rebuild_are_in_the_new_filter(
        self, start: StartService, db_url: str, other: Other, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        svc = await start_on(start, db_url, feed=False)
        store = svc.records

        async def during() -> None:  # after the snapshot, before the promote
            await other("INSERT INTO records (key, value) VALUES ('direct-add', '1')")
            await other("DELETE FROM records WHERE key = 'user-7'")
            assert await store.put("service-add", 1)
            assert await store.delete("user-8")

        monkeypatch.setattr(svc.db, "iter_keys", _pausing(svc.db.iter_keys, during))
        await store.rebuild()
        monkeypatch.undo()
        for key in ("direct-add", "service-add"):
            assert (await svc.client.get(f"/records/{key}")).status_code == 200
        await assert_filter_is_table(svc, gone=("user-7", "user-8"))

    async def test_compaction_keeps_the_retention_and_a_running_rebuilds_snapshot(
        self, start: StartService, db_url: str, other: Other, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        svc = await start_on(start, db_url, feed=False, feed_retain=5)
        store, db = svc.records, svc.db
        for n in range(20):
            await other(f"INSERT INTO records (key, value) VALUES ('a-{n}', '1')")
            await db.newest_change()  # each its own batch: PostgreSQL compacts whole ones
        follower = new_follower(svc)
        applied = await follower.catch_up()
        await follower.compact()
        assert await db.oldest_change() == applied - 5 + 1
        follower.retain = 0
        snapshot_taken, go_on = asyncio.Event(), asyncio.Event()

        async def during() -> None:
            snapshot_taken.set()
            await go_on.wait()

        monkeypatch.setattr(db, "iter_keys", _pausing(db.iter_keys, during))
        rebuild = asyncio.create_task(store.rebuild())
        await snapshot_taken.wait()
        snapshot = await store.rebuilder.pinned()
        assert snapshot == applied
        for n in range(10):
            await other(f"INSERT INTO records (key, value) VALUES ('b-{n}', '1')")
            await db.newest_change()
        assert await follower.catch_up() == applied + 10
        await follower.compact()
        assert await db.oldest_change() == snapshot + 1  # what the rebuild still needs
        go_on.set()
        await rebuild
        assert await store.rebuilder.pinned() is None
        await follower.compact()
        assert await db.oldest_change() == applied + 10 + 1  # retain 0: all passed
        await assert_filter_is_table(svc)


def _pausing(
    iter_keys: Callable[..., AsyncIterator[list[str]]], during: Callable[[], Awaitable[None]]
) -> Callable[..., AsyncIterator[list[str]]]:
    """``iter_keys`` that runs ``during()`` after its first page: between the snapshot and the
    end of the build."""

    async def pages(
        batch_size: int, at_snapshot: SnapshotHook | None = None
    ) -> AsyncIterator[list[str]]:
        first = True
        async for page in iter_keys(batch_size, at_snapshot):
            yield page
            if first:
                first = False
                await during()

    return pages


def _series(n: int) -> str:
    """1..n as a SQLite table expression (PostgreSQL has generate_series)."""
    return (
        f"(WITH RECURSIVE g(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM g WHERE n < {n}) "
        "SELECT n FROM g) AS g"
    )


async def _not(check: Awaitable[bool]) -> bool:
    return not await check
