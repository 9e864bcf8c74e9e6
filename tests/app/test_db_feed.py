"""The change log every Database keeps: ids, triggers, snapshot id, waits, compaction, audit
samples, existing tables. Each test runs on SQLite and on PostgreSQL (tests/app/dbs.py)."""

from __future__ import annotations

import asyncio
import json

import pytest

from app.db import Database, RecordInputError, TableSpec
from guard.changes import Change
from tests.app.dbs import OpenDb, Other


def keys_of(changes: list[Change]) -> list[tuple[int, bool, str | bytes]]:
    return [(c.id, c.insert, c.item) for c in changes]


class TestLog:
    """What a write logs, and the positions changes get."""

    async def test_put_and_delete_are_fed(self, open_db: OpenDb) -> None:
        db = await open_db()
        assert await db.newest_change() == 0 and await db.oldest_change() == 1
        assert (await db.put("a", '"1"')).created is True
        assert (await db.put("b", '"2"')).created is True
        assert (await db.put("a", '"3"')).created is False  # a replace changes no key
        assert await db.delete("a") is True
        assert await db.delete("a") is False
        fed = [Change(1, True, "a"), Change(2, True, "b"), Change(3, False, "a")]
        assert await db.changes_after(0, 100) == fed
        assert await db.changes_after(1, 1) == [Change(2, True, "b")]
        assert await db.newest_change() == 3 and await db.oldest_change() == 1

    async def test_a_rolled_back_write_is_never_fed(
        self, open_db: OpenDb, rolled_back: Other
    ) -> None:
        db = await open_db()
        await rolled_back("INSERT INTO records (key, value) VALUES ('a', '1')")
        assert await db.newest_change() == 0 and await db.get("a") is None
        await db.put("b", "1")
        assert keys_of(await db.changes_after(0, 10)) == [(1, True, "b")]

    async def test_writes_of_another_connection_are_logged(
        self, open_db: OpenDb, other: Other
    ) -> None:
        db = await open_db()
        await db.put("a", '"1"')
        await other("INSERT INTO records (key, value) VALUES ('x', '1'), ('y', '2')")
        await other("UPDATE records SET value = '5' WHERE key = 'x'")  # not a key change
        await other("UPDATE records SET key = 'z' WHERE key = 'y'")
        await other("DELETE FROM records WHERE key IN ('a', 'x')")
        got = keys_of(await db.changes_after(0, 100))
        assert got[:3] == [(1, True, "a"), (2, True, "x"), (3, True, "y")]
        assert got[3:5] == [(4, False, "y"), (5, True, "z")]
        assert sorted(got[5:]) == [(6, False, "a"), (7, False, "x")]
        assert await db.newest_change() == 7

    async def test_the_log_replays_to_the_table(self, open_db: OpenDb, other: Other) -> None:
        """Applying the log in id order gives exactly the table's keys."""
        db = await open_db()
        for i in range(30):
            await db.put(f"k{i}", "1")
        await other("DELETE FROM records WHERE key LIKE 'k1%'")
        await other("UPDATE records SET key = key || 'x' WHERE key LIKE 'k2%'")
        live: set[str] = set()
        for change in await db.changes_after(0, 1000):
            if change.insert:
                assert change.item not in live
                live.add(str(change.item))
            else:
                live.remove(str(change.item))
        assert live == {k async for batch in db.iter_keys(7) for k in batch}

    async def test_concurrent_writers_leave_no_gap(
        self, open_db: OpenDb, other: Other, rolled_back: Other
    ) -> None:
        """The service and other connections write at once; a reader of the feed never sees
        a position before an earlier one is committed, and rolled-back writes take none."""
        db = await open_db()
        done = False

        async def service() -> None:
            for i in range(30):
                await db.put(f"s{i}", "1")
                await rolled_back(f"INSERT INTO records (key, value) VALUES ('rb{i}', '1')")

        async def direct(n: int) -> None:
            for i in range(30):
                await other(f"INSERT INTO records (key, value) VALUES ('d{n}-{i}', '1')")
                if i % 3 == 0:
                    await other(f"DELETE FROM records WHERE key = 'd{n}-{i}'")

        async def follower() -> list[Change]:
            seen: list[Change] = []
            while True:
                last_round = done
                batch = await db.changes_after(seen[-1].id if seen else 0, 25)
                assert [c.id for c in batch] == list(
                    range(len(seen) + 1, len(seen) + 1 + len(batch))
                )
                seen.extend(batch)
                if last_round and not batch:
                    return seen
                await asyncio.sleep(0)

        follow = asyncio.create_task(follower())
        await asyncio.gather(service(), direct(1), direct(2))
        done = True
        seen = await follow
        live: set[str] = set()
        for change in seen:
            (live.add if change.insert else live.remove)(str(change.item))
        assert live == {k async for batch in db.iter_keys(50) for k in batch}
        assert len(seen) == await db.newest_change() == 30 + 2 * (30 + 10)

    async def test_source_is_made_once(self, open_db: OpenDb) -> None:
        db = await open_db()
        source = await db.feed_source()
        assert 1 <= source <= 2**53 - 1
        await db.close()
        again = await open_db()
        assert await again.feed_source() == source


