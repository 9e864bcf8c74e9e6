"""The guarded resource: blocking, caches, single-flight, the filter following the table."""

from __future__ import annotations

import asyncio
import sqlite3
from typing import Any

import pytest
from redis.exceptions import TimeoutError as RedisTimeoutError

from guard import CuckooFilter
from guard.changes import ApplyResult, Change
from tests.app.conftest import AUTH, Service, StartService, caught_up, until


async def queries(svc: Service) -> int:
    return int((await svc.client.get("/stats")).json()["db_queries"])


async def overlapping(svc: Service, monkeypatch: pytest.MonkeyPatch, readers: int) -> None:
    """Hold every database read until ``readers`` reads have reached the single-flight, so
    that they overlap however slow the machine is (a fixed latency did not, under load).

    The seeded rows' changes are applied first: each bumps its key's cache version, and a
    version bumped between two of the reads puts them in two flights (a load begun before a
    write is not joined), which is right, but not what these tests count."""
    await until(lambda: caught_up(svc), "the follower applied the seeded rows")
    all_in = asyncio.Event()
    arrived = 0
    flight = svc.records.cache._flight
    join, db_get = flight.do, svc.db.get

    async def counted(key: Any, fn: Any) -> Any:
        nonlocal arrived
        arrived += 1
        if arrived == readers:
            all_in.set()
        return await join(key, fn)

    async def held(*args: Any, **kwargs: Any) -> Any:
        await asyncio.wait_for(all_in.wait(), 30)
        return await db_get(*args, **kwargs)

    monkeypatch.setattr(flight, "do", counted)
    monkeypatch.setattr(svc.db, "get", held)


class TestRoutes:
    """GET / PUT / DELETE /records/{key} and /stats."""

    async def test_get_seeded_record(self, svc: Service) -> None:
        r = await svc.client.get("/records/user-7")
        assert r.status_code == 200 and r.json() == {"key": "user-7", "value": "value-7"}
        assert r.headers["x-guard"] == "passed"

    async def test_put_new_is_201_then_replace_is_200(self, svc: Service) -> None:
        r = await svc.client.put("/records/k", json={"value": {"a": [1, 2]}}, headers=AUTH)
        assert r.status_code == 201 and r.json() == {"key": "k", "value": {"a": [1, 2]}}
        r = await svc.client.put("/records/k", json={"value": "v2"}, headers=AUTH)
        assert r.status_code == 200
        assert (await svc.client.get("/records/k")).json() == {"key": "k", "value": "v2"}

    async def test_delete_is_204_then_404(self, svc: Service) -> None:
        r = await svc.client.delete("/records/user-1", headers=AUTH)
        assert r.status_code == 204 and r.content == b""
        r = await svc.client.delete("/records/user-1", headers=AUTH)
        assert r.status_code == 404 and r.json() == {"detail": "Not Found"}
        assert (await svc.client.get("/records/user-1")).status_code == 404

    async def test_put_body_errors(self, svc: Service) -> None:
        r = await svc.client.put("/records/k", json={"valu": 1}, headers=AUTH)
        assert r.status_code == 422
        r = await svc.client.put("/records/" + "k" * 1025, json={"value": 1}, headers=AUTH)
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["path", "key"]

    async def test_stats_fields(self, svc: Service) -> None:
        body = (await svc.client.get("/stats")).json()
        expected = {"db_queries", "blocked", "passed", "cache_hits", "negative_cache_hits",
                    "false_positives"}  # fmt: skip
        assert expected <= body.keys()


