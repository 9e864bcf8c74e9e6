"""Rebuilding the records filter: never a present key read as absent, one fingerprint per row."""

from __future__ import annotations

import asyncio
import random

import pytest

from app.db import SnapshotHook
from tests.app.conftest import AUTH, Service, StartService

# Fingerprints wide enough that two keys colliding in a test is out of the question, so
# counts can be compared exactly.
EXACT = {"records_error_rate": 1e-6, "demo_records": 400, "rebuild_batch": 25}


async def assert_one_copy_per_row(svc: Service) -> None:
    keys = [k async for batch in svc.db.iter_keys(1000) for k in batch]
    counts = [await svc.records.filter.count(k) for k in keys]
    assert counts == [1] * len(keys)
    assert (await svc.records.filter.info()).items == len(keys)
    assert not await svc.records.staging.exists()
    assert not await svc.redis.exists(svc.records.rebuilder.snapshot_key)


class TestRebuild:
    """POST /filters/records/rebuild and the start-up rebuild."""

    async def test_concurrent_reads_never_see_present_key_absent(self, start: StartService) -> None:
        svc = await start(**EXACT, db_latency_ms=1)
        present = [f"user-{i}" for i in range(1, 401)]
        stop = asyncio.Event()
        wrong: list[tuple[str, int]] = []
        reads = 0

        async def reader(seed: int) -> None:
            nonlocal reads
            rng = random.Random(seed)
            while not stop.is_set():
                key = rng.choice(present)
                r = await svc.client.get(f"/records/{key}")
                reads += 1
                if r.status_code != 200:
                    wrong.append((key, r.status_code))

        readers = [asyncio.create_task(reader(i)) for i in range(8)]
        try:
            for _ in range(3):
                r = await svc.client.post("/filters/records/rebuild", headers=AUTH)
                assert r.status_code == 200
        finally:
            stop.set()
            await asyncio.gather(*readers)
        assert reads > 50 and wrong == []
        await assert_one_copy_per_row(svc)

    async def test_writes_during_rebuild_keep_one_copy_per_row(self, start: StartService) -> None:
        svc = await start(**EXACT, db_latency_ms=1)
        stop = asyncio.Event()
        problems: list[str] = []

        async def writer(seed: int) -> None:
            rng = random.Random(seed)
            n = 0
            while not stop.is_set():
                n += 1
                key = f"w{seed}-{n}"
                r = await svc.client.put(f"/records/{key}", json={"value": n}, headers=AUTH)
                if r.status_code != 201:
                    problems.append(f"put {key}: {r.status_code}")
                # A key written a moment ago must never read as absent.
                if (await svc.client.get(f"/records/{key}")).status_code != 200:
                    problems.append(f"{key} absent after PUT")
                victim = f"user-{rng.randrange(1, 401)}"
                r = await svc.client.delete(f"/records/{victim}", headers=AUTH)
                if r.status_code not in (204, 404):
                    problems.append(f"delete {victim}: {r.status_code}")
                if rng.random() < 0.3:  # delete one of ours too: it may be in staging already
                    await svc.client.delete(f"/records/{key}", headers=AUTH)

        writers = [asyncio.create_task(writer(i)) for i in range(4)]
        try:
            for _ in range(3):
                assert (
                    await svc.client.post("/filters/records/rebuild", headers=AUTH)
                ).status_code == 200
        finally:
            stop.set()
            await asyncio.gather(*writers)
        assert problems == []
        await assert_one_copy_per_row(svc)

    async def test_rebuild_sizes_from_table(self, start: StartService) -> None:
        svc = await start(demo_records=3000, records_min_capacity=10, records_headroom=2.0)
        info = await svc.records.filter.info()
        assert info.capacity == 6000 and info.items == 3000
        assert info.target_error_rate == pytest.approx(0.001)

    async def test_startup_rebuild_repairs_a_stale_filter(self, start: StartService) -> None:
        first = await start(**EXACT)
        await first.records.filter.insert("ghost")  # stale fingerprint
        await first.records.filter.delete("user-5")  # lost fingerprint: a false negative
        assert (await first.client.get("/records/user-5")).status_code == 404
        again = await start(**EXACT)  # same prefix and database: a restart
        assert (await again.client.get("/records/user-5")).status_code == 200
        assert await again.records.filter.count("ghost") == 0
        await assert_one_copy_per_row(again)

    async def test_leftovers_of_a_crashed_rebuild_are_cleared(self, svc: Service) -> None:
        store = svc.records
        await store.staging.reserve(10)
        await store.staging.insert("junk")
        await svc.redis.set(store.rebuilder.snapshot_key, 1)  # its snapshot's mark
        r = await svc.client.post("/filters/records/rebuild", headers=AUTH)
        assert r.status_code == 200
        assert await store.filter.count("junk") == 0
        assert await store.filter.count("user-1") == 1
        assert not await store.staging.exists()
        assert not await svc.redis.exists(store.rebuilder.snapshot_key)

    async def test_failed_rebuild_leaves_live_filter_alone(self, svc: Service) -> None:
        store = svc.records
        before = await store.filter.info()

        async def broken(batch_size: int, at_snapshot: SnapshotHook | None = None):  # type: ignore[no-untyped-def]
            if at_snapshot is not None:
                await at_snapshot(await store.db.newest_change())
            yield ["user-1"]
            raise RuntimeError("database went away")

        store.db.iter_keys = broken  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="went away"):
            await store.rebuild()
        assert await store.filter.info() == before
        assert not await store.staging.exists()
        assert not await svc.redis.exists(store.rebuilder.snapshot_key)
        assert await svc.redis.get(store.rebuilder.lock_key) is None  # lock released

    async def test_filter_missing_until_first_build_blocks_nothing(
        self, start: StartService
    ) -> None:
        # No watchdog: it would rebuild the missing filter by itself (tests/app/test_watchdog.py).
        svc = await start(rebuild_on_startup=False, watchdog=False)
        assert not await svc.records.filter.exists()
        r = await svc.client.get("/records/user-1")
        assert r.status_code == 200 and r.headers["x-guard"] == "bypassed"
        r = await svc.client.put("/records/fresh", json={"value": 1}, headers=AUTH)
        assert r.status_code == 201
        assert (await svc.client.post("/filters/records/rebuild", headers=AUTH)).status_code == 200
        assert (await svc.client.get("/records/fresh")).headers["x-guard"] == "passed"
        assert (await svc.client.get("/records/nope")).headers["x-guard"] == "blocked"
