"""PostgreSQL's own side of the change feed: concurrent writers of other connections and
processes, TRUNCATE, COPY, the snapshot under writes, waiting for changes, key types.

Each test has a database of its own on the machine's server (devkit/postgres.py); without a
server they error, never skip.
"""

from __future__ import annotations

import asyncio
import json
import random
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from app.db import DatabaseSetupError, RecordInputError, TableSpec, open_database
from app.db.postgres import PostgresDatabase
from devkit.postgres import temporary_database
from guard.changes import Change
from tests.app.dbs import PG_PREFIX


@pytest.fixture
async def url() -> AsyncIterator[str]:
    async with temporary_database(PG_PREFIX) as u:
        yield u


@pytest.fixture
async def db(url: str) -> AsyncIterator[PostgresDatabase]:
    database = await open_database(url)
    assert isinstance(database, PostgresDatabase)
    yield database
    await database.close()


@pytest.fixture
async def conns(url: str) -> AsyncIterator[list[asyncpg.Connection]]:
    """Three connections of the user's application."""
    opened = [await asyncpg.connect(url) for _ in range(3)]
    yield opened
    for c in opened:
        await c.close()


async def read_all(db: PostgresDatabase, upto: int | None = None) -> list[Change]:
    """Every change from position 1 (to `upto`), however many reads it takes."""
    out: list[Change] = []
    while upto is None or len(out) < upto:
        more = await db.changes_after(len(out), 1000 if upto is None else upto - len(out))
        if not more:
            break
        out += more
    return out


def replay(changes: list[Change]) -> set[str]:
    """The key set the log describes, checking it is consecutive from id 1."""
    live: set[str] = set()
    for i, change in enumerate(changes, start=1):
        assert change.id == i
        if change.insert:
            live.add(str(change.item))
        else:
            live.remove(str(change.item))
    return live


async def waiting_for_lock(watch: asyncpg.Connection, app: str | None = None) -> None:
    """Return once a backend of this database (named `app`, if given) waits for a lock;
    fail if none does within a generous bound (a broken lock must not hang the test)."""
    for _ in range(3000):
        if await watch.fetchval(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock' AND ($1::text IS NULL OR application_name = $1))",
            app,
        ):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"no backend {app or ''} waited for a lock")


class TestConcurrentWriters:
    """Gapless ids, committed in id order, whoever writes."""

    async def test_ids_stay_gapless_and_commit_in_order(
        self, db: PostgresDatabase, conns: list[asyncpg.Connection]
    ) -> None:
        rng = random.Random(16)
        done = False

        async def writer(n: int, conn: asyncpg.Connection) -> None:
            for i in range(40):
                keys = [f"w{n}-{i}-{j}" for j in range(rng.randint(1, 3))]
                async with conn.transaction():
                    await conn.executemany(
                        "INSERT INTO records (key, value) VALUES ($1, '1')", [(k,) for k in keys]
                    )
                    if i % 3 == 0:
                        await conn.execute("DELETE FROM records WHERE key = $1", keys[0])
                with pytest.raises(ZeroDivisionError):  # a transaction rolled back
                    async with conn.transaction():
                        await conn.execute("INSERT INTO records VALUES ($1, '1')", f"rb{n}-{i}")
                        raise ZeroDivisionError

        async def service_writer() -> None:
            for i in range(40):
                await db.put(f"s{i}", "1")
                if i % 4 == 0:
                    await db.delete(f"s{i}")

        async def follower() -> list[Change]:
            """Reads the log as it grows: every batch continues where the last one ended."""
            seen: list[Change] = []
            while True:
                last_round = done
                batch = await db.changes_after(seen[-1].id if seen else 0, 50)
                for change in batch:
                    assert change.id == (seen[-1].id + 1 if seen else 1)
                    seen.append(change)
                if last_round and not batch:
                    return seen
                await asyncio.sleep(0)

        follow = asyncio.create_task(follower())
        await asyncio.gather(*(writer(n, c) for n, c in enumerate(conns)), service_writer())
        done = True
        seen = await follow
        rows = {r[0] for r in await conns[0].fetch("SELECT key FROM records")}
        assert replay(seen) == rows and len(seen) == await db.newest_change()
        assert not any(str(c.item).startswith("rb") for c in seen)


