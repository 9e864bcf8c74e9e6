"""Chaos: the records filter loses changes behind the service's back; the guard notices, stops
blocking, repairs it, and then finds every row again.

Each test runs the service in process on a redis-server of its own, with rows present, reads
those rows through the guard continuously (devkit/chaos.py: Prober) while a fault is injected,
and checks three outcomes: the watchdog detected the fault (an incident with the expected
reason, counted in /metrics); no present row was answered 404 blocked from the moment it was
detected (before that the filter is trusted: the window docs/consistency.md gives figures
for); and after the repair every row reads "passed" through the guard, and the filter itself
holds every row (zero false negatives). Durations are not asserted; deadlines are generous.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.settings import Settings
from app.watchdog import AUDIT_MISS, BEHIND, MISSING, ROLLED_BACK, Incident, Watchdog
from devkit.chaos import (
    Chaos,
    Failover,
    InProcess,
    Prober,
    in_process,
    insert_directly,
    ride_out,
    until,
)
from devkit.postgres import temporary_database
from devkit.service import API_KEY, AUTH

DEMO_ROWS = 200
PREFIX = "chaos:"
# Short enough for a quick test, the same rules as the defaults (docs/consistency.md).
FAST = {
    "watchdog_interval": 0.05,
    "watchdog_max_lag": 0.5,
    "audit_interval": 0.1,
    "audit_sample": 16,
    "redis_timeout": 2.0,
    "redis_cooldown": 0.1,
}
DEADLINE_S = 60.0
PG_PREFIX = "watch16_"  # the databases these tests create on the shared PostgreSQL
# The faults where the database of record matters run on both; the others on SQLite.
BOTH_DATABASES = pytest.mark.parametrize("database", ["sqlite", "postgres"], indirect=True)


@dataclass
class Guarded:
    """The service in process, and its settings."""

    svc: InProcess
    settings: Settings

    @property
    def client(self) -> httpx.AsyncClient:
        return self.svc.client

    @property
    def state(self) -> dict[str, Any]:
        return self.svc.state

    @property
    def watchdog(self) -> Watchdog:
        w: Watchdog = self.state["watchdog"]
        return w

    async def put(self, keys: list[str]) -> None:
        await self.svc.put(keys, AUTH)


Start = Callable[..., Awaitable[Guarded]]


@pytest.fixture
async def database(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    """The database of record's URL: a SQLite file (the default), or a PostgreSQL database
    of the test's own, dropped after it (no server is an error, never a skip)."""
    if getattr(request, "param", "sqlite") == "sqlite":
        yield f"sqlite:///{tmp_path / 'records.db'}"
        return
    async with temporary_database(PG_PREFIX) as url:
        yield url


@pytest.fixture
async def start(database: str) -> AsyncIterator[Start]:
    """`await start(redis_url, **settings)`: the service in process, stopped after the test."""
    async with AsyncExitStack() as stack:

        async def run(redis_url: str, **overrides: Any) -> Guarded:
            values: dict[str, Any] = {
                "redis_url": redis_url,
                "key_prefix": PREFIX,
                "database_url": database,
                "api_key": API_KEY,
                "demo_records": DEMO_ROWS,
                **FAST,
                **overrides,
            }
            settings = Settings(**values)
            return Guarded(await stack.enter_async_context(in_process(settings)), settings)

        yield run


# The Redis fixtures come before `start` in each test's arguments: the service stops first,
# as it would in a deployment (Redis outlives it).
@pytest.fixture
def chaos(tmp_path: Path) -> Iterator[Chaos]:
    """A redis-server of the test's own with a data folder that survives restarts."""
    c = Chaos(tmp_path / "redis", PREFIX, "records")
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
async def failover(tmp_path: Path) -> AsyncIterator[Failover]:
    """A primary, its replica, and the address (a proxy) the service uses."""
    pair = await Failover(tmp_path / "pair", PREFIX, "records").start()
    try:
        yield pair
    finally:
        await pair.close()


def demo_keys() -> list[str]:
    return [f"user-{i}" for i in range(1, DEMO_ROWS + 1)]


async def survive(
    svc: Guarded, fault: Callable[[Prober], Awaitable[float]], reasons: set[str]
) -> Incident:
    """Run `fault` while present rows are read (devkit.chaos.ride_out); check the incident
    that detected it, that no row was blocked from its start, that /metrics counted it,
    and that every row is found afterwards. Returns the incident."""
    out = await ride_out(svc.client, svc.watchdog, demo_keys(), fault, deadline=DEADLINE_S)
    incident = out.incident
    assert incident is not None, "the fault was not detected"
    assert incident.reason in reasons, incident
    assert out.blocked_while_stale == [], "a present row blocked while stale"
    await all_found(svc, out.prober.keys)
    metrics = (await svc.client.get("/metrics")).text
    counted = f'guard_filter_stale_incidents_total{{filter="records",reason="{incident.reason}"}}'
    assert counted in metrics
    return incident


