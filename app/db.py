"""The guarded resource's backing database: a small async protocol and its SQLite implementation."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Protocol

import aiosqlite

Hook = Callable[[], Awaitable[None]]


class Database(Protocol):
    """What the service needs from a key-value table; PostgreSQL can implement the same."""

    queries: int  # statements sent on behalf of callers: tests assert a blocked read adds none

    async def get(self, key: str) -> str | None: ...

    async def put(self, key: str, value: str, on_create: Hook | None = None) -> bool:
        """Insert or replace; True if the row is new.

        `on_create` runs inside the write transaction, after the row is known to be new and
        before it becomes visible; if it raises, nothing is written.
        """
        ...

    async def delete(self, key: str, on_delete: Hook | None = None) -> bool:
        """True only if a row was deleted and the deletion committed.

        `on_delete` runs inside the write transaction once the DELETE statement removed a
        row, before the commit; if it raises, nothing is deleted.
        """
        ...

    async def count(self) -> int: ...

    def iter_keys(
        self, batch_size: int, at_snapshot: Hook | None = None
    ) -> AsyncIterator[list[str]]:
        """Every key of one consistent snapshot, taken while no write transaction is open.

        `at_snapshot` runs at that moment, with writers still held off.
        """
        ...

    def write_barrier(self) -> AbstractAsyncContextManager[None]:
        """Hold off every write transaction (of any process) for the duration of the block."""
        ...

    async def close(self) -> None: ...


def sqlite_path(url: str) -> str:
    """`sqlite:///rel/path`, `sqlite:////abs/path` or `sqlite:///:memory:` → a path for sqlite3."""
    prefix = "sqlite:///"
    if not url.startswith(prefix):
        raise ValueError(f"GUARD_DATABASE_URL must start with {prefix!r} (got {url!r})")
    return url[len(prefix) :] or ":memory:"


@asynccontextmanager
async def _immediate(conn: aiosqlite.Connection) -> AsyncIterator[aiosqlite.Connection]:
    """One transaction, committed unless the block raises.

    IMMEDIATE takes SQLite's write lock now, so write_barrier() of another connection or
    process waits for the whole transaction, hooks included.
    """
    await conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
    except BaseException:
        await conn.rollback()
        raise
    await conn.commit()


class SQLiteDatabase:
    """SQLite in WAL mode: one writer connection, one reader, one for snapshots and barriers.

    Writes of one process are serialised by an asyncio lock (a connection holds one
    transaction at a time); writes of several processes by SQLite's own lock.
    """

    BUSY_TIMEOUT_MS = 10_000

    def __init__(self, path: str, latency_ms: float = 0.0) -> None:
        self.path = path
        self.latency = latency_ms / 1000
        self.queries = 0
        self._write_lock = asyncio.Lock()
        self._admin_lock = asyncio.Lock()
        self._writer: aiosqlite.Connection | None = None
        self._reader: aiosqlite.Connection | None = None
        self._admin: aiosqlite.Connection | None = None

    @property
    def _memory(self) -> bool:
        return self.path == ":memory:"

    async def connect(self) -> None:
        if not self._memory:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._writer = await self._open()
        await self._writer.execute("PRAGMA journal_mode=WAL")
        await self._writer.execute(
            "CREATE TABLE IF NOT EXISTS records (key TEXT PRIMARY KEY, value TEXT NOT NULL)"
        )
        await self._writer.commit()
        # An in-memory database exists per connection, so it gets only the one.
        self._reader = self._writer if self._memory else await self._open()
        self._admin = self._writer if self._memory else await self._open()

    async def _open(self) -> aiosqlite.Connection:
        # isolation_level=None: we issue BEGIN ourselves, so transactions are explicit.
        conn = await aiosqlite.connect(self.path, isolation_level=None)
        await conn.execute(f"PRAGMA busy_timeout={self.BUSY_TIMEOUT_MS}")
        return conn

    async def close(self) -> None:
        for conn in {id(c): c for c in (self._writer, self._reader, self._admin) if c}.values():
            await conn.close()
        self._writer = self._reader = self._admin = None

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

    async def get(self, key: str) -> str | None:
        await self._query()
        # One call on the connection's thread: a statement left open between execute and
        # close would let the next reader's statement join its read transaction, and under
        # load an unbroken chain of them kept reading a snapshot from before acknowledged
        # writes (WAL: a read sees the commits made before its transaction began).
        rows = list(
            await self._conn(self._reader).execute_fetchall(
                "SELECT value FROM records WHERE key = ?", (key,)
            )
        )
        return str(rows[0][0]) if rows else None

    @asynccontextmanager
    async def _transaction(self) -> AsyncIterator[aiosqlite.Connection]:
        conn = self._conn(self._writer)
        async with self._write_lock, _immediate(conn):
            yield conn

    async def put(self, key: str, value: str, on_create: Hook | None = None) -> bool:
        async with self._transaction() as conn:
            await self._query()
            cur = await conn.execute("UPDATE records SET value = ? WHERE key = ?", (value, key))
            if cur.rowcount:
                return False
            if on_create is not None:
                await on_create()
            await self._query()
            await conn.execute("INSERT INTO records (key, value) VALUES (?, ?)", (key, value))
            return True

    async def delete(self, key: str, on_delete: Hook | None = None) -> bool:
        async with self._transaction() as conn:
            await self._query()
            cur = await conn.execute("DELETE FROM records WHERE key = ?", (key,))
            if not cur.rowcount:
                return False
            if on_delete is not None:
                await on_delete()
            return True

    async def count(self) -> int:
        await self._query()
        rows = list(await self._conn(self._reader).execute_fetchall("SELECT COUNT(*) FROM records"))
        return int(rows[0][0]) if rows else 0

    async def seed(self, n: int) -> int:
        """Fill an empty table with `n` demo rows `user-1` … `user-n`; return rows added."""
        if n <= 0 or await self.count():
            return 0
        async with self._transaction() as conn:
            await self._query()
            await conn.executemany(
                "INSERT OR IGNORE INTO records (key, value) VALUES (?, ?)",
                ((f"user-{i}", f'"value-{i}"') for i in range(1, n + 1)),
            )
        return n

    @asynccontextmanager
    async def _admin_transaction(self) -> AsyncIterator[aiosqlite.Connection]:
        conn = self._conn(self._admin)
        # The writer's lock first: asyncio locks are FIFO, so this process's writers queue
        # behind us instead of starving us (SQLite's busy handler only polls). Other
        # processes are held off by SQLite's lock itself.
        async with self._write_lock, self._admin_lock, _immediate(conn):
            yield conn

    @asynccontextmanager
    async def write_barrier(self) -> AsyncIterator[None]:
        async with self._admin_transaction():
            yield

    async def iter_keys(
        self, batch_size: int, at_snapshot: Hook | None = None
    ) -> AsyncIterator[list[str]]:
        conn = self._conn(self._admin)
        # Copy the keys under the write lock (fast, no Redis calls), then page through the
        # copy without it, so writers are held off only for the copy.
        async with self._admin_transaction():
            await conn.execute("DROP TABLE IF EXISTS temp.snapshot_keys")
            await conn.execute("CREATE TEMP TABLE snapshot_keys AS SELECT key FROM records")
            if at_snapshot is not None:
                await at_snapshot()
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
                    rows = list(await cur.fetchall())
                if not rows:
                    return
                last = int(rows[-1][0])
                yield [str(r[1]) for r in rows]
        finally:
            await conn.execute("DROP TABLE IF EXISTS temp.snapshot_keys")


async def open_database(url: str, latency_ms: float = 0.0) -> SQLiteDatabase:
    """Connect to the database named by GUARD_DATABASE_URL (SQLite for now)."""
    db = SQLiteDatabase(sqlite_path(url), latency_ms)
    await db.connect()
    return db
