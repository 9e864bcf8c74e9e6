"""In-process service fixtures for the reliability tests that need no uvicorn of their own.

The app runs through its lifespan on the real Redis (the session's shared server, under a key
prefix of the test's own, deleted afterwards) with a SQLite file in the test's tmp_path.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from asgi_lifespan import LifespanManager

from app.main import create_app
from app.settings import Settings
from devkit.keys import cleaned_up
from devkit.service import API_KEY


@dataclass
class InProcess:
    """A running app: its HTTP client, its settings, and a plain client on its Redis."""

    client: httpx.AsyncClient
    settings: Settings
    redis: redis.Redis

    def key(self, filter_name: str) -> str:
        """The Redis key of a filter's first sub-filter (docs/format.md)."""
        return f"{self.settings.key_prefix}{{{filter_name}}}"


StartApp = Callable[..., Awaitable[InProcess]]


@pytest.fixture
async def start_app(real_redis_url: str, prefix: str, tmp_path: Path) -> AsyncIterator[StartApp]:
    """`await start_app(**settings)`: an app on the real Redis under this test's prefix."""
    stack = AsyncExitStack()
    plain = stack.enter_context(cleaned_up(redis.Redis.from_url(real_redis_url), prefix))

    async def run(**overrides: Any) -> InProcess:
        values: dict[str, Any] = {
            "redis_url": real_redis_url,
            "key_prefix": prefix,
            "database_url": f"sqlite:///{tmp_path / 'records.db'}",
            "api_key": API_KEY,
            "demo_records": 50,
            # The shared server is busy (CI, benchmarks): the default 0.25 s would fail the
            # start-up rebuild now and then. Outage tests (own servers) keep the short one.
            "redis_timeout": 2.0,
            **overrides,
        }
        settings = Settings(**values)
        manager = await stack.enter_async_context(LifespanManager(create_app(settings)))
        client = await stack.enter_async_context(
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app=manager.app), base_url="http://test"
            )
        )
        return InProcess(client, settings, plain)

    async with stack:
        yield run
