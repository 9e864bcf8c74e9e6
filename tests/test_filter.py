"""The filter's public behaviour, on a real Redis and on fakeredis."""

from __future__ import annotations

import pytest
import redis

from guard import (
    FilterCorruptError,
    FilterExistsError,
    FilterFullError,
    FilterNotFoundError,
    InvalidParameterError,
    SyncCuckooFilter,
    hashing,
    list_filters_sync,
    ops,
    scripts,
)
from guard.layout import MAX_STRING_BYTES
from tests.reference import ReferenceFilter, unpack_table


def items(n: int, tag: str = "k") -> list[str]:
    return [f"{tag}{i}" for i in range(n)]


@pytest.fixture
def cf(sync_redis: redis.Redis, prefix: str) -> SyncCuckooFilter:
    return SyncCuckooFilter(sync_redis, "users", prefix=prefix)


class TestReserve:
    def test_reserve_creates_one_string_with_hash_tag(
        self, cf: SyncCuckooFilter, sync_redis: redis.Redis, prefix: str
    ) -> None:
        info = cf.reserve(10_000, fingerprint_bits=12, bucket_size=4, max_kicks=300, expansion=0)
        assert cf.key() == f"{prefix}{{users}}"
        assert sync_redis.type(cf.key()) == b"string"
        assert (info.capacity, info.fingerprint_bits, info.bucket_size) == (10_000, 12, 4)
        assert (info.max_kicks, info.expansion, info.subfilters, info.items) == (300, 0, 1, 0)
        assert sync_redis.strlen(cf.key()) == info.memory_bytes

    def test_reserve_twice_raises_exists(self, cf: SyncCuckooFilter) -> None:
        cf.reserve(100)
        with pytest.raises(FilterExistsError):
            cf.reserve(100)

    def test_bucket_count_is_not_a_power_of_two(self, cf: SyncCuckooFilter) -> None:
        info = cf.reserve(100_000, bucket_size=4, fingerprint_bits=16, expansion=0)
        assert info.buckets & (info.buckets - 1) != 0
        # Memory follows capacity: no 2x rounding (near f / 0.95 bits per item).
        assert 8 * info.memory_bytes / 100_000 < 1.3 * 16 / 0.95

    def test_error_rate_picks_fingerprint_width(
        self, cf: SyncCuckooFilter, sync_redis: redis.Redis, prefix: str
    ) -> None:
        fixed = cf.reserve(1000, error_rate=0.001, expansion=0)
        growing = SyncCuckooFilter(sync_redis, "g", prefix=prefix).reserve(1000, error_rate=0.001)
        # 2b / 2^f <= eps for one table; a growing one keeps one bit in reserve for the series.
        assert fixed.fingerprint_bits == 13
        assert growing.fingerprint_bits == 14
        assert fixed.target_error_rate == pytest.approx(0.001)

    @pytest.mark.parametrize(
        ("params", "message"),
        [
            ({"capacity": 0}, "capacity must be an integer from 1"),
            ({"capacity": 10, "bucket_size": 3}, "bucket_size must be one of"),
            (
                {"capacity": 10, "fingerprint_bits": 40},
                "fingerprint_bits must be an integer from 4 to 32",
            ),
            ({"capacity": 10, "fingerprint_bits": 3}, "fingerprint_bits"),
            ({"capacity": 10, "max_kicks": -1}, "max_kicks"),
            ({"capacity": 10, "expansion": 99}, "expansion must be an integer from 0 to 16"),
            ({"capacity": 10, "error_rate": 0}, "error_rate must be between 0 and 1"),
            ({"capacity": 10, "error_rate": 1e-12}, "needs 44-bit fingerprints"),
            ({"capacity": 10, "error_rate": 5e-324}, "needs 1078-bit fingerprints"),
            ({"capacity": 10, "error_rate": 0.01, "fingerprint_bits": 8}, "not both"),
            ({"capacity": MAX_STRING_BYTES * 2}, "512 MB"),
            (
                {"capacity": 10, "bucket_sise": 2, "expansoin": 0},
                "unknown reserve option\\(s\\) bucket_sise, expansoin; it accepts error_rate",
            ),
        ],
    )
    def test_bad_parameters_raise_before_any_write(
        self, cf: SyncCuckooFilter, sync_redis: redis.Redis, params: dict, message: str
    ) -> None:
        params = dict(params)
        capacity = params.pop("capacity")
        with pytest.raises(InvalidParameterError, match=message):
            cf.reserve(capacity, **params)
        assert not sync_redis.exists(cf.key())

    @pytest.mark.parametrize("name", ["", "a" * 65, "a b", "x{y}", "a:b", "*", "-lead", "é", "a\n"])
    def test_bad_names_are_refused(self, sync_redis: redis.Redis, name: str) -> None:
        with pytest.raises(InvalidParameterError, match="filter name must match"):
            SyncCuckooFilter(sync_redis, name)


