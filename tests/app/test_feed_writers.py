"""A guarded PostgreSQL table to its own writers: no lock of ours they wait for, no new way for
their transactions to fail. Each scenario is one that does not fail on an unguarded table;
with the change log that numbered changes under a lock, each failed (deadlocks, serialisation
failures, writers stalled behind an open transaction, writes refused for want of a grant).
Each test also checks the feed: what it holds replays to the table.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest

from app.db import Database, TableSpec, open_database

ROUNDS = 20
# A statement that waits longer than this failed the test: writers never wait for the guard,
# and a wait for a lock that is not coming must not hang the run.
STATEMENT_TIMEOUT = "10s"


@pytest.fixture
async def guarded(pg_url: str) -> AsyncIterator[Database]:
    """The service's own table, guarded; the test writes it as an application would."""
    db = await open_database(pg_url)
    conn = await asyncpg.connect(pg_url)
    await conn.execute("CREATE TABLE accounts (id int PRIMARY KEY, balance int NOT NULL)")
    await conn.execute("INSERT INTO accounts VALUES (1, 0)")
    await conn.close()
    yield db
    await db.close()


@pytest.fixture
async def app_conns(pg_url: str) -> AsyncIterator[list[asyncpg.Connection]]:
    conns = [
        await asyncpg.connect(pg_url, server_settings={"statement_timeout": STATEMENT_TIMEOUT})
        for _ in range(3)
    ]
    yield conns
    for c in conns:
        await c.close()


async def fed_keys(db: Database) -> set[str]:
    """The key set the whole feed replays to (positions checked consecutive)."""
    live: set[str] = set()
    after = 0
    while changes := await db.changes_after(after, 1000):
        for change in changes:
            after += 1
            assert change.id == after
            (live.add if change.insert else live.remove)(str(change.item))
    return live


async def table_keys(conn: asyncpg.Connection) -> set[str]:
    return {r[0] for r in await conn.fetch("SELECT key FROM records")}


class TestWritersAreNotSerialised:
    async def test_no_deadlock_with_another_tables_row(
        self, guarded: Database, app_conns: list[asyncpg.Connection]
    ) -> None:
        """T1 inserts a record, then updates an account; T2 updates that account, then
        inserts a record. T2 waits for T1 and both commit, as without the guard."""
        t1, t2, _ = app_conns
        failures = 0
        for n in range(ROUNDS):
            tx1, tx2 = t1.transaction(), t2.transaction()
            await tx1.start()
            await tx2.start()
            try:
                await t1.execute("INSERT INTO records VALUES ($1, '1')", f"t1-{n}")
                await t2.execute("UPDATE accounts SET balance = balance + 1 WHERE id = 1")
                waiting = asyncio.create_task(
                    t1.execute("UPDATE accounts SET balance = balance - 1 WHERE id = 1")
                )
                await asyncio.sleep(0.01)  # T1 now waits for T2's row
                await t2.execute("INSERT INTO records VALUES ($1, '1')", f"t2-{n}")
                await tx2.commit()
                await waiting
                await tx1.commit()
            except asyncpg.PostgresError:
                failures += 1
                for tx in (tx1, tx2):
                    with contextlib.suppress(asyncpg.InterfaceError):  # already ended
                        await tx.rollback()
        assert failures == 0
        assert await table_keys(t1) == await fed_keys(guarded)
        assert len(await table_keys(t1)) == 2 * ROUNDS

    async def test_repeatable_read_writers_of_different_keys_both_commit(
        self, guarded: Database, app_conns: list[asyncpg.Connection]
    ) -> None:
        t1, t2, _ = app_conns
        failures = 0
        for n in range(2 * ROUNDS):
            tx1 = t1.transaction(isolation="repeatable_read")
            tx2 = t2.transaction(isolation="repeatable_read")
            await tx1.start()
            await tx2.start()
            try:
                await t1.execute("SELECT 1")  # both snapshots taken before either writes
                await t2.execute("SELECT 1")
                await t1.execute("INSERT INTO records VALUES ($1, '1')", f"a-{n}")
                await tx1.commit()
                await t2.execute("INSERT INTO records VALUES ($1, '1')", f"b-{n}")
                await tx2.commit()
            except asyncpg.SerializationError:
                failures += 1
                await tx2.rollback()
        assert failures == 0
        assert await table_keys(t1) == await fed_keys(guarded)

    async def test_an_open_transaction_stalls_no_other_writer(
        self, guarded: Database, app_conns: list[asyncpg.Connection]
    ) -> None:
        """A batch job (or a forgotten BEGIN in psql) holds a logged change open: other
        connections' inserts, deletes and key changes commit meanwhile, and the feed has
        them at once; the held one joins the feed when it commits."""
        holder, other, _ = app_conns
        await other.execute("INSERT INTO records VALUES ('old', '1'), ('moving', '1')")
        held = holder.transaction()
        await held.start()
        await holder.execute("INSERT INTO records VALUES ('held', '1')")
        await other.execute("INSERT INTO records VALUES ('meanwhile', '1')")
        await other.execute("DELETE FROM records WHERE key = 'old'")
        await other.execute("UPDATE records SET key = 'moved' WHERE key = 'moving'")
        assert await fed_keys(guarded) == {"meanwhile", "moved"}
        await held.commit()
        assert await fed_keys(guarded) == {"meanwhile", "moved", "held"}

    async def test_writers_need_no_grant_on_the_feed(self, guarded: Database, pg_url: str) -> None:
        """An application role allowed its own table and nothing of the guard's writes as
        before: the trigger functions run with their owner's rights."""
        admin = await asyncpg.connect(pg_url)
        role = f"db16_app_{uuid.uuid4().hex[:8]}"  # roles are shared by every database
        await admin.execute(
            f"CREATE ROLE {role} LOGIN; GRANT SELECT, INSERT, UPDATE, DELETE ON records TO {role}"
        )
        try:
            app_url = pg_url.replace("postgresql://postgres@", f"postgresql://{role}@")
            app = await asyncpg.connect(app_url)
            try:
                await app.execute("INSERT INTO records VALUES ('mine', '1'), ('gone', '1')")
                await app.execute("DELETE FROM records WHERE key = 'gone'")
                await app.execute("UPDATE records SET key = 'renamed' WHERE key = 'mine'")
            finally:
                await app.close()
            assert await fed_keys(guarded) == {"renamed"}
        finally:
            await admin.execute(f"REVOKE ALL ON records FROM {role}; DROP ROLE {role}")
            await admin.close()

    async def test_rows_without_a_key_are_written_and_not_fed(self, pg_url: str) -> None:
        """A nullable unique key column: rows whose key is NULL name no record; writing them
        works as before and feeds nothing."""
        conn = await asyncpg.connect(pg_url)
        await conn.execute("CREATE TABLE people (id serial PRIMARY KEY, email text UNIQUE)")
        db = await open_database(pg_url, table=TableSpec("people", "email"))
        try:
            await conn.execute("INSERT INTO people (email) VALUES (NULL), ('a@x'), (NULL)")
            await conn.execute("UPDATE people SET email = NULL WHERE email = 'a@x'")
            await conn.execute("UPDATE people SET email = 'b@x' WHERE id = 1")
            await conn.execute("DELETE FROM people WHERE email IS NULL")
            assert await fed_keys(db) == {"b@x"}
        finally:
            await db.close()
            await conn.close()