class TestStatements:
    """What each kind of statement logs."""

    async def test_truncate_logs_a_delete_per_row(
        self, db: PostgresDatabase, conns: list[asyncpg.Connection]
    ) -> None:
        await db.seed(10)
        await conns[0].execute("TRUNCATE records")
        changes = await db.changes_after(10, 100)
        assert [c.id for c in changes] == list(range(11, 21))
        assert not any(c.insert for c in changes)
        assert replay(await db.changes_after(0, 100)) == set()
        await conns[0].execute("TRUNCATE records")  # empty: nothing logged
        assert await db.newest_change() == 20

    async def test_copy_and_bulk_insert(
        self, db: PostgresDatabase, conns: list[asyncpg.Connection]
    ) -> None:
        await conns[0].copy_records_to_table(
            "records", records=[(f"c{i}", "1") for i in range(5000)], columns=["key", "value"]
        )
        await conns[1].execute(
            "INSERT INTO records SELECT 'g' || g, '1' FROM generate_series(1, 5000) g"
        )
        await conns[2].execute("DELETE FROM records WHERE key LIKE 'c%'")
        changes = await db.changes_after(0, 20_000)
        assert replay(changes) == {f"g{i}" for i in range(1, 5001)}
        assert len(changes) == 15_000

    async def test_a_statement_logs_one_event_row_per_statement(
        self, url: str, conns: list[asyncpg.Connection]
    ) -> None:
        """One row of keys per statement, whether it changed one row (the short path of the
        trigger) or many; a NULL key is no key."""
        await conns[0].execute("CREATE TABLE users (id bigint UNIQUE, name text)")
        db = await open_database(url, table=TableSpec("users", "id"))
        try:
            await conns[0].execute("INSERT INTO users VALUES (1, 'a')")
            await conns[0].execute("INSERT INTO users VALUES (2, 'b'), (3, 'c'), (NULL, 'd')")
            await conns[0].execute("INSERT INTO users VALUES (NULL, 'e')")
            await conns[0].execute("DELETE FROM users WHERE id = 2")
            await conns[0].execute("DELETE FROM users WHERE id IN (1, 3) OR id IS NULL")
            events = await conns[0].fetch("SELECT op, keys FROM guard_events ORDER BY seq")
            assert [(bytes(r["op"]), sorted(r["keys"])) for r in events] == [
                (b"i", ["1"]),
                (b"i", ["2", "3"]),
                (b"d", ["2"]),
                (b"d", ["1", "3"]),
            ]
            assert replay(await db.changes_after(0, 100)) == set()
        finally:
            await db.close()

    async def test_updates(self, db: PostgresDatabase, conns: list[asyncpg.Connection]) -> None:
        await db.seed(4)
        await conns[0].execute("UPDATE records SET value = '2'")  # no key changes
        assert await db.newest_change() == 4
        await conns[0].execute(
            "UPDATE records SET key = key || '-x' WHERE key IN ('user-1', 'user-2')"
        )
        changes = await db.changes_after(4, 10)
        assert len(changes) == 4 and replay(await db.changes_after(0, 100)) == {
            "user-1-x",
            "user-2-x",
            "user-3",
            "user-4",
        }
        # An upsert that updates logs nothing; one that inserts logs the insert.
        await conns[0].execute(
            "INSERT INTO records VALUES ('user-3', '9'), ('new', '1') "
            "ON CONFLICT (key) DO UPDATE SET value = excluded.value"
        )
        assert [(c.insert, c.item) for c in await db.changes_after(8, 10)] == [(True, "new")]


class TestSnapshot:
    """The snapshot of a rebuild or an audit is a tick: its position, and writers go on."""

    async def test_snapshot_id_matches_keys_under_concurrent_writes(
        self, db: PostgresDatabase, conns: list[asyncpg.Connection]
    ) -> None:
        await db.seed(200)
        stop = asyncio.Event()

        async def churn(n: int, conn: asyncpg.Connection) -> None:
            i = 0
            while not stop.is_set():
                await conn.execute("INSERT INTO records VALUES ($1, '1')", f"c{n}-{i}")
                await conn.execute("DELETE FROM records WHERE key = $1", f"user-{n * 100 + i}")
                i += 1

        writers = [asyncio.create_task(churn(n, c)) for n, c in enumerate(conns[:2])]
        await asyncio.sleep(0.05)
        db.latency = 0.05  # a remote database: the churn commits between any two statements
        ids: list[int] = []

        async def at(change_id: int) -> None:
            ids.append(change_id)

        keys: list[str] = []
        async for batch in db.iter_keys(17, at):
            keys.extend(batch)
            await asyncio.sleep(0.01)  # the churn goes on while we page
        stop.set()
        await asyncio.gather(*writers)
        (snapshot_id,) = ids
        assert snapshot_id > 200  # the churn had written before the snapshot
        assert await db.newest_change() > snapshot_id  # and after it
        assert sorted(keys) == sorted(replay(await read_all(db, snapshot_id)))

    async def test_writers_go_on_while_the_snapshot_is_taken(
        self, db: PostgresDatabase, conns: list[asyncpg.Connection]
    ) -> None:
        await db.seed(30)
        done_inside: list[bool] = []

        async def at(change_id: int) -> None:
            # A writer of another connection, while the snapshot's tick is being taken and
            # the snapshot held: it commits at once (statement_timeout: no hang on failure).
            await conns[0].execute("SET statement_timeout = '10s'")
            await conns[0].execute("INSERT INTO records VALUES ('w', '1')")
            done_inside.append(True)

        keys = [k async for batch in db.iter_keys(10, at) for k in batch]
        assert done_inside == [True] and "w" not in keys and len(keys) == 30
        assert [c.item for c in await db.changes_after(30, 10)] == ["w"]

    async def test_present_at_has_the_position_of_its_snapshot(
        self, db: PostgresDatabase, conns: list[asyncpg.Connection]
    ) -> None:
        await db.seed(5)
        held = conns[1].transaction()
        await held.start()
        await conns[1].execute("INSERT INTO records VALUES ('held', '1')")
        await conns[0].execute("DELETE FROM records WHERE key = 'user-2'")
        position, present = await db.present_at(["user-1", "user-2", "held", "nope"])
        assert present == ["user-1"] and position == 6
        await held.commit()
        assert [c.item for c in await db.changes_after(6, 10)] == ["held"]