class TestItems:
    def test_insert_lookup_delete(self, cf: SyncCuckooFilter) -> None:
        cf.reserve(1000)
        assert cf.insert("alice") is True
        assert cf.lookup("alice") is True
        assert cf.lookup("bob") is False
        assert cf.delete("alice") is True
        assert cf.lookup("alice") is False
        assert cf.delete("alice") is False

    def test_str_and_bytes_are_the_same_item(self, cf: SyncCuckooFilter) -> None:
        cf.reserve(100)
        cf.insert("zoë")
        assert cf.lookup("zoë".encode())

    def test_other_item_types_are_refused(self, cf: SyncCuckooFilter) -> None:
        cf.reserve(100)
        with pytest.raises(TypeError, match="str or bytes"):
            cf.insert(42)  # type: ignore[arg-type]

    def test_duplicates_are_counted(self, cf: SyncCuckooFilter) -> None:
        cf.reserve(1000)
        for _ in range(3):
            cf.insert("dup")
        assert cf.count("dup") == 3
        cf.delete("dup")
        assert cf.count("dup") == 2
        assert cf.info().items == 2

    def test_fixed_filter_holds_2b_copies_of_one_item(self, cf: SyncCuckooFilter) -> None:
        cf.reserve(1000, bucket_size=2, expansion=0, max_kicks=50)
        assert all(cf.insert("same") for _ in range(4))
        with pytest.raises(FilterFullError):
            cf.insert("same")
        assert cf.count("same") == 4

    def test_insert_unique_skips_present_items(self, cf: SyncCuckooFilter) -> None:
        cf.reserve(1000)
        assert cf.insert_unique("a") is True
        assert cf.insert_unique("a") is False
        assert cf.count("a") == 1
        assert cf.insert_many(["a", "b", "b"], unique=True) == [False, True, False]

    def test_batches_match_single_calls(self, cf: SyncCuckooFilter) -> None:
        cf.reserve(5000)
        present = items(2500)
        assert all(cf.insert_many(present))
        probe = present[::7] + items(300, "absent")
        assert cf.lookup_many(probe) == [cf.lookup(x) for x in probe]
        assert cf.delete_many(present[:1200]) == [True] * 1200
        # Deleted items now read absent, but for the rare fingerprint twins (FPR ~ 1e-4 here).
        assert sum(cf.lookup_many(present[:1200])) <= 3
        assert all(cf.lookup_many(present[1200:]))
        assert cf.info().items == 1300

    def test_empty_batches(self, cf: SyncCuckooFilter) -> None:
        cf.reserve(10)
        assert cf.insert_many([]) == []
        assert cf.lookup_many([]) == []
        assert cf.delete_many([]) == []

    def test_missed_deletes_are_counted(self, cf: SyncCuckooFilter) -> None:
        cf.reserve(100)
        cf.insert("x")
        cf.delete_many(["x", "never", "seen"])
        info = cf.info()
        assert (info.deletes, info.missed_deletes, info.items) == (1, 2, 0)


