"""Read-your-writes on /records under concurrency: a GET after an acknowledged PUT from the
same client returns that value (or a newer one), however many other clients read and write."""

from __future__ import annotations

import asyncio
import random

from tests.app.conftest import AUTH, Service, StartService

WRITERS = 24
WRITES_EACH = 40
READERS = 12
KEYS_EACH = 3  # few keys per writer: reads of them are often in flight when it writes


async def _writer(svc: Service, w: int, stale: list[str]) -> None:
    """Writes increasing values to its own keys; checks each one is read back at once."""
    rng = random.Random(w)
    for i in range(WRITES_EACH):
        key = f"w{w}-{rng.randrange(KEYS_EACH)}"
        put = await svc.client.put(f"/records/{key}", json={"value": i}, headers=AUTH)
        assert put.status_code in (200, 201), put.text
        got = await svc.client.get(f"/records/{key}")
        # Only this writer writes `key` and it writes sequentially: "newer" cannot happen.
        if got.status_code != 200 or got.json()["value"] != i:
            stale.append(f"{key}: wrote {i}, read {got.status_code} {got.text}")


async def _reader(svc: Service, r: int, stop: asyncio.Event) -> None:
    """Keeps reads of the writers' keys in flight (and their cache entries loading)."""
    rng = random.Random(1000 + r)
    while not stop.is_set():
        key = f"w{rng.randrange(WRITERS)}-{rng.randrange(KEYS_EACH)}"
        got = await svc.client.get(f"/records/{key}")
        assert got.status_code in (200, 404), got.text


async def _run(svc: Service) -> list[str]:
    stale: list[str] = []
    stop = asyncio.Event()
    readers = [asyncio.create_task(_reader(svc, r, stop)) for r in range(READERS)]
    try:
        await asyncio.gather(*(_writer(svc, w, stale) for w in range(WRITERS)))
    finally:
        stop.set()
        await asyncio.gather(*readers)
    return stale


async def test_get_after_acknowledged_put_reads_it(start: StartService) -> None:
    """Hundreds of write-then-read pairs while readers hammer the same keys: none stale."""
    # A short cache TTL keeps entries loading (and racing the writes) all through the run.
    # The shared Redis is busy while CI runs: a 0.25 s timeout would fail writes now and then,
    # which says nothing about staleness.
    svc = await start(cache_ttl=0.05, negative_ttl=0.05, redis_timeout=2.0)
    stale = await _run(svc)
    assert stale == [], f"{len(stale)} of {WRITERS * WRITES_EACH} reads were stale: {stale[:5]}"


async def test_get_after_put_does_not_join_a_load_from_before_it(svc: Service) -> None:
    """A read of the row that started before the PUT committed is not shared with a GET
    made after the PUT was acknowledged (single-flight would hand it the old row)."""
    read_old, release = asyncio.Event(), asyncio.Event()
    db_get = svc.db.get

    async def slow_first_read(key: str) -> str | None:
        svc.db.get = db_get  # type: ignore[method-assign]  # later reads run normally
        raw = await db_get(key)
        read_old.set()
        await release.wait()
        return raw

    svc.db.get = slow_first_read  # type: ignore[method-assign]
    early = asyncio.create_task(svc.client.get("/records/user-3"))
    await read_old.wait()  # it has read "value-3" and is still loading
    put = await svc.client.put("/records/user-3", json={"value": "new"}, headers=AUTH)
    assert put.status_code == 200
    late = asyncio.create_task(svc.client.get("/records/user-3"))
    await asyncio.sleep(0.05)  # let it find the early load in flight, if it would join it
    release.set()
    assert (await late).json() == {"key": "user-3", "value": "new"}
    assert (await early).json()["value"] in ("value-3", "new")  # it overlapped the write
    assert (await svc.client.get("/records/user-3")).json()["value"] == "new"  # not cached old


async def test_read_your_writes_on_postgresql(pg_url: str, start: StartService) -> None:
    """The same on PostgreSQL, whose reads and writes spread over a pool of connections."""
    svc = await start(database_url=pg_url, cache_ttl=0.05, negative_ttl=0.05, redis_timeout=2.0)
    stale = await _run(svc)
    assert stale == [], f"{len(stale)} of {WRITERS * WRITES_EACH} reads were stale: {stale[:5]}"
