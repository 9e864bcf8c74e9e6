"""SCRIPT FLUSH in a loop is invisible to the service: every script it runs (the records cache,
Idempotency-Key releases, the rebuild lock) survives it, and no request answers 5xx.

On a private server: flushing the shared one in a loop would disturb its other clients.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
import redis

from tests.app.conftest import AUTH, Service, StartService

ROUNDS = 150


@pytest.fixture
def flushing(private_redis: str) -> Iterator[None]:
    """SCRIPT FLUSH as fast as the server takes it, for the test's duration."""
    stop = threading.Event()
    flushes = 0

    def flush() -> None:
        nonlocal flushes
        client = redis.Redis.from_url(private_redis)
        while not stop.is_set():
            client.script_flush()
            flushes += 1
        client.close()

    thread = threading.Thread(target=flush)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
    assert flushes > ROUNDS  # the loop really ran alongside the requests


async def _traffic(svc: Service, worker: int) -> list[int]:
    statuses = []
    for i in range(ROUNDS):
        # Every read misses the cache (TTL 1 ms), so every read runs the cache script.
        statuses.append((await svc.client.get(f"/records/user-{i % 50 + 1}")).status_code)
        key = f"w{worker}-{i}"
        put = await svc.client.put(f"/records/{key}", json={"value": i}, headers=AUTH)
        statuses.append(put.status_code)
        # A 404 releases the Idempotency-Key claim with a script.
        add = await svc.client.post(
            "/filters/nothing-here/add",
            json={"items": ["a"]},
            headers={**AUTH, "Idempotency-Key": key},
        )
        statuses.append(add.status_code)
    return statuses


@pytest.mark.parametrize("backend", ["redis"])
async def test_no_5xx_while_scripts_are_flushed(
    start: StartService, private_redis: str, flushing: None
) -> None:
    svc = await start(redis_url=private_redis, cache_ttl=0.001, negative_ttl=0.001)
    statuses = [s for batch in await asyncio.gather(*(_traffic(svc, w) for w in range(4)))
                for s in batch]  # fmt: skip
    assert [s for s in statuses if s >= 500] == []
    assert set(statuses) <= {200, 201, 404}
    # The rebuild releases and reacquires its lock with scripts.
    for _ in range(5):
        rebuilt = await svc.client.post("/filters/records/rebuild", headers=AUTH)
        assert rebuilt.status_code == 200, rebuilt.text
    assert rebuilt.json()["items"] == 50 + 4 * ROUNDS
