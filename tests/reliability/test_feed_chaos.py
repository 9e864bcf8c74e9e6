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
from devkit.chaos import Chaos, Failover, InProcess, Prober, in_process
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
async def start(tmp_path: Path) -> AsyncIterator[Start]:
    """`await start(redis_url, **settings)`: the service in process, stopped after the test."""
    async with AsyncExitStack() as stack:

        async def run(redis_url: str, **overrides: Any) -> Guarded:
            values: dict[str, Any] = {
                "redis_url": redis_url,
                "key_prefix": PREFIX,
                "database_url": f"sqlite:///{tmp_path / 'records.db'}",
                "api_key": API_KEY,
                "demo_records": DEMO_ROWS,
                **FAST,
                **overrides,
            }
            settings = Settings(**values)
            return Guarded(await stack.enter_async_context(in_process(settings)), settings)

        yield run


@pytest.fixture
def chaos(tmp_path: Path) -> Iterator[Chaos]:
    c = Chaos(tmp_path / "redis", PREFIX, "records")
    try:
        yield c
    finally:
        c.close()


def demo_keys() -> list[str]:
    return [f"user-{i}" for i in range(1, DEMO_ROWS + 1)]


async def until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting: {what}"
        await asyncio.sleep(0.01)


async def survive(
    svc: Guarded, fault: Callable[[Prober], Awaitable[float]], reasons: set[str]
) -> Incident:
    """Run `fault` while present rows are read; return the incident that detected it, once
    it ended, after checking no row was blocked from its start."""
    watchdog = svc.watchdog
    await until(lambda: not watchdog.stale, "the filter trusted before the fault")
    opened = watchdog.opened
    async with Prober(svc.client, demo_keys()) as prober:
        await until(lambda: len(prober.samples) > 20, "reads before the fault")
        fault_at = await fault(prober)
        await until(lambda: watchdog.opened > opened, "the fault detected")
        await until(lambda: not watchdog.stale, "the filter repaired")
        reads = len(prober.samples)
        await until(lambda: len(prober.samples) > reads + 100, "reads after the repair")
    incident = next(i for i in watchdog.history if i.since >= fault_at)
    assert incident.reason in reasons, incident
    assert prober.blocked(since=incident.since) == [], "a present row blocked while stale"
    await all_found(svc, prober.keys)
    metrics = (await svc.client.get("/metrics")).text
    assert f'guard_filter_stale_incidents_total{{filter="records",reason="{incident.reason}"}}' in (
        metrics
    )
    return incident


async def all_found(svc: Guarded, keys: list[str]) -> None:
    """Zero false negatives: the filter holds every present row, and the guard passes each."""
    found = await svc.state["records"].filter.lookup_many(keys)
    assert found.count(False) == 0, f"{found.count(False)} of {len(keys)} rows read absent"
    for key in keys:
        r = await svc.client.get(f"/records/{key}")
        assert (r.status_code, r.headers["x-guard"]) == (200, "passed"), key


def new_keys(tag: str, n: int = 100) -> list[str]:
    return [f"{tag}-{i}" for i in range(n)]


class TestRedisLosesChanges:
    """Redis gives back an older filter, or none: its id shows it is behind."""

    async def test_restarted_from_an_older_rdb(self, start: Start, chaos: Chaos) -> None:
        svc = await start(chaos.url)

        async def fault(prober: Prober) -> float:
            rows = new_keys("after-save")

            async def write() -> None:
                await svc.put(rows)
                prober.add(rows)

            return await chaos.older_rdb(write)

        await survive(svc, fault, {ROLLED_BACK, BEHIND})

    async def test_replica_promoted_while_behind(self, start: Start, tmp_path: Path) -> None:
        pair = await Failover(tmp_path / "pair", PREFIX, "records").start()
        try:
            svc = await start(pair.url)

            async def fault(prober: Prober) -> float:
                rows = new_keys("unreplicated")

                async def write() -> None:
                    await svc.put(rows)
                    prober.add(rows)

                return await pair.promote_behind(write)

            await survive(svc, fault, {ROLLED_BACK, BEHIND})
        finally:
            await pair.close()

    async def test_filter_key_deleted(self, start: Start, chaos: Chaos) -> None:
        svc = await start(chaos.url)
        await survive(svc, lambda prober: chaos.key_deleted(), {MISSING})

    async def test_replaced_by_an_older_copy(self, start: Start, chaos: Chaos) -> None:
        svc = await start(chaos.url)

        async def fault(prober: Prober) -> float:
            rows = new_keys("after-copy")

            async def write() -> None:
                await svc.put(rows)
                prober.add(rows)

            return await chaos.older_copy(write)

        await survive(svc, fault, {ROLLED_BACK, BEHIND})

    async def test_redis_back_empty(self, start: Start, chaos: Chaos) -> None:
        svc = await start(chaos.url)
        await survive(svc, lambda prober: chaos.flushed(), {MISSING})


class TestDamageWithoutTrace:
    """The filter's id is right but its contents are not: only the audit can tell."""

    async def test_zeroed_in_place(self, start: Start, chaos: Chaos) -> None:
        svc = await start(chaos.url)
        incident = await survive(svc, lambda prober: chaos.zeroed(), {AUDIT_MISS})
        assert incident.how == "rebuild"
