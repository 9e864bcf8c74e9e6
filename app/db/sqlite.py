"""SQLite, the embedded database of record, with its trigger-maintained change log."""

from __future__ import annotations

import asyncio
import json
import random
import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiosqlite

from app.db.base import RecordInputError, SnapshotHook, TableSpec, new_feed_source, quote
from app.db.common import BaseDatabase, Holds, Key, RowWrite
from guard.changes import Change

PREFIX = "sqlite:///"  # what its URLs start with (registered in app/db/__init__.py)


def sqlite_path(url: str) -> str:
    """`sqlite:///rel/path`, `sqlite:////abs/path` or `sqlite:///:memory:` → a path for sqlite3."""
    if not url.startswith(PREFIX):
        raise ValueError(f"GUARD_DATABASE_URL must start with {PREFIX!r} (got {url!r})")
    return url[len(PREFIX) :] or ":memory:"


@asynccontextmanager
async def _immediate(conn: aiosqlite.Connection) -> AsyncIterator[aiosqlite.Connection]:
    """One transaction, committed unless the block raises.

    IMMEDIATE takes SQLite's write lock now: the transaction's reads see what its writes will
    follow (SQLite has one writer at a time anyway).
    """
    await conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
        await conn.commit()
    except BaseException:
        await conn.rollback()
        raise


def _install_sql(spec: TableSpec) -> list[str]:
    """The change log and the triggers that fill it (docs/postgresql.md lists them).

    SQLite has one writer at a time, so bumping the counter row and reading it back gives
    gapless ids that commit in id order; a rolled-back transaction takes its ids back with it.
    """
    t, k = quote(spec.table), quote(spec.key_column)
    feed, changes = quote(spec.feed), quote(spec.changes)

    def log(op: str, ref: str, offset: int = 0) -> str:
        return (
            f"INSERT INTO {changes} (id, op, key) "
            f"SELECT last_id - {offset}, '{op}', CAST({ref}.{k} AS TEXT) FROM {feed};"
        )

    return [
        f"CREATE TABLE IF NOT EXISTS {changes} (id INTEGER PRIMARY KEY, "
        "op TEXT NOT NULL CHECK (op IN ('i', 'd')), key TEXT NOT NULL)",
        f"CREATE TABLE IF NOT EXISTS {feed} (source INTEGER NOT NULL, last_id INTEGER NOT NULL)",
        f"CREATE TRIGGER IF NOT EXISTS {quote(spec.trigger('insert'))} AFTER INSERT ON {t} "
        f"BEGIN UPDATE {feed} SET last_id = last_id + 1; {log('i', 'NEW')} END",
        f"CREATE TRIGGER IF NOT EXISTS {quote(spec.trigger('delete'))} AFTER DELETE ON {t} "
        f"BEGIN UPDATE {feed} SET last_id = last_id + 1; {log('d', 'OLD')} END",
        # Only an UPDATE that changes the key is a change of the key set.
        f"CREATE TRIGGER IF NOT EXISTS {quote(spec.trigger('update'))} AFTER UPDATE OF {k} "
        f"ON {t} WHEN OLD.{k} IS NOT NEW.{k} "
        f"BEGIN UPDATE {feed} SET last_id = last_id + 2; {log('d', 'OLD', 1)} {log('i', 'NEW')} "
        "END",
    ]


def _sql_value(v: Any) -> Any:
    """A JSON value as SQLite stores it: nested objects and arrays as their JSON text."""
    return json.dumps(v, separators=(",", ":")) if isinstance(v, dict | list) else v


