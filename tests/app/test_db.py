"""The SQLite database behind /records: queries counter, hooks, snapshot, write barrier."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from app.db import SQLiteDatabase, open_database, sqlite_path
from guard.changes import Change


@pytest.fixture(params=["file", "memory"])
async def db(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[SQLiteDatabase]:
    url = f"sqlite:///{tmp_path}/t.db" if request.param == "file" else "sqlite:///:memory:"
    database = await open_database(url)
    yield database
    await database.close()


class TestSQLite:
    """get / put / delete / count / seed."""

    async def test_crud_and_query_counter(self, db: SQLiteDatabase) -> None:
        assert await db.put("k", '"v"') is True
        assert await db.put("k", '"w"') is False
        assert await db.get("k") == '"w"'
        assert await db.delete("k") is True
        assert await db.delete("k") is False
        assert await db.get("k") is None
        assert db.queries == 2 + 1 + 1 + 1 + 1 + 1  # new put = UPDATE + INSERT

    async def test_seed_only_fills_an_empty_table(self, db: SQLiteDatabase) -> None:
        assert await db.seed(10) == 10 and await db.count() == 10
        await db.delete("user-3")
        assert await db.seed(10) == 0 and await db.count() == 9

    async def test_hooks_run_inside_the_transaction(self, db: SQLiteDatabase) -> None:
        async def fail(change: Change) -> None:
            raise RuntimeError("filter unreachable")

        with pytest.raises(RuntimeError):
            await db.put("k", "1", on_change=fail)
        assert await db.get("k") is None  # rolled back
        await db.put("k", "1")
        with pytest.raises(RuntimeError):
            await db.delete("k", on_change=fail)
        assert await db.get("k") == "1"  # rolled back
        ran: list[Change] = []

        async def note(change: Change) -> None:
            ran.append(change)

        assert await db.put("k", "2", on_change=note) is False and ran == []  # replace: no hook
        assert await db.delete("nope", on_change=note) is False and ran == []

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
    """iter_keys and write_barrier: what a rebuild relies on."""

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

    async def test_barrier_waits_for_an_open_write(self, db: SQLiteDatabase) -> None:
        inside = asyncio.Event()
        release = asyncio.Event()
        order: list[str] = []

        async def slow_hook(change: Change) -> None:
            inside.set()
            await release.wait()
            order.append("write committed")

        writer = asyncio.create_task(db.put("k", "1", on_change=slow_hook))
        await inside.wait()

        async def barrier() -> None:
            async with db.write_barrier():
                order.append("barrier")

        b = asyncio.create_task(barrier())
        await asyncio.sleep(0.05)
        assert order == []
        release.set()
        await asyncio.gather(writer, b)
        assert order == ["write committed", "barrier"]

    async def test_other_process_writes_wait_for_barrier(self, tmp_path: Path) -> None:
        """Two connections (as two processes would have) are held off by SQLite's lock."""
        url = f"sqlite:///{tmp_path}/shared.db"
        a, b = await open_database(url), await open_database(url)
        try:
            order: list[str] = []
            held = asyncio.Event()

            async def hold() -> None:
                async with a.write_barrier():
                    held.set()
                    await asyncio.sleep(0.1)
                    order.append("barrier done")

            task = asyncio.create_task(hold())
            await held.wait()
            await b.put("k", "1")
            order.append("other write")
            await task
            assert order == ["barrier done", "other write"]
        finally:
            await a.close()
            await b.close()