class TestWait:
    """wait_for_change polls by ticking; a poll that finds nothing new takes no lock."""

    async def test_woken_by_a_commit(
        self, db: PostgresDatabase, conns: list[asyncpg.Connection]
    ) -> None:
        waiter = asyncio.create_task(db.wait_for_change(0, 3600))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        await conns[0].execute("INSERT INTO records VALUES ('x', '1'), ('y', '1')")
        assert await asyncio.wait_for(waiter, 60) == 2  # the bound only stops a hang
        assert await db.newest_change() == 2

    async def test_idle_polls_lock_and_write_nothing(
        self, db: PostgresDatabase, conns: list[asyncpg.Connection]
    ) -> None:
        await conns[0].execute("INSERT INTO records VALUES ('x', '1')")
        assert await db.newest_change() == 1

        async def marks() -> tuple[Any, ...]:
            # xmax of the feed's row: set by every FOR UPDATE lock on it.
            return (
                await conns[0].fetchval("SELECT xmax::text FROM guard_feed"),
                await conns[0].fetchval("SELECT count(*) FROM guard_ticks"),
            )

        before = await marks()
        ticks = db.ticks_taken
        assert await db.wait_for_change(1, 0.3) is None
        assert db.ticks_taken > ticks + 5  # it did poll
        assert await marks() == before


