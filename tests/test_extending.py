"""docs/extending.md's steps for adding an operation, taken at run time for a toy one.

The toy operation, ``string_bytes()``, answers how many bytes the filter's strings take (what
``info().memory_bytes`` computes from the layout), read by a Lua script of its own that
checks the caller's layout as the library's scripts do. Each numbered step below is the step
of the same number in docs/extending.md, done to the very class or registry the step names,
from here instead of in the package's files (monkeypatch puts the classes back after each
test); then the operation runs on every kind of handle the steps say it reaches.
"""

from __future__ import annotations

from typing import Any, Protocol

import pytest
import redis
import redis.asyncio as aioredis

from guard import (
    CuckooFilter,
    ShardedCuckooFilter,
    SyncCuckooFilter,
    SyncShardedCuckooFilter,
    scripts,
)
from guard.facade import Facade, operation
from guard.filter import FilterOps
from guard.handle import FilterHandle
from guard.ops import MAX_RETRIES, Call, Op, Round
from guard.sharded import ShardedOps

# 1. The Lua script (in the package: guard/lua/string_bytes.lua). _common.lua gives it the
#    caller's layout in L, check_layout() and the reply codes.
STRING_BYTES_LUA = """
-- string_bytes.lua: the bytes the filter's sub-filter strings take.
-- KEYS: sub-filters 0..subfilters-1.  ARGV: layout (9).
-- Reply: {OK, subfilters, bytes}; or {STALE, layout...}.
local err = check_layout()
if err then return err end
local total = 0
for n = 1, L.nsub do total = total + redis.call('STRLEN', KEYS[n]) end
return {OK, L.nsub, total}
"""

# 2. The script-name constant (in the package: guard/scripts.py, beside INSERT and the rest).
STRING_BYTES = scripts.define("test_string_bytes", "_common", text=STRING_BYTES_LUA)


# 3. The operation, for each kind of filter (in the package: methods of FilterOps in
#    guard/filter.py and of ShardedOps in guard/sharded.py).
def _string_bytes_op(self: FilterOps) -> Op[int]:
    for _ in range(MAX_RETRIES):
        layout = yield from self._known_layout()
        keys = self._keys(layout.subfilters)
        (reply,) = yield Round([Call(STRING_BYTES, keys, layout.args())])
        if not self._adopt(reply):  # else STALE: the layout changed, probe and send again
            return int(reply[2])
    raise self._kept_changing("during string_bytes")


def _sharded_string_bytes_op(self: ShardedOps) -> Op[int]:
    yield from self._open_op()  # every shard there, with this handle's shard count
    return sum((yield from self._fan(h._string_bytes_op() for h in self._handles)))


# 4. The contract (in the package: a method of FilterHandle in guard/handle.py, for mypy).
class StringBytesHandle(FilterHandle[Any], Protocol):
    def _string_bytes_op(self) -> Op[int]: ...


# 5. The one declaration of the public operation (in the package: a method of Facade in
#    guard/facade.py).
def string_bytes(self: StringBytesHandle) -> Op[int]:
    """The bytes the filter's strings take in Redis."""
    return self._string_bytes_op()


@pytest.fixture(autouse=True)
def toy_operation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps 3 and 5 on the package's own classes, for the length of one test. (Step 4 is
    for mypy, which checks the package, not these tests.)"""
    monkeypatch.setattr(FilterOps, "_string_bytes_op", _string_bytes_op, raising=False)
    monkeypatch.setattr(ShardedOps, "_string_bytes_op", _sharded_string_bytes_op, raising=False)
    monkeypatch.setattr(Facade, "string_bytes", operation(string_bytes), raising=False)


# 6. Tests: every handle the steps reach, on a real Redis and on fakeredis.


class TestSync:
    def test_a_filter_answers_what_its_info_computes(
        self, sync_redis: redis.Redis, prefix: str
    ) -> None:
        cf = SyncCuckooFilter(sync_redis, "toy", prefix=prefix)
        info = cf.reserve(1000, fingerprint_bits=12)
        assert cf.string_bytes() == info.memory_bytes

    def test_a_grown_filter_counts_every_sub_filter(
        self, sync_redis: redis.Redis, prefix: str
    ) -> None:
        cf = SyncCuckooFilter(sync_redis, "toy", prefix=prefix)
        cf.reserve(64, bucket_size=2, expansion=2)
        cf.insert_many([f"k{i}" for i in range(400)])
        info = cf.info()
        assert info.subfilters > 1
        assert cf.string_bytes() == info.memory_bytes

    def test_a_stale_layout_is_probed_again(self, sync_redis: redis.Redis, prefix: str) -> None:
        """The script answers STALE to a handle whose layout is not the stored one; the
        operation probes the filter and sends again."""
        cf = SyncCuckooFilter(sync_redis, "toy", prefix=prefix)
        cf.reserve(1000)
        assert cf.string_bytes() == cf.info().memory_bytes
        other = SyncCuckooFilter(sync_redis, "toy", prefix=prefix)
        other.drop()
        bigger = other.reserve(50_000)
        assert cf.string_bytes() == bigger.memory_bytes

    def test_a_sharded_filter_adds_up_its_shards(
        self, sync_redis: redis.Redis, prefix: str
    ) -> None:
        sf = SyncShardedCuckooFilter(sync_redis, "toy", prefix=prefix, shards=3)
        info = sf.reserve(3000)
        assert sf.string_bytes() == info.memory_bytes

    def test_pipelines_queue_it(self, sync_redis: redis.Redis, prefix: str) -> None:
        cf = SyncCuckooFilter(sync_redis, "toy", prefix=prefix)
        sf = SyncShardedCuckooFilter(sync_redis, "wide", prefix=prefix, shards=2)
        plain, sharded = cf.reserve(1000).memory_bytes, sf.reserve(2000).memory_bytes
        for handle, expected in ((cf, plain), (sf, sharded)):
            pipe = handle.pipeline()
            pipe.insert("a")
            pipe.string_bytes()
            assert pipe.execute() == [True, expected]


class TestAsync:
    async def test_a_filter_and_a_sharded_one(
        self, async_redis: aioredis.Redis, prefix: str
    ) -> None:
        cf = CuckooFilter(async_redis, "toy", prefix=prefix)
        sf = ShardedCuckooFilter(async_redis, "wide", prefix=prefix, shards=3)
        plain, sharded = await cf.reserve(1000), await sf.reserve(3000)
        assert await cf.string_bytes() == plain.memory_bytes
        assert await sf.string_bytes() == sharded.memory_bytes

    async def test_pipelines_queue_it(self, async_redis: aioredis.Redis, prefix: str) -> None:
        cf = CuckooFilter(async_redis, "toy", prefix=prefix)
        sf = ShardedCuckooFilter(async_redis, "wide", prefix=prefix, shards=2)
        plain, sharded = (
            (await cf.reserve(1000)).memory_bytes,
            (await sf.reserve(2000)).memory_bytes,
        )
        for handle, expected in ((cf, plain), (sf, sharded)):
            pipe = handle.pipeline()
            pipe.string_bytes()
            pipe.lookup("a")
            assert await pipe.execute() == [expected, False]


def test_a_script_name_is_defined_once() -> None:
    with pytest.raises(ValueError, match="already defined"):
        scripts.define(STRING_BYTES, "_common", text=STRING_BYTES_LUA)
