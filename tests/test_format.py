"""The stored format, version 3 (docs/format.md): header fields, what is refused, and why."""

from __future__ import annotations

import hashlib
import io
import math
import re
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.exceptions import ResponseError

from guard import (
    FilterCorruptError,
    FilterNotFoundError,
    InvalidParameterError,
    SyncCuckooFilter,
    SyncShardedCuckooFilter,
    layout,
    scripts,
)
from guard.dump import export_filter, import_filter
from guard.params import FilterParams
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
            reply = scripts.BoundScripts(sync_redis)["count"](keys=keys, args=told.args())
            assert reply[0] == scripts.OK, reply  # never STALE: told what is stored
        except ResponseError as exc:
            assert isinstance(scripts.map_error(exc, "f"), FilterCorruptError), exc
            lua_ok = False
        assert python_ok == lua_ok


def test_every_constant_is_written_into_the_scripts() -> None:
    """A misspelt constant would be a nil global in Lua, failing only where it is used: no
    name of the kinds guard/scripts.py writes in is left in any script."""
    kinds = re.compile(r"\b(?:[A-Z0-9_]+_(?:AT|BYTES|BITS|FLAG|RANGES)|(?:MIN|MAX)_[A-Z0-9_]+)\b")
    for name in scripts.PIECES:
        source = scripts.source(name)
        assert not kinds.findall(source), name
        assert not re.findall(rf"\b(?:{'|'.join(scripts.CONSTANTS)})\b", source), name


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


def _field(header: bytes, at: int, size: int) -> int:
    return int.from_bytes(header[at : at + size], "big")


