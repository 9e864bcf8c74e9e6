"""SQLite, the embedded database of record, with its trigger-maintained change log."""

from __future__ import annotations

import asyncio
import json
import random
import secrets
import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiosqlite

from app.db.base import (
    MAX_SOURCE,
    SQLITE_PREFIX,
    DatabaseSetupError,
    RecordInputError,
    SnapshotHook,
    Stored,
    TableSpec,
    integer_key,
    quote,
    record_object,
)
from guard.changes import Change

POLL_S = 0.015  # wait_for_change: SQLite has no notifications, so a cheap poll


def sqlite_path(url: str) -> str:
    """`sqlite:///rel/path`, `sqlite:////abs/path` or `sqlite:///:memory:` → a path for sqlite3."""
    if not url.startswith(SQLITE_PREFIX):
        raise ValueError(f"GUARD_DATABASE_URL must start with {SQLITE_PREFIX!r} (got {url!r})")
    return url[len(SQLITE_PREFIX) :] or ":memory:"


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


class SQLiteDatabase:
    """SQLite in WAL mode: a writer connection, a reader, one for snapshots, one for the change
    feed.

    Writes of one process are serialised by an asyncio lock (a connection holds one
    transaction at a time); writes of several processes by SQLite's own lock.
    """

    BUSY_TIMEOUT_MS = 10_000

    def __init__(self, path: str, latency_ms: float = 0.0, table: TableSpec | None = None) -> None:
        self.path = path
        self.latency = latency_ms / 1000
        self.spec = table or TableSpec()
        self.queries = 0
        self.feed_queries = 0
        self.integer_keys = False
        self.columns: tuple[str, ...] = ()
        self._write_lock = asyncio.Lock()
        self._admin_lock = asyncio.Lock()
        self._writer: aiosqlite.Connection | None = None
        self._reader: aiosqlite.Connection | None = None
        self._admin: aiosqlite.Connection | None = None
        self._feed: aiosqlite.Connection | None = None
        t, k = quote(self.spec.table), quote(self.spec.key_column)
        self._t, self._k = t, k
        self._feed_t, self._changes_t = quote(self.spec.feed), quote(self.spec.changes)
        self._select = f"SELECT value FROM {t} WHERE {k} = ?"

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
                (secrets.randbelow(MAX_SOURCE) + 1,),
            )
        # An in-memory database exists per connection, so it gets only the one.
        self._reader = self._writer if self._memory else await self._open()
        self._admin = self._writer if self._memory else await self._open()
        self._feed = self._writer if self._memory else await self._open()

    async def _describe_table(self, conn: aiosqlite.Connection) -> None:
        spec = self.spec
        info = list(await conn.execute_fetchall(f"PRAGMA table_info({self._t})"))
        types = {str(row[1]): str(row[2]).upper() for row in info}
        if not types:
            raise DatabaseSetupError(f"GUARD_RECORDS_TABLE: no table {spec.table!r}")
        missing = [c for c in (spec.key_column, *spec.columns) if c not in types]
        if spec.own and "value" not in types:
            missing.append("value")
        if missing:
            raise DatabaseSetupError(f"table {spec.table!r} has no column {', '.join(missing)}")
        # SQLite's affinity rule: a declared type containing INT is an integer column.
        self.integer_keys = "INT" in types[spec.key_column]
        if not spec.own:
            self.columns = spec.columns or tuple(types)
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

    async def _query(self) -> None:
        """Count one statement and apply the artificial latency of a remote database."""
        self.queries += 1
        if self.latency:
            await asyncio.sleep(self.latency)

    @staticmethod
    def _conn(conn: aiosqlite.Connection | None) -> aiosqlite.Connection:
        if conn is None:
            raise RuntimeError("database is not connected")
        return conn

    def _key(self, key: str) -> str | int | None:
        """The key as the key column holds it; None when no row can have it."""
        return integer_key(key) if self.integer_keys else key

    def _new_key(self, key: str) -> str | int:
        k = self._key(key)
        if k is None:
            raise RecordInputError(
                ("path", "key"), "must be an integer (the key column holds integers)"
            )
        return k

    # ---- records -----------------------------------------------------------------------

    async def get(self, key: str) -> str | None:
        k = self._key(key)
        if k is None:
            return None
        await self._query()
        # One call on the connection's thread: a statement left open between execute and
        # close would let the next reader's statement join its read transaction, and under
        # load an unbroken chain of them kept reading a snapshot from before acknowledged
        # writes (WAL: a read sees the commits made before its transaction began).
        rows = list(await self._conn(self._reader).execute_fetchall(self._select, (k,)))
        return str(rows[0][0]) if rows else None

    @asynccontextmanager
    async def _transaction(self) -> AsyncIterator[aiosqlite.Connection]:
        conn = self._conn(self._writer)
        async with self._write_lock, _immediate(conn):
            yield conn

    async def put(self, key: str, value: str) -> Stored:
        k = self._new_key(key)
        if self.spec.own:
            sets, params = "value = ?", [value]
            cols, values = ["value"], [value]
        else:
            writable = tuple(c for c in self.columns if c != self.spec.key_column)
            obj = record_object(value, writable, self.spec.key_column)
            sets = ", ".join(f"{quote(c)} = ?" for c in obj)
            params = [_sql_value(v) for v in obj.values()]
            cols, values = list(obj), params
        async with self._transaction() as conn:
            await self._query()
            if sets:
                cur = await conn.execute(f"UPDATE {self._t} SET {sets} WHERE {self._k} = ?",
                                         (*params, k))  # fmt: skip
                exists = cur.rowcount > 0
            else:
                exists = bool(list(await conn.execute_fetchall(
                    f"SELECT 1 FROM {self._t} WHERE {self._k} = ?", (k,))))  # fmt: skip
            if not exists:
                await self._query()
                names = ", ".join(quote(c) for c in (self.spec.key_column, *cols))
                marks = ", ".join("?" * (1 + len(cols)))
                try:
                    await conn.execute(
                        f"INSERT INTO {self._t} ({names}) VALUES ({marks})", (k, *values)
                    )
                except sqlite3.IntegrityError as exc:  # NOT NULL, CHECK, a foreign key
                    raise RecordInputError(("body", "value"), str(exc)) from exc
            await self._query()
            stored = list(await conn.execute_fetchall(self._select, (k,)))
        return Stored(not exists, str(stored[0][0]))

    async def delete(self, key: str) -> bool:
        k = self._key(key)
        if k is None:
            return False
        async with self._transaction() as conn:
            await self._query()
            cur = await conn.execute(f"DELETE FROM {self._t} WHERE {self._k} = ?", (k,))
            return bool(cur.rowcount)

    async def count(self) -> int:
        await self._query()
        rows = list(
            await self._conn(self._reader).execute_fetchall(f"SELECT COUNT(*) FROM {self._t}")
        )
        return int(rows[0][0]) if rows else 0

    async def seed(self, n: int) -> int:
        """Fill the service's own empty table with `n` demo rows `user-1` … `user-n`; return
        rows added. A table the service did not create is never seeded."""
        if n <= 0 or not self.spec.own or await self.count():
            return 0
        async with self._transaction() as conn:
            await self._query()
            await conn.executemany(
                "INSERT OR IGNORE INTO records (key, value) VALUES (?, ?)",
                ((f"user-{i}", f'"value-{i}"') for i in range(1, n + 1)),
            )
        return n

    # ---- snapshots ---------------------------------------------------------------------

    @asynccontextmanager
    async def _admin_transaction(self) -> AsyncIterator[aiosqlite.Connection]:
        conn = self._conn(self._admin)
        # The writer's lock first: asyncio locks are FIFO, so this process's writers queue
        # behind us instead of starving us (SQLite's busy handler only polls). Other
        # processes are held off by SQLite's lock itself.
        async with self._write_lock, self._admin_lock, _immediate(conn):
            yield conn

    async def iter_keys(
        self, batch_size: int, at_snapshot: SnapshotHook | None = None
    ) -> AsyncIterator[list[str]]:
        conn = self._conn(self._admin)
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

    async def present_at(self, keys: list[str]) -> tuple[int, list[str]]:
        # One read transaction: in WAL mode it reads one snapshot, log counter included.
        conn = self._conn(self._feed)
        await conn.execute("BEGIN")
        try:
            rows = await self._feed_rows(f"SELECT last_id FROM {self._feed_t}")
            present = []
            for key in keys:
                k = self._key(key)
                if k is not None and await self._feed_rows(
                    f"SELECT 1 FROM {self._t} WHERE {self._k} = ?", (k,)
                ):
                    present.append(key)
        finally:
            await conn.rollback()
        return int(rows[0][0]), present

    # ---- change feed -------------------------------------------------------------------

    async def _feed_rows(self, sql: str, params: tuple[Any, ...] = ()) -> list[Any]:
        self.feed_queries += 1
        return list(await self._conn(self._feed).execute_fetchall(sql, params))

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

    async def wait_for_change(self, after: int, timeout: float) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            if await self.newest_change() > after:
                return True
            left = deadline - loop.time()
            if left <= 0:
                return False
            await asyncio.sleep(min(POLL_S, left))

    async def compact(self, upto: int) -> int:
        async with self._transaction() as conn:
            self.feed_queries += 1
            cur = await conn.execute(f"DELETE FROM {self._changes_t} WHERE id <= ?", (upto,))
            return max(0, cur.rowcount)

    async def sample_keys(self, n: int) -> list[str]:
        """Random rowids, each the first row at or after it: n index lookups, whatever the
        table's size (ORDER BY random() would read the whole table)."""
        if n <= 0:
            return []
        conn = self._conn(self._feed)
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