class TestTables:
    """Key types, record columns, setup errors, installing twice."""

    async def test_two_services_install_one_log(self, url: str) -> None:
        a, b = await asyncio.gather(open_database(url), open_database(url))
        try:
            assert await a.feed_source() == await b.feed_source()
            await a.put("k", "1")
            assert await b.newest_change() == 1
        finally:
            await a.close()
            await b.close()

    async def test_a_later_start_needs_no_ddl(
        self, url: str, conns: list[asyncpg.Connection]
    ) -> None:
        """Once installed, a user with only reads and writes of the tables can start it, even
        when an older version's functions are installed (the owner's next start replaces
        them)."""
        await conns[0].execute("CREATE TABLE users (id bigint PRIMARY KEY, name text)")
        first = await open_database(url, table=TableSpec("users", "id"))
        await first.close()
        current = await conns[0].fetchval(
            "SELECT prosrc FROM pg_proc WHERE proname = 'guard_users_insert'"
        )
        older = current.replace("BEGIN ", "BEGIN -- an older version\n", 1)
        await conns[0].execute(
            "CREATE OR REPLACE FUNCTION guard_users_insert() RETURNS trigger LANGUAGE plpgsql "
            f"SECURITY DEFINER AS $guard${older}$guard$"
        )
        role = f"db16_writer_{uuid.uuid4().hex[:8]}"  # roles are shared by every database
        await conns[0].execute(
            f"CREATE ROLE {role} LOGIN; GRANT SELECT, INSERT, UPDATE, DELETE "
            f"ON users, guard_events, guard_ticks, guard_feed TO {role}"
        )
        try:
            writer_url = url.replace("postgresql://postgres@", f"postgresql://{role}@")
            db = await open_database(writer_url, table=TableSpec("users", "id"))
            try:
                assert (await db.put("1", '{"name": "Ann"}')).created is True
                assert [c.item for c in await db.changes_after(0, 10)] == ["1"]
            finally:
                await db.close()
            body = "SELECT prosrc FROM pg_proc WHERE proname = 'guard_users_insert'"
            assert await conns[0].fetchval(body) == older  # not its to replace
            owner = await open_database(url, table=TableSpec("users", "id"))
            await owner.close()
            assert await conns[0].fetchval(body) == current
        finally:
            await conns[0].execute(
                f"REVOKE ALL ON users, guard_events, guard_ticks, guard_feed FROM {role}; "
                f"DROP ROLE {role}"
            )

    async def test_a_table_of_another_schema(
        self, url: str, conns: list[asyncpg.Connection]
    ) -> None:
        """The service finds it by search_path; writers with another search_path are logged."""
        await conns[0].execute("CREATE SCHEMA sales")
        await conns[0].execute("CREATE TABLE sales.orders (id bigint PRIMARY KEY, total int)")
        db = await open_database(f"{url}?search_path=sales", table=TableSpec("orders", "id"))
        try:
            await conns[1].execute("INSERT INTO sales.orders VALUES (1, 10)")  # from public
            await conns[1].execute("TRUNCATE sales.orders")
            assert [(c.insert, c.item) for c in await db.changes_after(0, 10)] == [
                (True, "1"),
                (False, "1"),
            ]
            assert await conns[1].fetchval("SELECT count(*) FROM sales.guard_events") == 2
        finally:
            await db.close()

    async def test_uuid_keys(self, url: str, conns: list[asyncpg.Connection]) -> None:
        await conns[0].execute("CREATE TABLE things (id uuid PRIMARY KEY, label text)")
        key = "0b4e7a0e-5bd8-4b8c-9f1e-8a0a3c1d2e3f"
        await conns[0].execute("INSERT INTO things VALUES ($1, 'one')", key)
        db = await open_database(url, table=TableSpec("things", "id"))
        try:
            assert json.loads(await db.get(key) or "") == {"id": key, "label": "one"}
            assert await db.get(key.upper()) is None and await db.get("nope") is None
            with pytest.raises(RecordInputError) as bad:
                await db.put("nope", '{"label": "x"}')
            assert bad.value.loc == ("path", "key")
            assert await db.delete("nope") is False and await db.delete(key.upper()) is False
            assert await db.delete(key) is True
            assert [c.item for c in await db.changes_after(0, 10)] == [key]
        finally:
            await db.close()

    async def test_bad_values_name_the_column(
        self, url: str, conns: list[asyncpg.Connection]
    ) -> None:
        await conns[0].execute(
            "CREATE TABLE users (id bigint PRIMARY KEY, email text NOT NULL, age int)"
        )
        db = await open_database(url, table=TableSpec("users", "id"))
        try:
            with pytest.raises(RecordInputError) as bad:
                await db.put("1", '{"age": 3}')
            assert bad.value.loc == ("body", "value", "email")
            with pytest.raises(RecordInputError) as bad:
                await db.put("1", '{"email": "a", "age": "old"}')
            assert bad.value.loc[:2] == ("body", "value")
            with pytest.raises(RecordInputError):
                await db.put(str(2**63), '{"email": "a"}')
            assert (await db.put("1", '{"email": "a", "age": 3}')).created is True
            assert await db.count() == 1 and await db.newest_change() == 1
        finally:
            await db.close()

    async def test_setup_errors(self, url: str, conns: list[asyncpg.Connection]) -> None:
        await conns[0].execute("CREATE TABLE loose (id int, name text)")
        with pytest.raises(DatabaseSetupError, match="unique"):
            await open_database(url, table=TableSpec("loose", "id"))
        with pytest.raises(DatabaseSetupError, match="no table"):
            await open_database(url, table=TableSpec("missing", "id"))
        with pytest.raises(DatabaseSetupError, match="no column nick"):
            await open_database(url, table=TableSpec("loose", "id", ("nick",)))

    async def test_an_unknown_database_is_one_line_without_the_password(self, url: str) -> None:
        missing = url.replace("postgresql://postgres@", "postgresql://postgres:s3cret@") + "_gone"
        with pytest.raises(DatabaseSetupError, match="does not exist") as bad:
            await open_database(missing)
        assert "s3cret" not in str(bad.value) and "postgres:***@" in str(bad.value)

    async def test_sample_keys_of_a_big_table(
        self, db: PostgresDatabase, conns: list[asyncpg.Connection]
    ) -> None:
        await db.seed(20_000)
        await conns[0].execute("ANALYZE records")
        sample = await db.sample_keys(10)
        assert len(set(sample)) == len(sample) and 1 <= len(sample) <= 10
        assert set(sample) <= {f"user-{i}" for i in range(1, 20_001)}
