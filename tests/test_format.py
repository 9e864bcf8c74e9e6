"""The stored format, version 3 (docs/format.md): header fields, what is refused, and why."""

from __future__ import annotations

import io
from collections.abc import Callable

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.exceptions import ResponseError

from guard import (
    FilterCorruptError,
    FilterNotFoundError,
    SyncCuckooFilter,
    SyncShardedCuckooFilter,
    layout,
    scripts,
)
from guard.dump import export_filter
from tests.reference import unpack_table


@pytest.fixture
def cf(sync_redis: redis.Redis, prefix: str) -> SyncCuckooFilter:
    f = SyncCuckooFilter(sync_redis, "fmt", prefix=prefix)
    f.reserve(50, seed=9, fingerprint_bits=8, applied=7, source=2**64 - 1)
    return f


def every_operation(cf: SyncCuckooFilter) -> list[Callable[[], object]]:
    """Each kind of call: scripts, the probe, a fresh handle's lookup, export."""
    fresh = SyncCuckooFilter(cf.redis, cf.name, cf.prefix)
    return [
        lambda: cf.insert("x"),
        lambda: cf.delete("x"),
        lambda: cf.count("x"),
        cf.info,
        cf.applied_change,
        lambda: fresh.lookup("x"),
        lambda: export_filter(cf, io.BytesIO()),
    ]


class TestHeader:
    def test_pack_and_unpack_agree(self) -> None:
        lay = layout.Layout(4, 16, 0, 2, 1, 500, 1000, 12345)
        raw = layout.pack_header(lay, 4000, 0.001, 3, applied=2**53 - 1, source=2**64 - 1)
        assert len(raw) == layout.HEADER_BYTES == 128
        header = layout.unpack_header(raw)
        assert (header.version, header.layout, header.capacity, header.shards) == (
            3, lay, 4000, 3,
        )  # fmt: skip
        assert (header.applied, header.source) == (2**53 - 1, 2**64 - 1)
        assert raw[layout.APPLIED_AT : layout.SOURCE_AT] == (2**53 - 1).to_bytes(8, "big")
        assert raw[layout.RESERVED_AT :] == bytes(layout.HEADER_BYTES - layout.RESERVED_AT)

    def test_the_table_starts_after_the_header(
        self, cf: SyncCuckooFilter, sync_redis: redis.Redis
    ) -> None:
        cf.insert("a")
        lay = cf._layout
        raw = sync_redis.get(cf.key())
        table = unpack_table(raw, lay.buckets(0), lay.bucket_size, lay.fp_bits)
        assert sum(1 for slot in table if slot) == 1
        assert raw[layout.RESERVED_AT : layout.HEADER_BYTES] == bytes(
            layout.HEADER_BYTES - layout.RESERVED_AT
        )
        assert (
            len(raw) == layout.HEADER_BYTES + (lay.buckets(0) * 4 * 8 + 7) // 8 + layout.TAG_BYTES
        )

    def test_growth_leaves_the_watermark_to_subfilter_0(
        self, cf: SyncCuckooFilter, sync_redis: redis.Redis
    ) -> None:
        cf.insert_many([f"k{i}" for i in range(300)])
        assert cf.info().subfilters > 1
        head1 = layout.unpack_header(sync_redis.getrange(cf.key(1), 0, layout.HEADER_BYTES - 1))
        assert (head1.applied, head1.source, head1.subfilter) == (0, 0, 1)
        assert cf.info().applied_change == 7


