"""Service test fixtures: the app started through its lifespan, on real Redis and fakeredis.

Real Redis: GUARD_TEST_APP_REDIS_URL (default 127.0.0.1:6379 DB 14, shared with CI, so every
test uses its own key prefix and deletes its keys); when nothing answers there, the session
starts its own redis-server. Never skipped.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from asgi_lifespan import LifespanManager

from app.db import SQLiteDatabase
from app.main import create_app
from app.records import RecordStore
from app.settings import Settings
from devkit.keys import delete_prefixed_at
from devkit.redis_server import RedisProcess, shared_or_private_redis

BACKENDS = ["redis", "fakeredis"]
API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="session")
def app_redis_url() -> Iterator[str]:
    with shared_or_private_redis("GUARD_TEST_APP_REDIS_URL", "redis://127.0.0.1:6379/14") as url:
        yield url


@pytest.fixture
def private_redis() -> Iterator[str]:
    """A redis-server of the test's own, for what must not touch the shared one (SCRIPT FLUSH,
    big filters); stopped after the test."""
    server = RedisProcess.start()
    try:
        yield server.url
    finally:
        server.stop()


@dataclass
class Service:
    """A running app: its HTTP client and what its lifespan built."""

    client: httpx.AsyncClient
    state: dict[str, Any]
    settings: Settings

    @property
    def redis(self) -> aioredis.Redis:
        r: aioredis.Redis = self.state["redis"]
        return r

    @property
    def db(self) -> SQLiteDatabase:
        db: SQLiteDatabase = self.state["db"]
        return db

    @property
    def records(self) -> RecordStore:
        store: RecordStore = self.state["records"]
        return store


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def make_settings(
    request: pytest.FixtureRequest, backend: str, tmp_path: Path
) -> Iterator[Callable[..., Settings]]:
    """Settings for one test: own key prefix, own SQLite file, the backend under test."""
    prefix = f"test:app:{uuid.uuid4().hex[:12]}:"
    url = request.getfixturevalue("app_redis_url") if backend == "redis" else "memory://"

    def make(**overrides: Any) -> Settings:
        values: dict[str, Any] = {
            "redis_url": url,
            "key_prefix": prefix,
            "database_url": f"sqlite:///{tmp_path / 'records.db'}",
            "api_key": API_KEY,
            "demo_records": 50,
            "embedded_redis_file": str(tmp_path / "redis.rdb"),
        }
        values.update(overrides)
        return Settings(**values)

    yield make
    if backend == "redis":
        delete_prefixed_at(url, prefix)


StartService = Callable[..., Awaitable[Service]]
DEADLINE_S = 60.0  # how long a background task (a follower, a watchdog) may take in a test


async def until(check: Callable[[], Awaitable[bool]], what: str) -> None:
    """Wait for ``check()`` to hold (a background task's work), failing after DEADLINE_S."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE_S
    while not await check():
        if loop.time() > deadline:
            raise AssertionError(f"not within {DEADLINE_S} s: {what}")
        await asyncio.sleep(0.02)


async def caught_up(svc: Service) -> bool:
    """The records filter has applied every change the database has logged (and the caches
    have followed each: they are told before the filter applies it)."""
    return await svc.records.filter.applied_change() == await svc.db.newest_change()


@pytest.fixture
async def start(make_settings: Callable[..., Settings]) -> AsyncIterator[StartService]:
    """`await start(**settings)` runs an app through its lifespan; stopped after the test."""
    stack = AsyncExitStack()

    async def run(**overrides: Any) -> Service:
        settings = make_settings(**overrides)
        manager = await stack.enter_async_context(
            LifespanManager(create_app(settings), startup_timeout=30, shutdown_timeout=30)
        )
        client = await stack.enter_async_context(
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app=manager.app), base_url="http://test"
            )
        )
        # LifespanManager keeps the lifespan's state dict here; the app gets it per request.
        return Service(client, manager._state, settings)

    async with stack:
        yield run


@pytest.fixture
async def svc(start: StartService) -> Service:
    """The default service: 50 demo records, API key set, fail open."""
    return await start()


# Databases of record (SQLite and PostgreSQL) for the tests that run on each.
from tests.app.dbs import db_url, open_db, other, pg_url, rolled_back  # noqa: E402, F401
