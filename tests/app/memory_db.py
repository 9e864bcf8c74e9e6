"""A toy database of record kept in this process, added as docs/postgresql.md ("Adding a
database") says: this module, and one `register` line (tests/app/test_db_registry.py).

URLs `memory-db://<name>`: the service's own `records(key, value)` table and its change
feed, in Python objects shared by every connection to the same name.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from app.db.base import SnapshotHook, TableSpec, new_feed_source
from app.db.common import BaseDatabase, Holds, Key, RowWrite
from guard.changes import Change


@dataclass
class _Store:
    """One named database: the table, its change log, one writer at a time."""

    source: int = field(default_factory=new_feed_source)
    rows: dict[str, str] = field(default_factory=dict)
    log: list[Change] = field(default_factory=list)
    newest: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def logged(self, insert: bool, key: str) -> None:
        self.newest += 1
        self.log.append(Change(self.newest, insert, key))


_STORES: dict[str, _Store] = {}


class MemoryDatabase(BaseDatabase):
    POLL_S = 0.001

    def __init__(self, url: str, latency_ms: float = 0.0, table: TableSpec | None = None) -> None:
        super().__init__(url, latency_ms, table)
        self.name = url.removeprefix("memory-db://")
        self._store: _Store | None = None

    async def connect(self) -> None:
        # Only the service's own table exists here: any other is "no table".
        self._check_table({"key": "text", "value": "text"} if self.spec.own else {})
        self._store = _STORES.setdefault(self.name, _Store())

    async def close(self) -> None:
        self._store = None

    @property
    def _db(self) -> _Store:
        return self._connected(self._store)

    _key_rule = "text"  # the own table's keys are: no key is refused

    async def _read(self, key: Key) -> str | None:
        await self._query()
        return self._db.rows.get(str(key))

    @asynccontextmanager
    async def _row_write(
        self, key: Key, value: str, record: dict[str, Any] | None
    ) -> AsyncIterator[RowWrite]:
        db, k = self._db, str(key)

        async def update() -> bool:
            await self._query()
            if k in db.rows:
                db.rows[k] = value
            return k in db.rows

        async def insert() -> bool:
            await self._query()
            db.rows[k] = value
            db.logged(True, k)
            return True

        async def stored() -> str:
            await self._query()
            return db.rows[k]

        async with db.lock:
            yield RowWrite(update, insert, stored)

    async def _delete(self, key: Key) -> bool:
        async with self._db.lock:
            await self._query()
            found = self._db.rows.pop(str(key), None) is not None
            if found:
                self._db.logged(False, str(key))
            return found

    async def count(self) -> int:
        await self._query()
        return len(self._db.rows)

    async def _seed_rows(self, n: int) -> None:
        async with self._db.lock:
            await self._query()
            for key, value in ((f"user-{i}", f'"value-{i}"') for i in range(1, n + 1)):
                if key not in self._db.rows:
                    self._db.rows[key] = value
                    self._db.logged(True, key)

    @asynccontextmanager
    async def _snapshot(self) -> AsyncIterator[Holds]:
        async with self._db.lock:
            rows = self._db.rows

            async def holds(key: Key) -> bool:
                self.feed_queries += 1
                return str(key) in rows

            yield Holds(self._db.newest, holds)

    async def _sample_keys(self, n: int) -> list[str]:
        self.feed_queries += 1
        return random.sample(sorted(self._db.rows), min(n, len(self._db.rows)))

    async def iter_keys(
        self, batch_size: int, at_snapshot: SnapshotHook | None = None
    ) -> AsyncIterator[list[str]]:
        async with self._db.lock:
            keys, position = list(self._db.rows), self._db.newest
            if at_snapshot is not None:
                await at_snapshot(position)
        for i in range(0, len(keys), batch_size):
            await self._query()
            yield keys[i : i + batch_size]

    async def feed_source(self) -> int:
        self.feed_queries += 1
        return self._db.source

    async def newest_change(self) -> int:
        self.feed_queries += 1
        return self._db.newest

    async def oldest_change(self) -> int:
        self.feed_queries += 1
        return self._db.log[0].id if self._db.log else self._db.newest + 1

    async def changes_after(self, after: int, limit: int) -> list[Change]:
        self.feed_queries += 1
        return [c for c in self._db.log if c.id > after][:limit]

    async def compact(self, upto: int) -> int:
        self.feed_queries += 1
        kept = [c for c in self._db.log if c.id > upto]
        gone = len(self._db.log) - len(kept)
        self._db.log[:] = kept
        return gone