class TestRefused:
    def test_version_2_is_unsupported(self, cf: SyncCuckooFilter, sync_redis: redis.Redis) -> None:
        sync_redis.setrange(cf.key(), 4, b"\x02")
        for op in every_operation(cf):
            with pytest.raises(FilterCorruptError, match="unsupported format version 2"):
                op()

    @pytest.mark.parametrize("at", [layout.RESERVED_AT, layout.HEADER_BYTES - 1])
    def test_reserved_bytes_must_be_zero(
        self, cf: SyncCuckooFilter, sync_redis: redis.Redis, at: int
    ) -> None:
        sync_redis.setrange(cf.key(), at, b"\x01")
        for op in every_operation(cf):
            with pytest.raises(FilterCorruptError, match="reserved bytes 80-127"):
                op()

    def test_applied_above_2_to_the_53_is_out_of_range(
        self, cf: SyncCuckooFilter, sync_redis: redis.Redis
    ) -> None:
        sync_redis.setrange(cf.key(), layout.APPLIED_AT + 1, b"\x20")  # 2**53
        for op in every_operation(cf):
            with pytest.raises(FilterCorruptError, match="applied"):
                op()

    @pytest.mark.parametrize("at", [layout.APPLIED_AT, layout.SOURCE_AT + 7, layout.RESERVED_AT])
    def test_a_subfilter_holds_no_watermark(
        self, cf: SyncCuckooFilter, sync_redis: redis.Redis, at: int
    ) -> None:
        cf.insert_many([f"k{i}" for i in range(300)])
        sync_redis.setrange(cf.key(1), at, b"\x01")
        for op in every_operation(cf):
            with pytest.raises(FilterCorruptError, match="disagrees with sub-filter 0"):
                op()


# (what, which string, byte offset, byte value), each reduced to the filter at hand.
_DAMAGE = st.tuples(
    st.sampled_from(["header", "subfilter-header", "tag", "truncate", "extend", "retype"]),
    st.integers(0, 31),
    st.integers(0, layout.HEADER_BYTES - 1),
    st.integers(0, 255),
)


class TestCheckersAgree:
    """guard/layout.py:verify_stored and _common.lua's check, given the same damaged bytes,
    find them valid or corrupt alike (the Lua told the stored layout, as a caller that
    probed them would; a missing sub-filter 0 aside, which the scripts leave to the probe)."""

    @settings(
        max_examples=100,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture],
    )
    @given(damages=st.lists(_DAMAGE, min_size=1, max_size=3), by_error_rate=st.booleans())
    def test_same_verdict(
        self,
        sync_redis: redis.Redis,
        prefix: str,
        damages: list[tuple[str, int, int, int]],
        by_error_rate: bool,
    ) -> None:
        cf = SyncCuckooFilter(sync_redis, f"agree{by_error_rate}", prefix=prefix)
        cf.drop()
        sizing = {"error_rate": 0.01} if by_error_rate else {"fingerprint_bits": 8}
        cf.reserve(40, bucket_size=2, seed=4, **sizing)
        cf.insert_many([f"k{i}" for i in range(400)])
        keys = [cf.key(n) for n in range(layout.MAX_SUBFILTERS)]
        count = cf.info().subfilters
        assert count >= 3
        for what, which, at, value in damages:
            key = keys[0 if what == "header" else 1 + which % (count - 1)]
            data = sync_redis.get(key) if sync_redis.type(key) == b"string" else None
            if data is None:
                continue
            if what in ("header", "subfilter-header"):
                sync_redis.setrange(key, at, bytes([value]))
            elif what == "tag":
                sync_redis.setrange(key, len(data) - 1 - at % layout.TAG_BYTES, bytes([value]))
            elif what == "truncate":
                sync_redis.set(key, data[: -(1 + at)])
            elif what == "extend":
                sync_redis.append(key, bytes([value]) * (1 + at % 3))
            else:
                sync_redis.delete(key)
                sync_redis.hset(key, "a", value)
        python_ok = lua_ok = True
        pipe = sync_redis.pipeline()
        for key in keys:
            for command, args in layout.probe_reads(key):
                pipe.execute_command(command, *args)
        replies = pipe.execute(raise_on_error=False)
        try:
            if any(isinstance(r, Exception) for r in replies):  # a key of another type
                raise FilterCorruptError("f", "WRONGTYPE")
            stored = [layout.Stored(key, *replies[3 * n : 3 * n + 3]) for n, key in enumerate(keys)]
            layout.verify_stored("f", stored)
        except FilterCorruptError:
            python_ok = False
        head = replies[0]
        told = layout.unpack_header(head).layout if len(head) == layout.HEADER_BYTES else cf._layout
        try:
            reply = scripts.register(sync_redis)["count"](keys=keys, args=told.args())
            assert reply[0] == scripts.OK, reply  # never STALE: told what is stored
        except ResponseError as exc:
            assert isinstance(scripts.map_error(exc, "f"), FilterCorruptError), exc
            lua_ok = False
        assert python_ok == lua_ok