class TestWorkLimit:
    """One script call does a bounded amount of work (guard/ops.py: KICK_BUDGET)."""

    def test_a_call_takes_what_fits_and_the_client_sends_the_rest(
        self, cf: SyncCuckooFilter, sync_redis: redis.Redis
    ) -> None:
        cf.reserve(20_000, max_kicks=500, seed=5)
        batch = items(400)
        lay = cf._layout
        flat = hashing.flat(hashing.hash_batch([x.encode() for x in batch], lay.seed))
        insert = scripts.BoundScripts(sync_redis)["insert"]
        reply = insert(keys=[cf.key(0)], args=[*lay.args(), 0, *flat])
        # Nearly empty: no item kicks, so the call takes exactly what its budget allows.
        taken = (ops.KICK_BUDGET - lay.max_kicks) // ops.ITEM_WORK  # max_kicks <= RESERVE_MAX
        assert reply[:2] == [scripts.OK, 1] and reply[2:] == [1] * taken
        assert cf.info().items == taken
        # The library sends the rest again, call after call; the table is the reference's.
        assert all(cf.insert_many(batch[taken:]))
        ref = ReferenceFilter(lay)
        assert all(ref.insert(x) for x in batch)
        stored = sync_redis.get(cf.key(0))
        assert stored is not None
        table = unpack_table(stored, lay.buckets0, lay.bucket_size, lay.fp_bits)
        assert table == ref.tables[0]

    def test_long_chains_still_go_in_batches(
        self, cf: SyncCuckooFilter, sync_redis: redis.Redis
    ) -> None:
        """max_kicks past half the budget: a call reserves half the budget for the next item's
        chain, not all of max_kicks (which would be one item a call, even into an empty
        filter)."""
        cf.reserve(20_000, max_kicks=4000, seed=9)
        batch = items(400)
        lay = cf._layout
        flat = hashing.flat(hashing.hash_batch([x.encode() for x in batch], lay.seed))
        reply = scripts.BoundScripts(sync_redis)["insert"](
            keys=[cf.key(0)], args=[*lay.args(), 0, *flat]
        )
        taken = (ops.KICK_BUDGET - ops.RESERVE_MAX) // ops.ITEM_WORK
        assert taken > 1 and reply[2:] == [1] * taken
        assert ops.insert_chunk(lay.max_kicks) == taken
        assert all(cf.insert_many(batch[taken:]))
        assert all(cf.lookup_many(batch)) and cf.info().items == len(batch)


class TestFullAndGrowth:
    @pytest.mark.parametrize("bucket_size", [1, 2, 4, 8])
    def test_fill_to_failure_loses_nothing(self, cf: SyncCuckooFilter, bucket_size: int) -> None:
        cf.reserve(2000, bucket_size=bucket_size, expansion=0, seed=7)
        candidates = items(6000)
        with pytest.raises(FilterFullError) as raised:
            cf.insert_many(candidates)
        added = [x for x, ok in zip(candidates, raised.value.results, strict=True) if ok]
        first_failure = len(added)
        assert raised.value.results[:first_failure] == [True] * first_failure
        assert not any(raised.value.results[first_failure:])
        # The failed insert undid its kick chain: every item added before it is still there.
        assert all(cf.lookup_many(added))
        assert cf.info().items == first_failure
        # And the filter keeps working after the failure: delete one, the next insert fits.
        assert cf.delete(added[0])
        assert cf.insert(added[0])
        assert all(cf.lookup_many(added))

    def test_fixed_filter_fits_its_capacity(self, cf: SyncCuckooFilter) -> None:
        cf.reserve(20_000, expansion=0, seed=11)
        assert all(cf.insert_many(items(20_000)))

    def test_growth_adds_subfilters_and_finds_everything(
        self, cf: SyncCuckooFilter, sync_redis: redis.Redis
    ) -> None:
        cf.reserve(500, expansion=2, error_rate=0.01)
        data = items(8000)
        assert all(cf.insert_many(data))
        info = cf.info()
        assert info.subfilters >= 4
        assert info.items == 8000
        assert all(cf.lookup_many(data))
        # The scripts wrote each tag (sub-filter 0's count byte rewritten at every growth);
        # the library predicts them from the layout: the two must agree byte for byte.
        layout = cf._layout
        assert layout.subfilters == info.subfilters
        for n in range(info.subfilters):
            assert sync_redis.getrange(cf.key(n), -8, -1) == layout.tag(n)
        # Each new sub-filter gets one more fingerprint bit: the series keeps the total bounded.
        assert info.error_rate < 0.01

    def test_growth_from_a_second_handle_is_seen(
        self, sync_redis: redis.Redis, prefix: str
    ) -> None:
        a = SyncCuckooFilter(sync_redis, "shared", prefix=prefix)
        b = SyncCuckooFilter(sync_redis, "shared", prefix=prefix)
        a.reserve(100, expansion=1)
        assert b.lookup("nothing") is False  # b now caches a one-sub-filter layout
        a.insert_many(items(1000))
        # b's cached layout is stale; the tag it reads makes it refresh, not miss.
        assert all(b.lookup_many(items(1000)))

    def test_deleting_after_growth_keeps_other_items(self, cf: SyncCuckooFilter) -> None:
        cf.reserve(200, expansion=2, fingerprint_bits=8)
        data = items(3000)
        cf.insert_many(data)
        doomed, kept = data[::2], data[1::2]
        assert all(cf.delete_many(doomed))
        assert all(cf.lookup_many(kept))

    def test_growth_limit_raises_full(self, cf: SyncCuckooFilter) -> None:
        # error_rate sizing adds a bit per sub-filter; 31 + 1 = 32 bits is the last one.
        cf.reserve(10, error_rate=2 * 4 * 2 / 2**31, bucket_size=4, expansion=1)
        assert cf.info().fingerprint_bits == 31
        with pytest.raises(FilterFullError):
            cf.insert_many(items(500))
        assert cf.info().subfilters == 2


