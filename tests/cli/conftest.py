"""CLI fixtures: a real Redis (DB 11 of the shared server, or one this run starts) and a key
prefix of the test's own, deleted afterwards."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

from devkit.keys import delete_prefixed_at
from devkit.redis_server import shared_or_private_redis


@pytest.fixture(scope="session")
def cli_redis_url() -> Iterator[str]:
    with shared_or_private_redis("GUARD_TEST_CLI_REDIS_URL", "redis://127.0.0.1:6379/11") as url:
        yield url


@pytest.fixture
def cli_env(cli_redis_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """GUARD_REDIS_URL and GUARD_KEY_PREFIX for the commands; the prefix's keys are removed."""
    prefix = f"test:cli:{uuid.uuid4().hex[:12]}:"
    env = {"GUARD_REDIS_URL": cli_redis_url, "GUARD_KEY_PREFIX": prefix}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    yield env
    delete_prefixed_at(cli_redis_url, prefix)


@pytest.fixture
def cli_redis(cli_redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(cli_redis_url)
    yield client
    client.close()