class TestGuard:
    """The filter answers for absent keys; the database is asked only for maybe-present ones."""

    async def test_blocked_request_makes_zero_queries(self, svc: Service) -> None:
        before = svc.db.queries
        for i in range(20):
            r = await svc.client.get(f"/records/absent-{i}")
            assert r.status_code == 404 and r.json() == {"detail": "Not Found"}
            assert r.headers["x-guard"] == "blocked"
        assert svc.db.queries == before  # the database's own counter
        stats = (await svc.client.get("/stats")).json()
        assert stats["blocked"] == 20 and stats["db_queries"] == before

    async def test_head_is_guarded_too(self, svc: Service) -> None:
        before = svc.db.queries
        r = await svc.client.head("/records/absent")
        assert r.status_code == 404 and r.headers["x-guard"] == "blocked" and r.content == b""
        assert svc.db.queries == before
        r = await svc.client.head("/records/user-1")
        assert r.status_code == 200 and r.content == b""

    async def test_present_key_is_cached_on_request(self, start: StartService) -> None:
        svc = await start(cache_ttl=300)
        await svc.client.get("/records/user-3")
        before = svc.db.queries
        for _ in range(5):
            assert (await svc.client.get("/records/user-3")).json()["value"] == "value-3"
        assert svc.db.queries == before
        assert (await svc.client.get("/stats")).json()["cache_hits"] >= 5

    async def test_rows_are_not_cached_by_default(self, svc: Service) -> None:
        """UPDATEs of other columns made outside the service are not in the change feed:
        a cached row could be stale, so rows are read from the database each time."""
        await svc.client.get("/records/user-3")
        before = svc.db.queries
        assert (await svc.client.get("/records/user-3")).json()["value"] == "value-3"
        assert svc.db.queries == before + 1

    async def test_false_positive_is_counted_and_negatively_cached(self, svc: Service) -> None:
        # A fingerprint with no row behind it: what a false positive looks like.
        await svc.records.filter.insert("ghost")
        before = svc.db.queries
        for _ in range(5):
            r = await svc.client.get("/records/ghost")
            assert r.status_code == 404 and r.headers["x-guard"] == "passed"
        assert svc.db.queries == before + 1  # one query, then the negative cache answers
        stats = (await svc.client.get("/stats")).json()
        assert stats["false_positives"] == 1 and stats["negative_cache_hits"] == 4

    async def test_negative_entry_expires(self, start: StartService) -> None:
        svc = await start(negative_ttl=0.05)
        await svc.records.filter.insert("ghost")
        await svc.client.get("/records/ghost")
        await asyncio.sleep(0.2)
        before = svc.db.queries
        await svc.client.get("/records/ghost")
        assert svc.db.queries == before + 1

    async def test_put_clears_negative_entry(self, svc: Service) -> None:
        await svc.records.filter.insert("later")
        assert (await svc.client.get("/records/later")).status_code == 404  # cached negative
        await svc.client.put("/records/later", json={"value": 1}, headers=AUTH)
        assert (await svc.client.get("/records/later")).json() == {"key": "later", "value": 1}

    async def test_put_replaces_cached_value(self, start: StartService) -> None:
        svc = await start(cache_ttl=300)
        await svc.client.get("/records/user-2")  # now cached
        await svc.client.put("/records/user-2", json={"value": "new"}, headers=AUTH)
        assert (await svc.client.get("/records/user-2")).json()["value"] == "new"

    async def test_concurrent_misses_make_one_query(
        self, svc: Service, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        await overlapping(svc, monkeypatch, 20)
        before = svc.db.queries
        rs = await asyncio.gather(*(svc.client.get("/records/user-9") for _ in range(20)))
        assert all(r.json()["value"] == "value-9" for r in rs)
        assert svc.db.queries == before + 1

    async def test_concurrent_false_positives_make_one_query(
        self, svc: Service, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        await svc.records.filter.insert("ghost")
        await overlapping(svc, monkeypatch, 20)
        before = svc.db.queries
        rs = await asyncio.gather(*(svc.client.get("/records/ghost") for _ in range(20)))
        assert all(r.status_code == 404 for r in rs)
        assert svc.db.queries == before + 1
        assert (await svc.client.get("/stats")).json()["false_positives"] == 1

    async def test_unguarded_routes_pass_untouched(self, svc: Service) -> None:
        r = await svc.client.get("/filters")
        assert "x-guard" not in r.headers


class TestFilterFollowsTable:
    """One fingerprint per row: PUT new adds one, replace adds none, DELETE removes one."""

    async def test_one_copy_per_row(self, svc: Service) -> None:
        cf = svc.records.filter
        assert await cf.count("new-key") == 0
        await svc.client.put("/records/new-key", json={"value": 1}, headers=AUTH)
        assert await cf.count("new-key") == 1
        await svc.client.put("/records/new-key", json={"value": 2}, headers=AUTH)
        assert await cf.count("new-key") == 1
        await svc.client.delete("/records/new-key", headers=AUTH)
        assert await cf.count("new-key") == 0
        await svc.client.delete("/records/new-key", headers=AUTH)  # 404: nothing removed
        assert (await cf.info()).missed_deletes == 0

    async def test_concurrent_puts_of_one_key_add_one_copy(self, svc: Service) -> None:
        rs = await asyncio.gather(
            *(svc.client.put("/records/race", json={"value": i}, headers=AUTH) for i in range(10))
        )
        assert sorted(r.status_code for r in rs) == [200] * 9 + [201]
        assert await svc.records.filter.count("race") == 1

    async def test_a_full_filter_stops_blocking_at_once(self, start: StartService) -> None:
        """A fixed-size filter with no room for a new row's key: the write is committed and
        says so, and from that moment the guard does not trust the filter (every row reads
        as it is); the watchdog rebuilds it with room."""
        svc = await start(audit_interval=0)  # the audit would find the seeded rows missing
        # A tiny filter at the feed's newest change, swapped in at once: current, no room.
        stage, db = svc.records.filter.staging(), svc.db
        await stage.reserve(
            1, expansion=0, bucket_size=1, fingerprint_bits=4,
            applied=await db.newest_change(), source=await db.feed_source(),
        )  # fmt: skip
        await stage.promote()
        written = []
        for i in range(40):
            r = await svc.client.put(f"/records/f{i}", json={"value": i}, headers=AUTH)
            assert r.status_code == 201
            written.append(f"f{i}")
            for key in written:  # no false negative at any moment
                assert (await svc.client.get(f"/records/{key}")).status_code == 200
        watchdog = svc.state["watchdog"]
        assert [i.reason for i in [*watchdog.history, watchdog.incident] if i][:1] == ["full"]

    async def test_a_failed_commit_leaves_no_row_and_no_fingerprint(
        self, svc: Service, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The filter hears of a write only through the change feed, after its commit."""
        store, db = svc.records, svc.db
        writer = db._writer

        async def commit() -> None:
            raise sqlite3.OperationalError("disk I/O error")

        monkeypatch.setattr(writer, "commit", commit)
        with pytest.raises(sqlite3.OperationalError):
            await store.put("doomed", 1)
        monkeypatch.undo()
        assert await db.get("doomed") is None
        assert await store.filter.count("doomed") == 0

    async def test_items_match_rows_after_traffic(self, svc: Service) -> None:
        for i in range(30):
            await svc.client.put(f"/records/t{i}", json={"value": i}, headers=AUTH)
        for i in range(0, 30, 3):
            await svc.client.delete(f"/records/t{i}", headers=AUTH)
        info = await svc.records.filter.info()
        assert info.items == await svc.db.count() == 50 + 20


class TestWriteWithoutAnswer:
    """A write's change that Redis took but did not answer."""

    async def test_a_delete_whose_filter_answer_was_lost_is_done(
        self, svc: Service, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The row is deleted before the filter is asked: the delete happened, and says so;
        the change was applied once (the feed does not apply it again)."""
        real_apply = CuckooFilter.apply_changes

        async def apply_then_time_out(
            self: CuckooFilter, changes: list[Change], *, source: int
        ) -> ApplyResult:
            await real_apply(self, changes, source=source)  # Redis ran it; its answer is lost
            raise RedisTimeoutError("Timeout reading from socket")

        monkeypatch.setattr(CuckooFilter, "apply_changes", apply_then_time_out)
        r = await svc.client.delete("/records/user-5", headers=AUTH)
        assert r.status_code == 204 and await svc.db.get("user-5") is None
        monkeypatch.setattr(CuckooFilter, "apply_changes", real_apply)
        await svc.records.follower.catch_up()
        assert (await svc.records.filter.info()).items == await svc.db.count()
        got = await svc.client.get("/records/user-5")
        assert (got.status_code, got.headers["x-guard"]) == (404, "blocked")