class TestMissingAndBroken:
    @pytest.mark.parametrize(
        "op",
        [
            lambda f: f.insert("x"),
            lambda f: f.lookup("x"),
            lambda f: f.lookup_many(["x", "y"]),
            lambda f: f.delete("x"),
            lambda f: f.count("x"),
            lambda f: f.info(),
        ],
    )
    def test_missing_filter_is_an_error_not_absent(self, cf: SyncCuckooFilter, op) -> None:
        with pytest.raises(FilterNotFoundError):
            op(cf)

    def test_dropped_filter_is_not_absent_and_not_recreated(
        self, cf: SyncCuckooFilter, sync_redis: redis.Redis
    ) -> None:
        cf.reserve(100)
        cf.insert("x")
        assert cf.drop() is True
        assert cf.drop() is False
        with pytest.raises(FilterNotFoundError):
            cf.lookup("x")
        with pytest.raises(FilterNotFoundError):
            cf.insert("x")
        assert not sync_redis.exists(cf.key())

    def test_truncated_string_is_corrupt(
        self, cf: SyncCuckooFilter, sync_redis: redis.Redis
    ) -> None:
        cf.reserve(1000)
        cf.insert("x")
        data = sync_redis.get(cf.key())
        sync_redis.set(cf.key(), data[:-10])
        with pytest.raises(FilterCorruptError, match="truncated"):
            cf.lookup("x")

    def test_overwritten_header_is_corrupt(
        self, cf: SyncCuckooFilter, sync_redis: redis.Redis
    ) -> None:
        cf.reserve(1000)
        sync_redis.setrange(cf.key(), 0, b"JUNK")
        # Scripts check the header; a lookup checks the tag, and the table it reads is intact.
        with pytest.raises(FilterCorruptError, match="bad magic"):
            cf.insert("x")
        with pytest.raises(FilterCorruptError, match="bad magic"):
            cf.info()

    @pytest.mark.parametrize("byte", [0, 3, 7])  # sub-filter count, digest, trailer
    def test_overwritten_tag_is_corrupt(
        self, cf: SyncCuckooFilter, sync_redis: redis.Redis, byte: int
    ) -> None:
        cf.reserve(1000)
        cf.insert("x")
        end = sync_redis.strlen(cf.key())
        at = end - 8 + byte
        sync_redis.setrange(cf.key(), at, bytes([sync_redis.getrange(cf.key(), at, at)[0] ^ 1]))
        # Lookups read only the tag; the scripts check it with the header.
        for op in (cf.lookup, cf.insert, cf.delete):
            with pytest.raises(FilterCorruptError, match=r"bad tag|truncated"):
                op("x")

    def test_wrong_type_is_corrupt(self, cf: SyncCuckooFilter, sync_redis: redis.Redis) -> None:
        sync_redis.hset(cf.key(), "a", 1)
        with pytest.raises(FilterCorruptError, match="another type"):
            cf.lookup("x")

    def test_missing_subfilter_is_corrupt(
        self, cf: SyncCuckooFilter, sync_redis: redis.Redis
    ) -> None:
        cf.reserve(50, expansion=2)
        cf.insert_many(items(500))
        sync_redis.delete(cf.key(1))
        with pytest.raises(FilterCorruptError):
            cf.lookup("k1")

    def test_recreated_with_other_params_is_followed(
        self, sync_redis: redis.Redis, prefix: str
    ) -> None:
        a = SyncCuckooFilter(sync_redis, "re", prefix=prefix)
        b = SyncCuckooFilter(sync_redis, "re", prefix=prefix)
        a.reserve(1000, fingerprint_bits=16)
        b.insert("x")
        a.drop()
        a.reserve(5000, fingerprint_bits=8, bucket_size=2)
        a.insert("y")
        # b's cached layout is wrong for the new filter; reading with it would be garbage.
        assert b.lookup("y") is True
        assert b.info().fingerprint_bits == 8


