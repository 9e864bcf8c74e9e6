"""Fixtures: every filter test runs on a real Redis server and on fakeredis.

The real server is the one at GUARD_TEST_REDIS_URL (default: 127.0.0.1:6379, DB 12); when none
answers there, the session starts its own redis-server. A real-Redis test never skips: if no
server can be had, it errors. With GUARD_REQUIRE_REAL_REDIS=1 (set by .ci/run) the session also
fails when no real-Redis test ran at all.
"""

from __future__ import annotations

import os
import random
import uuid
from collections.abc import AsyncIterator, Iterator

import fakeredis
import pytest
import redis
import redis.asyncio as aioredis

from devkit.keys import acleaned_up, cleaned_up
from devkit.redis_server import shared_or_private_redis
from guard.packing import use_hiredis_packing

BACKENDS = ["redis", "fakeredis"]
_real_redis_tests = {"count": 0}


@pytest.fixture(scope="session")
def real_redis_url() -> Iterator[str]:
    with shared_or_private_redis("GUARD_TEST_REDIS_URL", "redis://127.0.0.1:6379/12") as url:
        yield url


@pytest.fixture
def prefix() -> str:
    return f"test:{uuid.uuid4().hex[:12]}:"


class _SeedsFromTestName:
    """Stands in for ``secrets`` where reserve() draws a filter's hash seed."""

    def __init__(self, test_id: str) -> None:
        self._rng = random.Random(test_id)

    def randbits(self, k: int) -> int:
        return self._rng.getrandbits(k)


@pytest.fixture(autouse=True)
def repeatable_seeds(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A filter reserved without a seed gets a random one, so which absent items are false
    positives changes on every run: a test asserting "absent" would fail about once in
    10,000 runs per probe, never reproducibly. Seeds drawn from the test's name make every
    run see the same filters; tests that want a spread of seeds give them (hypothesis)."""
    monkeypatch.setattr("guard.params.secrets", _SeedsFromTestName(request.node.nodeid))


@pytest.fixture(scope="session")
def fake_server() -> fakeredis.FakeServer:
    return fakeredis.FakeServer()


@pytest.fixture(params=BACKENDS)
def sync_redis(
    request: pytest.FixtureRequest, prefix: str, fake_server: fakeredis.FakeServer
) -> Iterator[redis.Redis]:
    if request.param == "redis":
        client = redis.Redis.from_url(request.getfixturevalue("real_redis_url"))
        _real_redis_tests["count"] += 1
    else:
        client = fakeredis.FakeRedis(server=fake_server)
    with cleaned_up(client, prefix):
        yield client


@pytest.fixture(params=BACKENDS)
async def async_redis(
    request: pytest.FixtureRequest, prefix: str, fake_server: fakeredis.FakeServer
) -> AsyncIterator[aioredis.Redis]:
    if request.param == "redis":
        # As the service opens it: commands packed by hiredis (tests/test_packing.py).
        url = request.getfixturevalue("real_redis_url")
        client = use_hiredis_packing(aioredis.Redis.from_url(url))
        _real_redis_tests["count"] += 1
    else:
        client = fakeredis.FakeAsyncRedis(server=fake_server)
    async with acleaned_up(client, prefix):
        yield client


@pytest.fixture
def real_redis(real_redis_url: str, prefix: str) -> Iterator[redis.Redis]:
    """The real server only: for what fakeredis cannot show (threads, SCRIPT FLUSH, memory)."""
    _real_redis_tests["count"] += 1
    with cleaned_up(redis.Redis.from_url(real_redis_url), prefix) as client:
        yield client


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get("GUARD_REQUIRE_REAL_REDIS") == "1" and _real_redis_tests["count"] == 0:
        print("\nERROR: no test ran against a real Redis server (GUARD_REQUIRE_REAL_REDIS=1)")
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    terminalreporter.write_line(f"real-redis tests run: {_real_redis_tests['count']}")
