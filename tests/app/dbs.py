"""Fixtures for tests that run on every database of record: SQLite and PostgreSQL.

`open_db(spec)` opens the backend's database (closed after the test); `other(sql)` runs a
statement on a connection of its own, autocommitted, as the user's application would.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import asyncpg
import pytest

from app.db import Database, TableSpec, open_database, sqlite_path
from devkit.postgres import temporary_database

OpenDb = Callable[..., Awaitable[Database]]
Other = Callable[[str], Awaitable[None]]

DB_BACKENDS = ["sqlite", "postgres"]
PG_PREFIX = "db16_"  # the databases these tests create on the shared server


@pytest.fixture(params=DB_BACKENDS)
async def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    """A fresh database of the backend: a SQLite file, or a PostgreSQL database of the
    test's own (dropped after it; an unreachable server is an error, never a skip)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/feed.db"
        return
    async with temporary_database(PG_PREFIX) as url:
        yield url


@pytest.fixture
async def pg_url() -> AsyncIterator[str]:
    """A PostgreSQL database of the test's own (request it before `start`, so the service
    stops before the database is dropped)."""
    async with temporary_database(PG_PREFIX) as url:
        yield url


@pytest.fixture
async def open_db(db_url: str) -> AsyncIterator[OpenDb]:
    opened: list[Database] = []

    async def open_(spec: TableSpec | None = None) -> Database:
        db = await open_database(db_url, table=spec)
        opened.append(db)
        return db

    yield open_
    for db in opened:
        await db.close()


def _runs_sql(db_url: str, commit: bool) -> Other:
    """`run(sql)`: the statement on a connection of its own, committed (autocommitted on
    PostgreSQL) or rolled back."""
    if not db_url.startswith("sqlite:"):

        async def run_pg(sql: str) -> None:
            conn = await asyncpg.connect(db_url)
            try:
                if commit:
                    await conn.execute(sql)
                    return
                tx = conn.transaction()
                await tx.start()
                await conn.execute(sql)
                await tx.rollback()
            finally:
                await conn.close()

        return run_pg
    path = sqlite_path(db_url)

    def run(sql: str) -> None:
        conn = sqlite3.connect(path, timeout=10)
        try:
            conn.execute(sql)
            if commit:
                conn.commit()
            else:
                conn.rollback()
        finally:
            conn.close()

    async def run_async(sql: str) -> None:
        await asyncio.to_thread(run, sql)

    return run_async


@pytest.fixture
def other(db_url: str) -> Other:
    return _runs_sql(db_url, commit=True)


@pytest.fixture
def rolled_back(db_url: str) -> Other:
    """`rolled_back(sql)`: the statement run in a transaction of its own connection, which
    then rolls back, as a failed transaction of the user's application would."""
    return _runs_sql(db_url, commit=False)