class TestTheDocument:
    """docs/format.md read as someone writing an independent reader would read it, each
    statement held against the bytes the library stores and what it answers."""

    def test_tag_digest_hashes_the_15_layout_bytes(
        self, cf: SyncCuckooFilter, sync_redis: redis.Redis
    ) -> None:
        """From the header's bytes alone (offsets 4-23), as the tag table says."""
        head = sync_redis.getrange(cf.key(), 0, 127)
        fields = (head[4], head[5], head[6], head[7], head[8], _field(head, 16, 2),
                  _field(head, 12, 4), _field(head, 20, 4))  # fmt: skip
        hashed = struct.pack(">BBBBBHII", *fields)
        assert len(hashed) == 15
        digest = hashlib.blake2b(hashed, digest_size=6).digest()
        assert sync_redis.getrange(cf.key(), -8, -1) == bytes([head[9]]) + digest + b"\xa5"

    def test_subfilter_headers_are_growths_copy(
        self, cf: SyncCuckooFilter, sync_redis: redis.Redis
    ) -> None:
        """Byte 9 of sub-filter n is n, like byte 10; bytes 0-8, 11-31 and 56-63 are
        sub-filter 0's; 40-55 and 64-127 zero; items its own; tag byte 0 is 0x80 + n."""
        cf.insert_many([f"k{i}" for i in range(600)])
        head0 = sync_redis.getrange(cf.key(), 0, 127)
        count = head0[9]
        assert count >= 3 and sync_redis.getrange(cf.key(), -8, -8) == bytes([count])
        digest = sync_redis.getrange(cf.key(), -7, -2)
        items = _field(head0, 32, 8)
        for n in range(1, count):
            head = sync_redis.getrange(cf.key(n), 0, 127)
            assert head[:9] == head0[:9] and head[9] == head[10] == n
            assert head[11:32] == head0[11:32] and head[56:64] == head0[56:64]
            assert head[40:56] == bytes(16) and head[64:] == bytes(64)
            assert sync_redis.getrange(cf.key(n), -8, -1) == bytes([0x80 + n]) + digest + b"\xa5"
            items += _field(head, 32, 8)
        assert items == cf.info().items == 600

    @staticmethod
    def _rewrite(r: redis.Redis, cf: SyncCuckooFilter, at: int, value: bytes, count: int) -> None:
        for n in range(count):
            r.setrange(cf.key(n), at, value)

    def test_capacity_in_range_shows_only_in_info(
        self, cf: SyncCuckooFilter, sync_redis: redis.Redis
    ) -> None:
        """Rewritten in every sub-filter within its range: only info changes. In one copy
        only, or out of range: corrupt."""
        items = [f"k{i}" for i in range(300)]
        cf.insert_many(items)
        count = cf.info().subfilters
        assert count >= 2
        self._rewrite(sync_redis, cf, 24, (2000).to_bytes(8, "big"), count)
        fresh = SyncCuckooFilter(sync_redis, cf.name, prefix=cf.prefix)
        assert fresh.info().capacity == 2000
        assert all(fresh.lookup_many(items)) and fresh.count("k1") >= 1
        assert fresh.insert("new") and fresh.lookup("new")
        sync_redis.setrange(cf.key(0), 24, (3000).to_bytes(8, "big"))
        for op in every_operation(cf):
            with pytest.raises(FilterCorruptError, match="disagrees with sub-filter 0"):
                op()
        self._rewrite(sync_redis, cf, 24, bytes(8), count)
        for op in every_operation(cf):
            with pytest.raises(FilterCorruptError, match="capacity 0 is out of range"):
                op()

    def test_shards_of_an_unsharded_filter_is_only_range_checked(
        self, cf: SyncCuckooFilter, sync_redis: redis.Redis, tmp_path: Path
    ) -> None:
        items = [f"k{i}" for i in range(300)]
        cf.insert_many(items)
        count = cf.info().subfilters
        self._rewrite(sync_redis, cf, 18, (5).to_bytes(2, "big"), count)
        fresh = SyncCuckooFilter(sync_redis, cf.name, prefix=cf.prefix)
        assert all(fresh.lookup_many(items)) and fresh.insert("new") and fresh.info().items == 301
        with (tmp_path / "d").open("wb") as out:
            export_filter(fresh, out)
        copy = SyncCuckooFilter(sync_redis, "copy", prefix=cf.prefix)
        import_filter(copy, tmp_path / "d")
        assert all(copy.lookup_many(items))
        self._rewrite(sync_redis, cf, 18, (1025).to_bytes(2, "big"), count)
        for op in every_operation(cf):
            with pytest.raises(FilterCorruptError, match="shards 1025 is out of range"):
                op()

    @pytest.mark.parametrize(
        ("rate", "stored"),
        [(4.665e-10, 466), (4.675e-10, 468), (4.865e-10, 486), (0.01, 10**10)],
    )
    def test_error_rate_is_rounded_half_to_even(
        self, sync_redis: redis.Redis, prefix: str, rate: float, stored: int
    ) -> None:
        """The double product, ties to even: 466.5 -> 466, 467.5 -> 468, 486.5 -> 486."""
        f = SyncCuckooFilter(sync_redis, "rate", prefix=prefix)
        f.reserve(100, error_rate=rate, bucket_size=1, expansion=0)
        assert _field(sync_redis.getrange(f.key(), 0, 127), 56, 8) == stored
        assert f.info().target_error_rate == stored / 10**12

    @staticmethod
    def _documented_m0(capacity: int, b: int, f: int) -> int:
        """docs/format.md, "Sizing", line by line."""
        load = {1: 0.42, 2: 0.83, 4: 0.94, 8: 0.97}[b]
        small = {1: 0.35, 2: 0.72, 4: 0.88, 8: 0.93}[b]
        need = math.ceil(capacity / (b * load))
        if need * b < 4096:
            need = math.ceil(capacity / (b * small))
        size = 128 + math.ceil(need * b * f / 8) + 8
        sds = 6 if size < 65536 else 10
        n = size + sds
        if n <= 64:
            size_class = max(8, -(-n // 8) * 8)
        else:
            k = next(k for k in range(64) if 2**k < n <= 2 ** (k + 1))
            size_class = -(-n // 2 ** (k - 2)) * 2 ** (k - 2)
        return max(need, (size_class - sds - 136) * 8 // (b * f))

    def test_m0_is_the_documented_size_class(self, sync_redis: redis.Redis, prefix: str) -> None:
        capacities = [1, 2, 3, 10, 57, 100, 1000, 4095, 4096, 5000, 30_000, 65_536, 10**6, 10**8]
        for capacity in capacities:
            for b in layout.BUCKET_SIZES:
                for f in (4, 7, 8, 12, 16, 32):
                    params = FilterParams(capacity=capacity, bucket_size=b, fingerprint_bits=f)
                    m0 = self._documented_m0(capacity, b, f)
                    if 128 + math.ceil(m0 * b * f / 8) + 8 > 512 * 2**20:
                        with pytest.raises(InvalidParameterError, match="512 MB"):
                            params.layout()
                    else:
                        assert params.layout().buckets0 == m0, (capacity, b, f)
        f = SyncCuckooFilter(sync_redis, "sized", prefix=prefix)
        f.reserve(12345, bucket_size=4, fingerprint_bits=12)
        m0 = self._documented_m0(12345, 4, 12)
        assert sync_redis.strlen(f.key()) == 128 + math.ceil(m0 * 4 * 12 / 8) + 8

    @pytest.mark.parametrize("b", layout.BUCKET_SIZES)
    @pytest.mark.parametrize("expansion", [0, 2])
    def test_f0_is_the_documented_width(self, b: int, expansion: int) -> None:
        for rate in (0.5, 0.1, 0.01, 1e-3, 1.23e-5, 1e-8):
            lay = FilterParams(capacity=1000, error_rate=rate, bucket_size=b,
                               expansion=expansion).layout()  # fmt: skip
            growing = 1 if expansion else 0
            assert lay.fp_bits == max(4, math.ceil(math.log2(2 * b) - math.log2(rate) + growing))
            assert lay.fp_step == growing

    def test_keys_beyond_the_count_are_not_read(
        self, cf: SyncCuckooFilter, sync_redis: redis.Redis
    ) -> None:
        """Leftovers at sub-filters 1 and 3 of a one-sub-filter filter: ignored, then
        replaced by growth."""
        sync_redis.set(cf.key(1), b"junk")
        sync_redis.hset(cf.key(3), "a", 1)
        items = [f"k{i}" for i in range(600)]
        fresh = SyncCuckooFilter(sync_redis, cf.name, prefix=cf.prefix)
        assert fresh.info().subfilters == 1 and not fresh.lookup("k1")
        assert all(fresh.insert_many(items)) and fresh.info().subfilters >= 4
        assert all(SyncCuckooFilter(sync_redis, cf.name, prefix=cf.prefix).lookup_many(items))

    def test_staging_keys_alone_are_no_filter(self, sync_redis: redis.Redis, prefix: str) -> None:
        live = SyncCuckooFilter(sync_redis, "staged", prefix=prefix)
        live.staging().reserve(100)
        for call in (lambda: live.lookup("x"), live.info, lambda: live.insert("x")):
            with pytest.raises(FilterNotFoundError):
                call()
