"""What every database of record shares: the records' reads and writes around each database's
own statements, keys, the record object of a table of columns, the table's check, counting.

A database is a subclass of `BaseDatabase` that writes its own SQL in the abstract methods
below and keeps its own change feed; it is chosen by the URL schemes it is registered under
(app/db/registry.py). docs/postgresql.md, "Adding a database", has the steps.
"""

from __future__ import annotations

import asyncio
import json
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, ClassVar, NamedTuple, Self, TypeVar

from app.db.base import (
    DatabaseSetupError,
    RecordInputError,
    SnapshotHook,
    Stored,
    TableSpec,
    integer_key,
    quote,
)
from guard.changes import Change

T = TypeVar("T")
Key = str | int  # a key as the key column holds it


class RowWrite(NamedTuple):
    """One put's statements, in the transaction that holds them (each database's own SQL).
    Each counts itself (`_query`) before it sends anything."""

    # Set the record on the row (with nothing to set: look for it); whether the row is there.
    update: Callable[[], Awaitable[bool]]
    # Insert the row; False when another writer's row of the key got there first.
    insert: Callable[[], Awaitable[bool]]
    # The row as stored, as get() answers it.
    stored: Callable[[], Awaitable[str]]


class Holds(NamedTuple):
    """present_at's snapshot: the newest change it contains, and whether it has a key's row."""

    position: int
    holds: Callable[[Key], Awaitable[bool]]


