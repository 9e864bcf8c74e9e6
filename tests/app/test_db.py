"""The SQLite database behind /records: queries counter, what a put answers, snapshots."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from app.db import SQLiteDatabase, Stored, open_database, sqlite_path


@pytest.fixture(params=["file", "memory"])
async def db(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[SQLiteDatabase]:
    url = f"sqlite:///{tmp_path}/t.db" if request.param == "file" else "sqlite:///:memory:"
    database = await open_database(url)
    yield database
    await database.close()


class TestSQLite:
    """get / put / delete / count / seed."""

    async def test_crud_and_query_counter(self, db: SQLiteDatabase) -> None:
        assert await db.put("k", '"v"') == Stored(True, '"v"')
        assert await db.put("k", '"w"') == Stored(False, '"w"')
        assert await db.get("k") == '"w"'
        assert await db.delete("k") is True
        assert await db.delete("k") is False
        assert await db.get("k") is None
        # new put = UPDATE + INSERT + the row read back; a replace = UPDATE + the read
        assert db.queries == 3 + 2 + 1 + 1 + 1 + 1

    async def test_seed_only_fills_an_empty_table(self, db: SQLiteDatabase) -> None:
        assert await db.seed(10) == 10 and await db.count() == 10
        await db.delete("user-3")
        assert await db.seed(10) == 0 and await db.count() == 9

    async def test_latency(self, tmp_path: Path) -> None:
        slow = await open_database(f"sqlite:///{tmp_path}/s.db", latency_ms=30)
        loop = asyncio.get_running_loop()
        t = loop.time()
        await slow.get("x")
        assert loop.time() - t >= 0.03
        await slow.close()

    def test_url_parsing(self) -> None:
        assert sqlite_path("sqlite:///data/r.db") == "data/r.db"
        assert sqlite_path("sqlite:////abs/r.db") == "/abs/r.db"
        assert sqlite_path("sqlite:///:memory:") == ":memory:"
        with pytest.raises(ValueError, match="GUARD_DATABASE_URL"):
            sqlite_path("postgresql://x/y")


class TestSnapshot:
    """iter_keys and present_at: what a rebuild and the audit rely on."""

    async def test_snapshot_ignores_later_writes(self, db: SQLiteDatabase) -> None:
        await db.seed(25)
        seen: list[str] = []
        async for batch in db.iter_keys(10):
            assert len(batch) <= 10
            seen.extend(batch)
            await db.put(f"late-{len(seen)}", "1")
            await db.delete("user-20")
        assert sorted(seen) == sorted(f"user-{i}" for i in range(1, 26))

    async def test_at_snapshot_runs_with_writers_held_off(self, db: SQLiteDatabase) -> None:
        await db.seed(3)
        order: list[str] = []

        async def mark(change_id: int) -> None:
            writer = asyncio.create_task(db.put("w", "1"))
            await asyncio.sleep(0.05)
            order.append("snapshot" if not writer.done() else "writer first")
            self.writer = writer

        keys = [k async for batch in db.iter_keys(10, mark) for k in batch]
        await self.writer
        assert order == ["snapshot"] and "w" not in keys

    async def test_present_at_reads_one_snapshot_with_its_position(
        self, db: SQLiteDatabase
    ) -> None:
        await db.seed(3)
        await db.delete("user-2")
        position, present = await db.present_at(["user-1", "user-2", "nope", "user-3"])
        assert present == ["user-1", "user-3"]
        assert position == await db.newest_change() == 4