async def all_found(svc: Guarded, keys: list[str]) -> None:
    """Zero false negatives: the filter holds every present row, and the guard passes each."""
    found = await svc.state["records"].filter.lookup_many(keys)
    assert found.count(False) == 0, f"{found.count(False)} of {len(keys)} rows read absent"
    # A fault that failed a lookup opened the breaker for its cooldown (1 s), in which reads
    # pass without asking the filter ("bypassed"); a quick repair can end inside it. Wait
    # until the guard asks again (a guard that never does fails here), then every row passes.
    give_up = time.monotonic() + DEADLINE_S
    while (await svc.client.get(f"/records/{keys[0]}")).headers["x-guard"] == "bypassed":
        assert time.monotonic() < give_up, "the guard never asked the filter again"
        await asyncio.sleep(0.05)
    for key in keys:
        r = await svc.client.get(f"/records/{key}")
        assert (r.status_code, r.headers["x-guard"]) == (200, "passed"), key


async def until_applied(svc: Guarded) -> None:
    """Until the filter applied every change committed now (the follower's window over)."""
    newest = await svc.state["db"].newest_change()
    give_up = time.monotonic() + DEADLINE_S
    while await svc.state["records"].filter.applied_change() < newest:
        assert time.monotonic() < give_up, "the follower never applied the writes"
        await asyncio.sleep(0.01)


def new_keys(tag: str, n: int = 100) -> list[str]:
    return [f"{tag}-{i}" for i in range(n)]


def written(svc: Guarded, prober: Prober, tag: str) -> Callable[[], Awaitable[None]]:
    """A write a fault makes while it happens: new rows through the service, which the
    prober then expects to find."""
    rows = new_keys(tag)

    async def write() -> None:
        await svc.put(rows)
        prober.add(rows)

    return write


class TestRedisLosesChanges:
    """Redis gives back an older filter, or none: its id shows it is behind."""

    @BOTH_DATABASES
    async def test_restarted_from_an_older_rdb(self, chaos: Chaos, start: Start) -> None:
        svc = await start(chaos.url)
        await survive(
            svc,
            lambda prober: chaos.older_rdb(written(svc, prober, "after-save")),
            {ROLLED_BACK, BEHIND},
        )

    async def test_replica_promoted_while_behind(self, failover: Failover, start: Start) -> None:
        svc = await start(failover.url)
        await survive(
            svc,
            lambda prober: failover.promote_behind(written(svc, prober, "unreplicated")),
            {ROLLED_BACK, BEHIND},
        )

    async def test_filter_key_deleted(self, chaos: Chaos, start: Start) -> None:
        svc = await start(chaos.url)
        await survive(svc, lambda prober: chaos.key_deleted(), {MISSING})

    async def test_replaced_by_an_older_copy(self, chaos: Chaos, start: Start) -> None:
        svc = await start(chaos.url)
        await survive(
            svc,
            lambda prober: chaos.older_copy(written(svc, prober, "after-copy")),
            {ROLLED_BACK, BEHIND},
        )

    async def test_redis_back_empty(self, chaos: Chaos, start: Start) -> None:
        svc = await start(chaos.url)
        await survive(svc, lambda prober: chaos.flushed(), {MISSING})


class TestDamageWithoutTrace:
    """The filter's id is right but its contents are not: only the audit can tell."""

    async def test_zeroed_in_place(self, chaos: Chaos, start: Start) -> None:
        svc = await start(chaos.url)
        incident = await survive(svc, lambda prober: chaos.zeroed(), {AUDIT_MISS})
        assert incident.how == "rebuild"


@BOTH_DATABASES
class TestDirectWrites:
    """Rows inserted in the table by another connection, not through the service."""

    async def test_the_follower_applies_them_without_an_incident(
        self, chaos: Chaos, start: Start, database: str
    ) -> None:
        """The normal window: each row may read absent until the follower applied it (its
        lag, docs/consistency.md), which is no fault; then every row is found."""
        svc = await start(chaos.url)
        opened = svc.watchdog.opened
        rows = new_keys("direct", 300)
        async with Prober(svc.client, demo_keys()) as prober:
            for part in range(0, len(rows), 30):
                await insert_directly(database, rows[part : part + 30])
                await asyncio.sleep(0.02)
            prober.add(rows)
            await until_applied(svc)
            applied_at = time.monotonic()
            reads = len(prober.samples)
            await until(lambda: len(prober.samples) > reads + 200, "reads after", DEADLINE_S)
        assert prober.blocked(since=applied_at) == []
        assert svc.watchdog.opened == opened, list(svc.watchdog.history)
        await all_found(svc, rows)

    async def test_without_a_follower_they_make_it_stale(
        self, chaos: Chaos, start: Start, database: str
    ) -> None:
        """No follower in the service (and no `guard follow` running): the changes stay
        unapplied past GUARD_WATCHDOG_MAX_LAG; the watchdog replays them."""
        svc = await start(chaos.url, feed=False)
        rows = new_keys("unfollowed")

        async def fault(prober: Prober) -> float:
            await insert_directly(database, rows)
            prober.add(rows)
            return time.monotonic()

        incident = await survive(svc, fault, {BEHIND})
        assert incident.how == "catch_up"