class BaseDatabase(ABC):
    """A guarded table with a change feed (`Database`, app/db/base.py), less its own SQL.

    `queries` counts the records' statements (each `await self._query()` just before it is
    sent, which also applies the artificial latency of GUARD_DB_LATENCY_MS); the change feed's
    and the audit's go in `feed_queries`.
    """

    POLL_S: ClassVar[float]  # wait_for_change asks newest_change() this often

    def __init__(self, url: str, latency_ms: float = 0.0, table: TableSpec | None = None) -> None:
        self.url = url
        self.latency = latency_ms / 1000
        self.spec = table or TableSpec()
        self.queries = 0
        self.feed_queries = 0
        self.integer_keys = False  # set by connect: the key column holds integers
        self.columns: tuple[str, ...] = ()  # set by connect for a table of columns
        self._t, self._k = quote(self.spec.table), quote(self.spec.key_column)

    @classmethod
    async def open(cls, url: str, latency_ms: float = 0.0, table: TableSpec | None = None) -> Self:
        """Connected, its change feed installed; closed again if that fails."""
        db = cls(url, latency_ms, table)
        try:
            await db.connect()
        except BaseException:
            await db.close()
            raise
        return db

    # ---- each database's own -----------------------------------------------------------

    @abstractmethod
    async def connect(self) -> None:
        """Open the connections, create the service's own table when missing, check the
        table (`_check_table`) and install the change feed when missing."""

    @abstractmethod
    async def close(self) -> None:
        """Close what connect opened (also after a connect that failed half way)."""

    @property
    @abstractmethod
    def _key_rule(self) -> str:
        """What a key must be, for the 422 of a key no row can have: "must be <this>"."""

    @abstractmethod
    async def _read(self, key: Key) -> str | None:
        """The row's record as get() answers it (counted), None if there is none."""

    @abstractmethod
    def _row_write(
        self, key: Key, value: str, record: dict[str, Any] | None
    ) -> AbstractAsyncContextManager[RowWrite]:
        """A transaction for one put of `value` (`record`: its columns, None for the own
        table), committed unless the block raises; a value the table refuses is a
        RecordInputError."""

    @abstractmethod
    async def _delete(self, key: Key) -> bool:
        """Delete the row, in a transaction of its own (counted); whether there was one."""

    @abstractmethod
    async def count(self) -> int:
        """The table's rows (counted)."""

    @abstractmethod
    async def _seed_rows(self, n: int) -> None:
        """Insert the demo rows `user-1` … `user-n` into the own table (counted), skipping
        keys that are there."""

    @abstractmethod
    def _snapshot(self) -> AbstractAsyncContextManager[Holds]:
        """One snapshot of the table, with the newest change it contains: present_at's."""

    @abstractmethod
    async def _sample_keys(self, n: int) -> list[str]:
        """Up to `n` (> 0) random existing keys, each once, at a cost that does not grow
        with the table."""

    @abstractmethod
    def iter_keys(
        self, batch_size: int, at_snapshot: SnapshotHook | None = None
    ) -> AsyncIterator[list[str]]: ...

    @abstractmethod
    async def feed_source(self) -> int: ...

    @abstractmethod
    async def newest_change(self) -> int: ...

    @abstractmethod
    async def oldest_change(self) -> int: ...

    @abstractmethod
    async def changes_after(self, after: int, limit: int) -> list[Change]: ...

    @abstractmethod
    async def compact(self, upto: int) -> int: ...

    # ---- shared helpers ----------------------------------------------------------------

    async def _query(self) -> None:
        """Count one statement and apply the artificial latency of a remote database."""
        self.queries += 1
        if self.latency:
            await asyncio.sleep(self.latency)

    @staticmethod
    def _connected(handle: T | None) -> T:
        if handle is None:
            raise RuntimeError("database is not connected")
        return handle

    def _check_table(self, types: dict[str, str]) -> None:
        """Check the guarded table's columns (name → type; none: no such table) against the
        settings, and take the record's columns from them."""
        spec = self.spec
        if not types:
            raise DatabaseSetupError(f"GUARD_RECORDS_TABLE: no table {spec.table!r}")
        if spec.key_column not in types:
            raise DatabaseSetupError(
                f"GUARD_RECORDS_KEY_COLUMN: table {spec.table!r} has no column {spec.key_column!r}"
            )
        missing = [c for c in spec.columns if c not in types]
        if missing:
            raise DatabaseSetupError(
                f"GUARD_RECORDS_COLUMNS: table {spec.table!r} has no column {', '.join(missing)}"
            )
        if spec.own and "value" not in types:
            raise DatabaseSetupError(f"table {spec.table!r} has no column value")
        if not spec.own:
            self.columns = spec.columns or tuple(types)

    def _key(self, key: str) -> Key | None:
        """The key as the key column holds it; None when no row can have it."""
        return integer_key(key) if self.integer_keys else key

    def _new_key(self, key: str) -> Key:
        """The key of a row to write; a 422 naming the key when no row can have it."""
        k = self._key(key)
        if k is None:
            raise self._key_refused()
        return k

    def _key_refused(self) -> RecordInputError:
        return RecordInputError(("path", "key"), f"must be {self._key_rule}")

    def _record(self, value: str) -> dict[str, Any]:
        """A write's JSON text for a table of columns: an object of the writable columns."""
        writable = tuple(c for c in self.columns if c != self.spec.key_column)
        obj = json.loads(value)
        if not isinstance(obj, dict):
            raise RecordInputError(
                ("body", "value"), f"must be a JSON object of the columns {', '.join(writable)}"
            )
        for name in obj:
            if name == self.spec.key_column:
                raise RecordInputError(
                    ("body", "value", name), "is the key column: the key is in the path"
                )
            if name not in writable:
                raise RecordInputError(
                    ("body", "value", name),
                    f"is not a column the service writes; it writes {', '.join(writable)} "
                    "(GUARD_RECORDS_COLUMNS)",
                )
        return obj

    # ---- records -----------------------------------------------------------------------

    async def get(self, key: str) -> str | None:
        k = self._key(key)
        return None if k is None else await self._read(k)

    async def put(self, key: str, value: str) -> Stored:
        k = self._new_key(key)
        record = None if self.spec.own else self._record(value)
        async with self._row_write(k, value, record) as row:
            # A row another transaction inserts between the two statements makes the INSERT
            # do nothing: then it is a replace, so try the UPDATE again.
            for _ in range(10):
                if await row.update():
                    created = False
                    break
                if await row.insert():
                    created = True
                    break
            else:
                raise RuntimeError(f"row {key!r} kept appearing and disappearing")
            stored = await row.stored()
        return Stored(created, stored)

    async def delete(self, key: str) -> bool:
        k = self._key(key)
        return k is not None and await self._delete(k)

    async def seed(self, n: int) -> int:
        """Fill the service's own empty table with `n` demo rows `user-1` … `user-n`; return
        rows added. A table the service did not create is never seeded."""
        if n <= 0 or not self.spec.own or await self.count():
            return 0
        await self._seed_rows(n)
        return n

    # ---- snapshots and the change feed -------------------------------------------------

    async def present_at(self, keys: list[str]) -> tuple[int, list[str]]:
        """Which of `keys` the table holds, read in one snapshot, and the position of the
        newest change that snapshot contains."""
        present = []
        async with self._snapshot() as snap:
            for key in keys:
                k = self._key(key)
                if k is not None and await snap.holds(k):
                    present.append(key)
        return snap.position, present

    async def wait_for_change(self, after: int, timeout: float) -> int | None:
        """newest_change() once it is past `after`, asked every POLL_S from POLL_S after the
        call on; None after `timeout` seconds. Asked at once, a follower under a steady flow of
        writes would run round after round with a few changes each, and every round costs
        round trips and a tick whatever it carries (measured: twice the follower's CPU)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            await asyncio.sleep(min(self.POLL_S, max(0.0, deadline - loop.time())))
            newest = await self.newest_change()
            if newest > after:
                return newest
            if loop.time() >= deadline:
                return None

    async def sample_keys(self, n: int) -> list[str]:
        """Up to `n` random existing keys (the guard's audit looks them up)."""
        return await self._sample_keys(n) if n > 0 else []
