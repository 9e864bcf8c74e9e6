"""Sharded filters: on the 3-master cluster (shards on different nodes) and on fakeredis."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator

import fakeredis
import pytest
import redis.asyncio.cluster as aiocluster
from redis.cluster import RedisCluster

from devkit.keys import delete_prefixed
from guard import (
    FilterExistsError,
    FilterFullError,
    FilterNotFoundError,
    InvalidParameterError,
    ShardedCuckooFilter,
    SyncCuckooFilter,
    SyncShardedCuckooFilter,
    list_filters_sync,
    list_sharded_filters,
    list_sharded_filters_sync,
)
from guard.hashing import item_hash, shard_of
from guard.sharded import shard_capacity


def items(n: int, tag: str = "k") -> list[str]:
    return [f"{tag}{i}" for i in range(n)]


@pytest.fixture(params=["cluster", "fakeredis"])
def client(request: pytest.FixtureRequest, prefix: str) -> Iterator[object]:
    if request.param == "cluster":
        yield request.getfixturevalue("sync_redis")
        return
    fake = fakeredis.FakeRedis()
    yield fake
    fake.close()


@pytest.fixture
def sf(client: object, prefix: str) -> SyncShardedCuckooFilter:
    return SyncShardedCuckooFilter(client, "records", prefix=prefix, shards=3)


class TestRouting:
    def test_shard_bits_are_independent_of_bucket_and_fingerprint(self) -> None:
        """Items of one shard spread over buckets and fingerprints like any others."""
        data = [x.encode() for x in items(30_000)]
        in_shard = [d for d in data if shard_of(d, 7, 3) == 0]
        assert 9_000 < len(in_shard) < 11_000
        h_low = Counter(item_hash(d, 7)[0] % 3 for d in in_shard)
        g_low = Counter(item_hash(d, 7)[1] % 3 for d in in_shard)
        for counts in (h_low, g_low):
            assert max(counts.values()) - min(counts.values()) < 0.1 * len(in_shard)

    def test_shard_capacity_has_headroom_for_the_fullest_shard(self) -> None:
        assert shard_capacity(1000, 1) == 1000
        assert 333 < shard_capacity(1000, 3) < 420
        assert shard_capacity(3_000_000_000, 3) < 1.0002 * 1_000_000_000


class TestShardedFilter:
    def test_reserve_writes_one_tagged_key_per_shard(
        self, sf: SyncShardedCuckooFilter, client: object, prefix: str
    ) -> None:
        info = sf.reserve(30_000, error_rate=0.001, expansion=0)
        assert [sf.key(i) for i in range(3)] == [f"{prefix}{{records:{i}}}" for i in range(3)]
        assert all(client.exists(sf.key(i)) for i in range(3))  # type: ignore[attr-defined]
        assert (info.shards, len(info.per_shard), info.items) == (3, 3, 0)
        assert info.capacity >= 30_000
        assert info.memory_bytes == sum(x.memory_bytes for x in info.per_shard)
        with pytest.raises(FilterExistsError):
            sf.reserve(100)

    def test_round_trip_routes_every_item(self, sf: SyncShardedCuckooFilter) -> None:
        sf.reserve(20_000, expansion=0)
        data = items(20_000)
        assert all(sf.insert_many(data))  # a fixed-size sharded filter holds its capacity
        assert all(sf.lookup_many(data))
        assert sum(sf.lookup_many(items(5000, "absent"))) < 5
        per_shard = [x.items for x in sf.info().per_shard]
        assert sum(per_shard) == 20_000 and min(per_shard) > 6000
        assert sf.delete_many(data[:1000]) == [True] * 1000
        assert sf.delete_many(["never"]) == [False]
        assert sf.count(data[1000]) == 1
        assert sf.insert(data[1000]) and sf.count(data[1000]) == 2
        assert sf.insert_unique(data[1000]) is False
        info = sf.info()
        assert (info.items, info.deletes, info.missed_deletes) == (19_001, 1000, 1)

    def test_growth_inside_shards(self, sf: SyncShardedCuckooFilter) -> None:
        sf.reserve(300, expansion=2, error_rate=0.01)
        data = items(5000)
        assert all(sf.insert_many(data))
        info = sf.info()
        assert info.subfilters >= 3 and all(sf.lookup_many(data))
        assert info.error_rate < 0.01

    def test_full_shard_reports_per_item(self, sf: SyncShardedCuckooFilter) -> None:
        sf.reserve(300, expansion=0, bucket_size=2, max_kicks=20)
        with pytest.raises(FilterFullError) as raised:
            sf.insert_many(items(3000))
        added = [x for x, ok in zip(items(3000), raised.value.results, strict=True) if ok]
        assert len(added) >= 300
        assert all(sf.lookup_many(added))

    def test_wrong_shard_count_is_an_error(
        self, sf: SyncShardedCuckooFilter, client: object
    ) -> None:
        sf.reserve(100)
        wrong = SyncShardedCuckooFilter(client, "records", prefix=sf._handles[0].prefix, shards=4)
        with pytest.raises(InvalidParameterError, match="has 3 shard"):
            wrong.lookup("x")
        with pytest.raises(InvalidParameterError, match="has 3 shard"):
            wrong.info()

    def test_missing_is_an_error_and_drop_removes_all(
        self, sf: SyncShardedCuckooFilter, client: object
    ) -> None:
        with pytest.raises(FilterNotFoundError):
            sf.lookup("x")
        sf.reserve(100)
        sf.insert_many(items(50))
        assert sf.drop() is True and sf.drop() is False
        assert not any(client.exists(sf.key(i)) for i in range(3))  # type: ignore[attr-defined]
        with pytest.raises(FilterNotFoundError):
            sf.insert("x")

    def test_recreated_under_a_handle_is_rerouted(self, client: object, prefix: str) -> None:
        a = SyncShardedCuckooFilter(client, "re", prefix=prefix, shards=3)
        b = SyncShardedCuckooFilter(client, "re", prefix=prefix, shards=3)
        a.reserve(1000, seed=1)
        b.insert_many(items(100))
        a.drop()
        a.reserve(1000, seed=2)  # another seed: every item routes differently now
        a.insert_many(items(100, "new"))
        assert all(b.lookup_many(items(100, "new")))  # b's routes were stale; it re-reads
        assert all(b.insert_many(items(100, "b")))
        assert all(a.lookup_many(items(100, "b")))

    def test_staging_keeps_the_seed_and_promotes(self, sf: SyncShardedCuckooFilter) -> None:
        live = sf.reserve(100, expansion=2)
        sf.insert_many(items(500, "old"))
        stage = sf.staging()
        staged = stage.reserve(2000, expansion=0)
        assert staged.shards == 3
        stage.insert_many(items(1000, "new"))
        assert stage.promote() is True
        assert all(sf.lookup_many(items(1000, "new")))
        info = sf.info()
        assert (info.items, info.expansion, info.subfilters) == (1000, 0, 1)
        assert live.expansion == 2

    def test_listed_with_their_shard_counts(self, client: object, prefix: str) -> None:
        """Shards of every node are found; sub-filters, staging copies and plain filters are
        not sharded filters."""
        grown = SyncShardedCuckooFilter(client, "grown", prefix=prefix, shards=12)
        grown.reserve(120, expansion=2)
        grown.insert_many(items(2000))  # every shard now has sub-filter keys (…}:1, …}:2)
        assert all(shard.subfilters > 1 for shard in grown.info().per_shard)
        SyncShardedCuckooFilter(client, "records", prefix=prefix, shards=3).reserve(100)
        SyncShardedCuckooFilter(client, "records", prefix=prefix, shards=3).staging().reserve(10)
        SyncCuckooFilter(client, "plain", prefix=prefix).reserve(100)
        SyncShardedCuckooFilter(client, "staged", prefix=prefix, shards=2).staging().reserve(10)
        listed = list_sharded_filters_sync(client, prefix)
        assert listed == {"grown": 12, "records": 3}
        assert list_filters_sync(client, prefix) == ["plain"]
        for name, shards in listed.items():  # the count opens each filter as it was made
            SyncShardedCuckooFilter(client, name, prefix=prefix, shards=shards).info()

    def test_bad_shard_counts(self, client: object) -> None:
        for bad in (0, -1, 5000, True, "3"):
            with pytest.raises(InvalidParameterError, match="shards must be"):
                SyncShardedCuckooFilter(client, "x", shards=bad)  # type: ignore[arg-type]


class TestOnCluster:
    def test_shards_land_on_different_nodes(self, sync_redis: RedisCluster, prefix: str) -> None:
        sf = SyncShardedCuckooFilter(sync_redis, "records", prefix=prefix, shards=3)
        sf.reserve(3000)
        assert all(sf.insert_many(items(3000)))
        nodes = sf.nodes()
        assert len(set(nodes)) == 3
        # Asked directly (no redirection), each node holds its own shard's key.
        for i, node in enumerate(nodes):
            host, port = str(node).split(":")
            direct = sync_redis.get_redis_connection(sync_redis.get_node(host, int(port)))
            assert direct.exists(sf.key(i)) == 1

    def test_many_shards_use_every_node(self, sync_redis: RedisCluster, prefix: str) -> None:
        sf = SyncShardedCuckooFilter(sync_redis, "users", prefix=prefix, shards=12)
        assert len(set(sf.nodes())) == 3
        sf.reserve(12_000)
        assert all(sf.insert_many(items(12_000)))
        assert all(sf.lookup_many(items(12_000)))

    async def test_async_sharded_on_cluster(
        self, async_redis: aiocluster.RedisCluster, prefix: str
    ) -> None:
        sf = ShardedCuckooFilter(async_redis, "records", prefix=prefix, shards=3)
        await sf.reserve(1000, expansion=2)
        data = items(6000)
        assert all(await sf.insert_many(data))
        assert all(await sf.lookup_many(data))
        # Concurrent single lookups are coalesced into shared trips.
        assert all(await asyncio.gather(*(sf.lookup(x) for x in data[:200])))
        assert await sf.delete_many(data[:10]) == [True] * 10
        assert await sf.count(data[10]) == 1
        info = await sf.info()
        assert (info.items, info.shards) == (5990, 3)
        stage = sf.staging()
        await stage.reserve(100)
        await stage.insert("fresh")
        assert await stage.promote()
        assert await sf.lookup("fresh")
        assert await list_sharded_filters(async_redis, prefix) == {"records": 3}
        assert await sf.drop()
        assert await list_sharded_filters(async_redis, prefix) == {}


def test_cleanup_helper_is_shared(sync_redis: RedisCluster, prefix: str) -> None:
    """devkit/keys.py deletes keys of many slots at once (redis-py splits the DEL)."""
    for i in range(10):
        sync_redis.set(f"{prefix}{{t{i}}}", 1)
    delete_prefixed(sync_redis, prefix)
    assert list(sync_redis.scan_iter(match=f"{prefix}*")) == []