class TestScriptsAndListing:
    def test_script_flush_is_invisible(self, cf: SyncCuckooFilter, sync_redis: redis.Redis) -> None:
        cf.reserve(1000)
        cf.insert("x")
        sync_redis.script_flush()
        assert cf.lookup("x") is True
        sync_redis.script_flush()
        assert cf.lookup_many(["x", "y"]) == [True, False]  # the pipelined path too
        sync_redis.script_flush()
        assert cf.insert("y") is True

    def test_list_filters(self, sync_redis: redis.Redis, prefix: str) -> None:
        for name in ("b", "a.1", "c_2"):
            f = SyncCuckooFilter(sync_redis, name, prefix=prefix)
            f.reserve(50, expansion=2)
            f.insert_many(items(300))  # sub-filter keys must not be listed as filters
        SyncCuckooFilter(sync_redis, "b", prefix=prefix).staging().reserve(10)
        assert list_filters_sync(sync_redis, prefix) == ["a.1", "b", "c_2"]

    def test_staging_promote_replaces_atomically(
        self, cf: SyncCuckooFilter, sync_redis: redis.Redis
    ) -> None:
        cf.reserve(50, expansion=2)
        cf.insert_many(items(400, "old"))
        stage = cf.staging()
        stage.reserve(1000, expansion=0)
        stage.insert_many(items(500, "new"))
        assert stage.promote() is True
        assert all(cf.lookup_many(items(500, "new")))
        info = cf.info()
        assert (info.subfilters, info.items, info.expansion) == (1, 500, 0)
        assert not sync_redis.exists(cf.key(1))
        assert not stage.exists()
        with pytest.raises(FilterNotFoundError):
            stage.promote()


class TestReadWidths:
    """Lookups read whole buckets in as few 64-bit-or-narrower reads as hold their slots."""

    @pytest.mark.parametrize(
        ("bucket_size", "bits"),
        [(1, 32), (2, 32), (4, 16), (8, 16), (8, 32), (4, 13), (2, 17), (4, 5), (8, 8)],
    )
    def test_lookups_agree_with_the_reference(
        self, cf: SyncCuckooFilter, bucket_size: int, bits: int
    ) -> None:
        from tests.reference import ReferenceFilter

        cf.reserve(400, bucket_size=bucket_size, fingerprint_bits=bits, expansion=2, seed=5)
        present = items(900)
        assert all(cf.insert_many(present))
        ref = ReferenceFilter(cf._layout)
        for x in present:
            ref.insert(x)
        probe = present + items(3000, "absent")
        assert cf.lookup_many(probe) == [ref.lookup(x) for x in probe]
        assert all(cf.lookup_many(present))