class TestWhichKeysMakeAFilter:
    """docs/format.md, "Keys": a filter is not found only when none of its sub-filter keys
    exists; any of them left without sub-filter 0 is corruption, never "not found" (which a
    caller may read as "holds nothing")."""

    @pytest.fixture
    def grown(self, cf: SyncCuckooFilter) -> SyncCuckooFilter:
        cf.insert_many([f"k{i}" for i in range(600)])
        assert cf.info().subfilters >= 3
        return cf

    def test_partly_deleted_is_corrupt(
        self, grown: SyncCuckooFilter, sync_redis: redis.Redis
    ) -> None:
        """Sub-filters 0 and 1 deleted, 2 left: every call, cached handle or fresh."""
        sync_redis.delete(grown.key(0), grown.key(1))
        calls = [*every_operation(grown), lambda: grown.lookup("k1"),
                 lambda: grown.lookup_many(["k1", "k2"])]  # fmt: skip
        for call in calls:
            with pytest.raises(FilterCorruptError, match=r"\{fmt\} is missing"):
                call()

    def test_stale_handle_sees_the_keys_it_was_not_given(
        self, cf: SyncCuckooFilter, sync_redis: redis.Redis
    ) -> None:
        """A handle that knows one sub-filter sends one key; sub-filter 2 still counts."""
        other = SyncCuckooFilter(sync_redis, cf.name, prefix=cf.prefix)
        other.insert_many([f"k{i}" for i in range(600)])
        sync_redis.delete(cf.key(0), cf.key(1))
        assert cf._layout.subfilters == 1
        for call in (lambda: cf.count("k1"), lambda: cf.insert("x"), lambda: cf.delete("k1")):
            with pytest.raises(FilterCorruptError, match="is missing"):
                call()

    def test_drop_removes_what_is_left(
        self, grown: SyncCuckooFilter, sync_redis: redis.Redis
    ) -> None:
        sync_redis.delete(grown.key(0), grown.key(1))
        assert grown.drop() is True
        assert not sync_redis.exists(*(grown.key(n) for n in range(layout.MAX_SUBFILTERS)))
        for call in every_operation(grown):
            with pytest.raises(FilterNotFoundError):
                call()
        assert grown.drop() is False

    def test_sharded_partly_deleted_is_corrupt(self, sync_redis: redis.Redis, prefix: str) -> None:
        """Every shard's sub-filters 0 and 1 deleted, one shard's sub-filter 2 left."""
        sharded = SyncShardedCuckooFilter(sync_redis, "sh", prefix, shards=2)
        sharded.reserve(80, fingerprint_bits=8, bucket_size=2)
        sharded.insert_many([f"k{i}" for i in range(1200)])
        left = [i for i in range(2) if sync_redis.exists(sharded.key(i, 2))]
        assert left
        sync_redis.delete(*(sharded.key(i, n) for i in range(2) for n in range(2)))
        fresh = SyncShardedCuckooFilter(sync_redis, "sh", prefix, shards=2)
        for call in (lambda: sharded.lookup("k1"), fresh.info, lambda: fresh.lookup("k1")):
            with pytest.raises(FilterCorruptError, match="missing"):
                call()