class TestFeed:
    """What a follower and the audit use: waits, compaction, samples, the snapshot id."""

    async def test_wait_for_change(self, open_db: OpenDb, other: Other) -> None:
        db = await open_db()
        assert await db.wait_for_change(0, 0.05) is None
        waiter = asyncio.create_task(db.wait_for_change(0, 30))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        await other("INSERT INTO records (key, value) VALUES ('x', '1')")
        assert await waiter == 1  # the newest change
        assert await db.wait_for_change(0, 0) == 1  # already there: no wait

    async def test_compact(self, open_db: OpenDb) -> None:
        db = await open_db()
        for i in range(5):
            await db.put(f"k{i}", "1")
            await db.newest_change()  # each its own batch (PostgreSQL compacts whole batches)
        assert await db.compact(3) == 3
        assert await db.oldest_change() == 4
        assert [c.id for c in await db.changes_after(3, 10)] == [4, 5]
        assert await db.compact(5) == 2
        assert await db.oldest_change() == 6 and await db.newest_change() == 5
        await db.put("more", "1")
        assert keys_of(await db.changes_after(5, 10)) == [(6, True, "more")]

    async def test_sample_keys(self, open_db: OpenDb) -> None:
        db = await open_db()
        assert await db.sample_keys(5) == []
        await db.seed(50)
        sample = await db.sample_keys(10)
        assert 1 <= len(sample) <= 10 and len(set(sample)) == len(sample)
        assert None not in [await db.get(k) for k in sample]
        await db.delete("user-1")
        everything = await db.sample_keys(200)
        assert "user-1" not in everything and set(everything) <= {f"user-{i}" for i in range(51)}

    async def test_snapshot_id_matches_the_keys(self, open_db: OpenDb, other: Other) -> None:
        db = await open_db()
        await db.seed(20)
        ids: list[int] = []

        async def at(change_id: int) -> None:
            ids.append(change_id)

        keys: list[str] = []
        async for batch in db.iter_keys(5, at):
            keys.extend(batch)
            await other(f"INSERT INTO records (key, value) VALUES ('late{len(keys)}', '1')")
        assert ids == [20] and sorted(keys) == sorted(f"user-{i}" for i in range(1, 21))
        assert await db.newest_change() == 24


class TestExistingTable:
    """A table the service did not create: integer keys, the record's columns."""

    @pytest.fixture
    async def users(self, open_db: OpenDb, other: Other) -> Database:
        await other("CREATE TABLE users (id bigint PRIMARY KEY, email text, name text)")
        await other("INSERT INTO users VALUES (1, 'a@x', 'Ann'), (2, 'b@x', 'Bob')")
        return await open_db(TableSpec("users", "id", ("id", "name")))

    async def test_integer_keys_travel_as_text(self, users: Database, other: Other) -> None:
        assert json.loads(await users.get("1") or "") == {"id": 1, "name": "Ann"}
        assert await users.get("01") is None and await users.get("one") is None
        assert await users.delete("x") is False
        assert sorted([k async for b in users.iter_keys(10) for k in b]) == ["1", "2"]
        await other("UPDATE users SET id = 7 WHERE id = 2")
        assert keys_of(await users.changes_after(0, 10)) == [(1, False, "2"), (2, True, "7")]
        assert sorted(await users.sample_keys(10)) == ["1", "7"]

    async def test_writes_take_an_object_of_columns(self, users: Database) -> None:
        assert (await users.put("3", json.dumps({"name": "Cy"}))).created is True
        assert json.loads(await users.get("3") or "") == {"id": 3, "name": "Cy"}
        assert (await users.put("3", json.dumps({"name": "Di"}))).created is False
        assert json.loads(await users.get("3") or "") == {"id": 3, "name": "Di"}
        with pytest.raises(RecordInputError) as bad:
            await users.put("4", json.dumps({"nickname": "x"}))
        assert bad.value.loc == ("body", "value", "nickname")
        with pytest.raises(RecordInputError) as bad:
            await users.put("four", json.dumps({"name": "x"}))
        assert bad.value.loc == ("path", "key")
        with pytest.raises(RecordInputError):
            await users.put("5", '"a string"')
        assert await users.count() == 3