class SQLiteDatabase(BaseDatabase):
    """SQLite in WAL mode: a writer connection, a reader, one for snapshots, one for the change
    feed.

    Writes of one process are serialised by an asyncio lock (a connection holds one
    transaction at a time); writes of several processes by SQLite's own lock.
    """

    BUSY_TIMEOUT_MS = 10_000
    POLL_S = 0.015  # SQLite has no notifications, so a cheap poll

    def __init__(self, url: str, latency_ms: float = 0.0, table: TableSpec | None = None) -> None:
        super().__init__(url, latency_ms, table)
        self.path = sqlite_path(url)
        self._write_lock = asyncio.Lock()
        self._admin_lock = asyncio.Lock()
        self._writer: aiosqlite.Connection | None = None
        self._reader: aiosqlite.Connection | None = None
        self._admin: aiosqlite.Connection | None = None
        self._feed: aiosqlite.Connection | None = None
        self._feed_t, self._changes_t = quote(self.spec.feed), quote(self.spec.changes)
        self._select = f"SELECT value FROM {self._t} WHERE {self._k} = ?"

    @property
    def _memory(self) -> bool:
        return self.path == ":memory:"

    async def connect(self) -> None:
        if not self._memory:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._writer = await self._open()
        await self._writer.execute("PRAGMA journal_mode=WAL")
        async with _immediate(self._writer) as conn:
            if self.spec.own:
                await conn.execute(
                    "CREATE TABLE IF NOT EXISTS records (key TEXT PRIMARY KEY, value TEXT NOT NULL)"
                )
            await self._describe_table(conn)
            for statement in _install_sql(self.spec):
                await conn.execute(statement)
            await conn.execute(
                f"INSERT INTO {self._feed_t} (source, last_id) SELECT ?, 0 "
                f"WHERE NOT EXISTS (SELECT 1 FROM {self._feed_t})",
                (new_feed_source(),),
            )
        # An in-memory database exists per connection, so it gets only the one.
        self._reader = self._writer if self._memory else await self._open()
        self._admin = self._writer if self._memory else await self._open()
        self._feed = self._writer if self._memory else await self._open()

    async def _describe_table(self, conn: aiosqlite.Connection) -> None:
        info = list(await conn.execute_fetchall(f"PRAGMA table_info({self._t})"))
        types = {str(row[1]): str(row[2]).upper() for row in info}
        self._check_table(types)
        # SQLite's affinity rule: a declared type containing INT is an integer column.
        self.integer_keys = "INT" in types[self.spec.key_column]
        if not self.spec.own:
            pairs = ", ".join(f"'{c}', {quote(c)}" for c in self.columns)
            self._select = f"SELECT json_object({pairs}) FROM {self._t} WHERE {self._k} = ?"

    async def _open(self) -> aiosqlite.Connection:
        # isolation_level=None: we issue BEGIN ourselves, so transactions are explicit.
        conn = await aiosqlite.connect(self.path, isolation_level=None)
        await conn.execute(f"PRAGMA busy_timeout={self.BUSY_TIMEOUT_MS}")
        return conn

    async def close(self) -> None:
        conns = (self._writer, self._reader, self._admin, self._feed)
        for conn in {id(c): c for c in conns if c}.values():
            await conn.close()
        self._writer = self._reader = self._admin = self._feed = None

    _key_rule = "an integer (the key column holds integers)"

    # ---- records -----------------------------------------------------------------------

    async def _read(self, key: Key) -> str | None:
        await self._query()
        # One call on the connection's thread: a statement left open between execute and
        # close would let the next reader's statement join its read transaction, and under
        # load an unbroken chain of them kept reading a snapshot from before acknowledged
        # writes (WAL: a read sees the commits made before its transaction began).
        rows = list(await self._connected(self._reader).execute_fetchall(self._select, (key,)))
        return str(rows[0][0]) if rows else None

    @asynccontextmanager
    async def _transaction(self) -> AsyncIterator[aiosqlite.Connection]:
        conn = self._connected(self._writer)
        async with self._write_lock, _immediate(conn):
            yield conn

    @asynccontextmanager
    async def _row_write(
        self, key: Key, value: str, record: dict[str, Any] | None
    ) -> AsyncIterator[RowWrite]:
        # One writer at a time: the INSERT after a failed UPDATE always inserts.
        if record is None:
            sets, params = "value = ?", [value]
            cols, values = ["value"], [value]
        else:
            sets = ", ".join(f"{quote(c)} = ?" for c in record)
            params = [_sql_value(v) for v in record.values()]
            cols, values = list(record), params
        names = ", ".join(quote(c) for c in (self.spec.key_column, *cols))
        marks = ", ".join("?" * (1 + len(cols)))
        async with self._transaction() as conn:

            async def update() -> bool:
                await self._query()
                if sets:
                    cur = await conn.execute(f"UPDATE {self._t} SET {sets} WHERE {self._k} = ?",
                                             (*params, key))  # fmt: skip
                    return cur.rowcount > 0
                return bool(list(await conn.execute_fetchall(
                    f"SELECT 1 FROM {self._t} WHERE {self._k} = ?", (key,))))  # fmt: skip

            async def insert() -> bool:
                await self._query()
                try:
                    await conn.execute(
                        f"INSERT INTO {self._t} ({names}) VALUES ({marks})", (key, *values)
                    )
                except sqlite3.IntegrityError as exc:  # NOT NULL, CHECK, a foreign key
                    raise RecordInputError(("body", "value"), str(exc)) from exc
                return True

            async def stored() -> str:
                await self._query()
                rows = list(await conn.execute_fetchall(self._select, (key,)))
                return str(rows[0][0])

            yield RowWrite(update, insert, stored)

    async def _delete(self, key: Key) -> bool:
        async with self._transaction() as conn:
            await self._query()
            cur = await conn.execute(f"DELETE FROM {self._t} WHERE {self._k} = ?", (key,))
            return bool(cur.rowcount)

    async def count(self) -> int:
        await self._query()
        rows = list(
            await self._connected(self._reader).execute_fetchall(f"SELECT COUNT(*) FROM {self._t}")
        )
        return int(rows[0][0]) if rows else 0

    async def _seed_rows(self, n: int) -> None:
        async with self._transaction() as conn:
            await self._query()
            await conn.executemany(
                "INSERT OR IGNORE INTO records (key, value) VALUES (?, ?)",
                ((f"user-{i}", f'"value-{i}"') for i in range(1, n + 1)),
            )

    # ---- snapshots ---------------------------------------------------------------------

    @asynccontextmanager
    async def _admin_transaction(self) -> AsyncIterator[aiosqlite.Connection]:
        conn = self._connected(self._admin)
        # The writer's lock first: asyncio locks are FIFO, so this process's writers queue
        # behind us instead of starving us (SQLite's busy handler only polls). Other
        # processes are held off by SQLite's lock itself.
        async with self._write_lock, self._admin_lock, _immediate(conn):
            yield conn

    async def iter_keys(
        self, batch_size: int, at_snapshot: SnapshotHook | None = None
    ) -> AsyncIterator[list[str]]:
        conn = self._connected(self._admin)
        # Copy the keys under the write lock (fast, no Redis calls), then page through the
        # copy without it, so writers are held off only for the copy.
        async with self._admin_transaction():
            await conn.execute("DROP TABLE IF EXISTS temp.snapshot_keys")
            await conn.execute(
                "CREATE TEMP TABLE snapshot_keys AS "
                f"SELECT CAST({self._k} AS TEXT) AS key FROM {self._t}"
            )
            rows = list(await conn.execute_fetchall(f"SELECT last_id FROM {self._feed_t}"))
            if at_snapshot is not None:
                await at_snapshot(int(rows[0][0]))
        try:
            last = 0
            while True:
                await self._query()
                # rowid paging: the copy has no index on key, and ORDER BY key would sort
                # the whole copy for every page.
                async with conn.execute(
                    "SELECT rowid, key FROM temp.snapshot_keys WHERE rowid > ? "
                    "ORDER BY rowid LIMIT ?",
                    (last, batch_size),
                ) as cur:
                    page = list(await cur.fetchall())
                if not page:
                    return
                last = int(page[-1][0])
                yield [str(r[1]) for r in page]
        finally:
            await conn.execute("DROP TABLE IF EXISTS temp.snapshot_keys")

    @asynccontextmanager
    async def _snapshot(self) -> AsyncIterator[Holds]:
        # One read transaction: in WAL mode it reads one snapshot, log counter included.
        conn = self._connected(self._feed)
        await conn.execute("BEGIN")
        try:
            rows = await self._feed_rows(f"SELECT last_id FROM {self._feed_t}")

            async def holds(key: Key) -> bool:
                sql = f"SELECT 1 FROM {self._t} WHERE {self._k} = ?"
                return bool(await self._feed_rows(sql, (key,)))

            yield Holds(int(rows[0][0]), holds)
        finally:
            await conn.rollback()

    # ---- change feed -------------------------------------------------------------------

    async def _feed_rows(self, sql: str, params: tuple[Any, ...] = ()) -> list[Any]:
        self.feed_queries += 1
        return list(await self._connected(self._feed).execute_fetchall(sql, params))

    async def feed_source(self) -> int:
        rows = await self._feed_rows(f"SELECT source FROM {self._feed_t}")
        return int(rows[0][0])

    async def newest_change(self) -> int:
        rows = await self._feed_rows(f"SELECT last_id FROM {self._feed_t}")
        return int(rows[0][0])

    async def oldest_change(self) -> int:
        # One statement, one snapshot: a compaction between two reads cannot skew them.
        rows = await self._feed_rows(
            f"SELECT COALESCE((SELECT MIN(id) FROM {self._changes_t}), last_id + 1) "
            f"FROM {self._feed_t}"
        )
        return int(rows[0][0])

    async def changes_after(self, after: int, limit: int) -> list[Change]:
        rows = await self._feed_rows(
            f"SELECT id, op, key FROM {self._changes_t} WHERE id > ? ORDER BY id LIMIT ?",
            (after, limit),
        )
        return [Change(int(r[0]), r[1] == "i", str(r[2])) for r in rows]

    async def compact(self, upto: int) -> int:
        async with self._transaction() as conn:
            self.feed_queries += 1
            cur = await conn.execute(f"DELETE FROM {self._changes_t} WHERE id <= ?", (upto,))
            return max(0, cur.rowcount)

    async def _sample_keys(self, n: int) -> list[str]:
        """Random rowids, each the first row at or after it: n index lookups, whatever the
        table's size (ORDER BY random() would read the whole table)."""
        conn = self._connected(self._feed)
        self.feed_queries += 1
        try:
            bounds = list(
                await conn.execute_fetchall(f"SELECT MIN(rowid), MAX(rowid) FROM {self._t}")
            )
        except aiosqlite.OperationalError:  # a WITHOUT ROWID table
            rows = await self._feed_rows(
                f"SELECT CAST({self._k} AS TEXT) FROM {self._t} ORDER BY random() LIMIT ?", (n,)
            )
            return [str(r[0]) for r in rows]
        lo, hi = bounds[0]
        if lo is None:
            return []
        keys: dict[str, None] = {}
        for _ in range(n):
            rows = await self._feed_rows(
                f"SELECT CAST({self._k} AS TEXT) FROM {self._t} WHERE rowid >= ? "
                "ORDER BY rowid LIMIT 1",
                (random.randint(int(lo), int(hi)),),
            )
            if rows:
                keys[str(rows[0][0])] = None
        return list(keys)
