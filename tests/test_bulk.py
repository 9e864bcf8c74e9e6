"""The bulk builder (guard/bulk.py): what it writes is a filter the scripts could have made.

Every build is checked on the stored bytes: each fingerprint sits in one of its item's two
buckets, the stored multiset is exactly the items' (duplicates included), lookups find every
item, the headers verify and count right; then the scripts change the result exactly as the
pure-Python twin (tests/reference.py) changes the same tables. Real Redis and fakeredis.
"""

from __future__ import annotations

import itertools
import random
import threading
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from functools import partial
from typing import Any

import fakeredis
import numpy as np
import pytest
import redis
import redis.asyncio as aioredis
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from devkit.redis_server import RedisProcess
from guard import (
    Change,
    CuckooFilter,
    FilterCorruptError,
    FilterExistsError,
    FilterFullError,
    FilterParams,
    InvalidParameterError,
    ShardedCuckooFilter,
    SyncCuckooFilter,
    SyncShardedCuckooFilter,
    bulk,
    hashing,
    layout,
)
from guard.layout import Layout
from tests.reference import ReferenceFilter, unpack_table

Signature = tuple[int, int, int, int]  # sub-filter, fingerprint, lower bucket, higher bucket


def stored_strings(client: Any, key: Callable[[int], str]) -> list[bytes]:
    """Every sub-filter string of the filter whose sub-filter n is ``key(n)``."""
    first = client.get(key(0))
    count = layout.unpack_header(first).layout.subfilters
    return [first, *(client.get(key(n)) for n in range(1, count))]


def stored_layout(client: Any, key: Callable[[int], str]) -> Layout:
    return layout.unpack_header(client.get(key(0))).layout


def tables(strings: list[bytes], lay: Layout) -> list[list[int]]:
    return [
        unpack_table(s, lay.buckets(n), lay.bucket_size, lay.fp_bits_at(n))
        for n, s in enumerate(strings)
    ]


def slot_signatures(slots: list[list[int]], lay: Layout) -> list[Counter[Signature]]:
    """Per sub-filter, what its stored fingerprints say about their items: a fingerprint and
    the bucket holding it fix the other bucket, so each names one (fingerprint, pair)."""
    out = []
    for n, table in enumerate(slots):
        m, shift, found = lay.buckets(n), lay.fp_bits_at(n) - lay.fp_bits, Counter[Signature]()
        for k, fp in enumerate(table):
            if fp:
                i = k // lay.bucket_size
                j = hashing.alt_bucket(i, fp >> shift, m)
                found[n, fp, min(i, j), max(i, j)] += 1
        out.append(found)
    return out


def item_signature(item: str, lay: Layout, n: int) -> Signature:
    h, g = hashing.item_hash(item, lay.seed)
    g = hashing.fix_g(g, lay.fp_bits)
    m = lay.buckets(n)
    i1 = h % m
    i2 = hashing.alt_bucket(i1, hashing.fingerprint(g, lay.fp_bits), m)
    return n, hashing.fingerprint(g, lay.fp_bits_at(n)), min(i1, i2), max(i1, i2)


def assert_holds_exactly(slots: list[list[int]], lay: Layout, items: list[str]) -> None:
    """The stored fingerprints are the items', each in one of its own two buckets, every
    item once per occurrence, nothing else.

    Matched newest sub-filter first: items with one signature in sub-filter n have the same
    one in every older sub-filter (sizes divide, fingerprints are prefixes), so which of
    them a stored fingerprint is taken for does not matter.
    """
    left = Counter(items)
    for n, found in reversed(list(enumerate(slot_signatures(slots, lay)))):
        by_signature: dict[Signature, list[str]] = {}
        for item in left:
            by_signature.setdefault(item_signature(item, lay, n), []).append(item)
        for signature, count in found.items():
            for item in by_signature.get(signature, []):
                take = min(count, left[item])
                left[item] -= take
                count -= take
            assert count == 0, f"sub-filter {n} holds {signature} for no item"
    assert +left == Counter(), f"items not stored: {dict(+left)}"


def check_stored(
    client: Any, key: Callable[[int], str], name: str, items: list[str]
) -> list[list[int]]:
    """The stored bytes of a built filter are what they must be; returns its tables."""
    strings = stored_strings(client, key)
    subs = [
        layout.Stored(key(n), s[: layout.HEADER_BYTES], len(s), s[-layout.TAG_BYTES :])
        for n, s in enumerate(strings)
    ]
    lay = layout.verify_stored(name, subs)
    slots = tables(strings, lay)
    assert_holds_exactly(slots, lay, items)
    headers = [layout.unpack_header(s) for s in strings]
    assert [h.items for h in headers] == [sum(map(bool, t)) for t in slots]
    assert (headers[0].deletes, headers[0].missed_deletes) == (0, 0)
    return slots


def check_built(client: Any, cf: SyncCuckooFilter, items: list[str]) -> list[list[int]]:
    """Everything a built filter must be, bytes and answers; returns its tables."""
    slots = check_stored(client, cf.key, cf.name, items)
    info = cf.info()
    assert info.items == len(items) and info.subfilters == len(slots)
    if items:
        assert all(cf.lookup_many(items))
    return slots


def no_keys(client: Any, prefix: str) -> bool:
    return not list(client.scan_iter(match=f"{prefix}*"))


def assert_made_meanwhile_is_kept(client: Any, prefix: str, handle: Callable[[], Any]) -> None:
    """Someone creates the filter while the input is read: promote refuses to replace it
    (checked in the promoting script itself), and the build's staging copy goes."""
    mine, other = handle(), handle()

    def items() -> Iterator[str]:
        yield "a"
        other.reserve(100)
        other.insert("theirs")
        yield "b"

    with pytest.raises(FilterExistsError):
        mine.bulk_load(items())
    assert other.lookup("theirs") and other.info().items == 1
    assert not list(client.scan_iter(match=f"{prefix}*staging*"))


SIZING = st.one_of(
    st.builds(lambda f: {"fingerprint_bits": f}, st.integers(4, 32)),
    st.builds(lambda e: {"error_rate": e}, st.sampled_from([0.5, 0.1, 0.01, 1e-3, 1e-5, 1e-8])),
)
PARAMS = st.builds(
    lambda b, k, kicks, seed, sizing: {
        "bucket_size": b, "expansion": k, "max_kicks": kicks, "seed": seed, **sizing,
    },
    st.sampled_from([1, 2, 4, 8]),
    st.sampled_from([0, 1, 2]),
    st.sampled_from([0, 20, 500]),
    st.integers(0, 2**32 - 1),
    SIZING,
)  # fmt: skip
# The filter is a multiset: duplicates now and then, or a few items many times each (up to
# 16: with b=1 that is 8 sub-filters of one item's copies).
ITEMS = st.one_of(
    st.lists(st.text(alphabet="abcdefg", min_size=1, max_size=4), max_size=300),
    st.dictionaries(st.text(alphabet="xyz", min_size=1, max_size=3), st.integers(1, 16)).map(
        lambda counts: [x for x, n in counts.items() for _ in range(n)]
    ),
).flatmap(st.permutations)
names = itertools.count()


class TestProperties:
    @settings(
        max_examples=80,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(
        capacity=st.one_of(st.integers(1, 20), st.integers(1, 300)),
        params=PARAMS,
        items=ITEMS,
        data=st.data(),
    )
    def test_build_is_a_filter_the_scripts_accept(
        self,
        sync_redis: redis.Redis,
        prefix: str,
        capacity: int,
        params: dict[str, Any],
        items: list[str],
        data: st.DataObject,
    ) -> None:
        """Stored exactly, found, counted; then deletes, inserts and growth on top change it
        exactly as the reference changes the same tables."""
        name_prefix = f"{prefix}{next(names)}:"
        cf = SyncCuckooFilter(sync_redis, "b", prefix=name_prefix)
        lay = FilterParams(capacity=capacity, **params).layout()
        sequential = ReferenceFilter(lay)
        sequential_fits = all(sequential.insert(x) for x in items)
        try:
            cf.bulk_load(items, capacity, **params)
        except FilterFullError:
            # Never short of what one-by-one inserts manage, and nothing is left behind.
            event("build: full")
            assert not sequential_fits
            assert no_keys(sync_redis, name_prefix)
            return
        slots = check_built(sync_redis, cf, items)
        built = stored_layout(sync_redis, cf.key)
        event(f"build: {len(slots)} sub-filter(s)")
        if sequential_fits and len(sequential.tables) == len(slots) == 1:
            event("build: compared with sequential inserts")
            # What inserting one by one stores, as a multiset (where differs: the walk).
            assert slot_signatures(slots, built) == slot_signatures(sequential.tables, lay)

        # The scripts take it from here, exactly as the reference does.
        twin = ReferenceFilter(built, [list(t) for t in slots])
        live = Counter(items)
        gone = data.draw(st.lists(st.sampled_from(items), max_size=20)) if items else []
        gone = list((Counter(gone) & live).elements())
        assert cf.delete_many(gone) == [True] * len(gone) == [twin.delete(x) for x in gone]
        live -= Counter(gone)
        more = [f"new-{k}" for k in range(data.draw(st.integers(0, 3 * capacity)))]
        expected = []
        for x in more:
            placed = twin.insert(x)
            if placed is None:
                break
            expected.append(placed)
        try:
            assert cf.insert_many(more) == expected
        except FilterFullError as full:
            assert full.results[: len(expected)] == expected and len(expected) < len(more)
        live.update(more[: len(expected)])
        info = cf.info()
        event(f"then: {info.subfilters - len(slots)} sub-filter(s) more")
        assert (info.items, info.deletes) == (sum(live.values()), len(gone))
        assert info.subfilters == len(twin.tables)
        assert tables(stored_strings(sync_redis, cf.key), stored_layout(sync_redis, cf.key)) == (
            twin.tables
        )
        assert all(cf.lookup_many(list(live)))
        for x in list(live)[:5]:
            assert cf.count(x) >= live[x]
        cf.drop()


class TestGrowthLimit:
    def test_never_short_of_sequential_inserts(self) -> None:
        """Two sub-filters at most (31-bit prints, one bit more per sub-filter): which items
        stay in the first decides whether the rest fit the second. The search moves items
        between sub-filters until they do, wherever one-by-one inserts fit them all."""
        fitted = 0
        for seed in range(300):
            rng = random.Random(seed)
            lay = FilterParams(
                capacity=1, error_rate=1e-8, bucket_size=4, max_kicks=0, expansion=2, seed=seed
            ).layout()
            assert (lay.fp_bits, lay.buckets0) == (31, 1)
            items = [rng.choice("abcdefgh") for _ in range(rng.randint(5, 12))]
            reference = ReferenceFilter(lay)
            if not all(reference.insert(x) for x in items):
                continue
            fitted += 1
            sink = bulk.HashSink(lay.seed)
            sink.add(items)
            built = bulk.build(*sink.take(), lay, layout.pack_header(lay, 1, 1e-8), name="x")
            assert sum(built.items) == len(items)
        assert fitted > 200


class TestPacking:
    @given(
        fp_bits=st.integers(1, 32),
        values=st.lists(st.integers(0, 2**32 - 1), max_size=70),
    )
    def test_bits_as_bitfield_lays_them_out(self, fp_bits: int, values: list[int]) -> None:
        values = [v % (1 << fp_bits) for v in values]
        bits = "".join(format(v, f"0{fp_bits}b") for v in values)
        bits += "0" * (-len(bits) % 8)
        expected = int(bits, 2).to_bytes(len(bits) // 8, "big") if bits else b""
        assert bulk.pack_slots(np.array(values, dtype=np.uint32), fp_bits) == expected


class TestHashSink:
    @given(items=st.lists(st.one_of(st.text(max_size=20), st.binary(max_size=20)), max_size=50))
    def test_same_hash_as_the_library(self, items: list[str | bytes]) -> None:
        """One digest per item gives h, g and the shard, as hashing.py computes them."""
        seed, shards = 12345, 3
        sink = bulk.HashSink(seed, shards)
        sink.add(items)
        data = [hashing.to_bytes(x) for x in items]
        for i in range(shards):
            h, g = sink.take(i)
            mine = [x for x in data if hashing.shard_of(x, seed, shards) == i]
            assert list(zip(h.tolist(), g.tolist(), strict=True)) == [
                hashing.item_hash(x, seed) for x in mine
            ]
        assert sink.count == len(items)

    def test_items_of_another_type_are_refused(self) -> None:
        with pytest.raises(TypeError, match="str or bytes"):
            bulk.HashSink(1).add(["a", 3])


class TestBulkLoad:
    def test_large_build(self, sync_redis: redis.Redis, prefix: str) -> None:
        """50k items at the error rate the CLI uses: all found, few false positives, a load
        near what sequential inserts reach, one sub-filter."""
        cf = SyncCuckooFilter(sync_redis, "big", prefix=prefix)
        items = [f"user:{i}" for i in range(50_000)]
        info = cf.bulk_load(items, len(items), error_rate=0.001, expansion=0)
        assert info.items == 50_000 and info.subfilters == 1
        assert all(cf.lookup_many(items))
        absent = cf.lookup_many([f"absent:{i}" for i in range(20_000)])
        assert sum(absent) / len(absent) < 0.002

    def test_same_input_same_bytes(self, sync_redis: redis.Redis, prefix: str) -> None:
        items = [f"k{i % 700}" for i in range(3000)]
        a = SyncCuckooFilter(sync_redis, "a", prefix=prefix)
        b = SyncCuckooFilter(sync_redis, "b", prefix=prefix)
        a.bulk_load(items, 1000, seed=9, fingerprint_bits=12)
        b.bulk_load(iter([items[:1000], items[1000:]]), 1000, seed=9, fingerprint_bits=12)
        assert stored_strings(sync_redis, a.key) == stored_strings(sync_redis, b.key)

    def test_empty_and_tiny(self, sync_redis: redis.Redis, prefix: str) -> None:
        cf = SyncCuckooFilter(sync_redis, "e", prefix=prefix)
        info = cf.bulk_load([])
        assert (info.items, info.capacity) == (0, 1)
        assert cf.lookup_many(["x"]) == [False]
        assert cf.insert("x") and cf.lookup("x")
        one = SyncCuckooFilter(sync_redis, "one", prefix=prefix)
        assert one.bulk_load(["x"], 1, expansion=0, bucket_size=1).items == 1
        check_built(sync_redis, one, ["x"])

    def test_capacity_defaults_to_the_items_read(
        self, sync_redis: redis.Redis, prefix: str
    ) -> None:
        cf = SyncCuckooFilter(sync_redis, "c", prefix=prefix)
        info = cf.bulk_load((f"i{k}" for k in range(5000)), expansion=0)
        assert (info.capacity, info.items, info.subfilters) == (5000, 5000, 1)

    def test_grows_as_the_scripts_would(self, sync_redis: redis.Redis, prefix: str) -> None:
        """Ten times its capacity: new sub-filters, each k times the last."""
        cf = SyncCuckooFilter(sync_redis, "g", prefix=prefix)
        items = [f"i{k}" for k in range(10_000)]
        info = cf.bulk_load(items, 1000, error_rate=0.01, expansion=2)
        assert info.subfilters == 4
        check_built(sync_redis, cf, items)
        assert all(cf.insert_many([f"more{k}" for k in range(3000)]))
        assert all(cf.lookup_many(items))

    def test_full_fixed_filter_writes_nothing(self, sync_redis: redis.Redis, prefix: str) -> None:
        cf = SyncCuckooFilter(sync_redis, "f", prefix=prefix)
        with pytest.raises(FilterFullError, match="expansion 0"):
            cf.bulk_load([f"i{k}" for k in range(2000)], 100, expansion=0)
        assert no_keys(sync_redis, prefix)

    def test_existing_filter_is_refused_before_reading(
        self, sync_redis: redis.Redis, prefix: str
    ) -> None:
        cf = SyncCuckooFilter(sync_redis, "x", prefix=prefix)
        cf.reserve(100)
        cf.insert("kept")

        def never() -> Iterator[str]:
            raise AssertionError("the input was read")
            yield ""

        with pytest.raises(FilterExistsError):
            cf.bulk_load(never())
        assert cf.lookup("kept") and not sync_redis.exists(cf.staging().key())

    def test_filter_made_during_the_build_is_kept(
        self, sync_redis: redis.Redis, prefix: str
    ) -> None:
        handle = partial(SyncCuckooFilter, sync_redis, "race", prefix=prefix)
        assert_made_meanwhile_is_kept(sync_redis, prefix, handle)

    def test_replace_swaps_atomically(self, sync_redis: redis.Redis, prefix: str) -> None:
        cf = SyncCuckooFilter(sync_redis, "r", prefix=prefix)
        cf.bulk_load(["old"], 10, expansion=0)
        info = cf.bulk_load([f"new{k}" for k in range(3000)], 100, replace=True)
        assert info.items == 3000 and info.subfilters > 1
        assert cf.lookup("new1") and cf.info().capacity == 100
        assert not sync_redis.exists(cf.staging().key())

    def test_staging_only_then_promote(self, sync_redis: redis.Redis, prefix: str) -> None:
        """A rebuild's path: build into the staging copy, replay changes into it with the
        scripts, promote. The live filter is untouched until then."""
        cf = SyncCuckooFilter(sync_redis, "s", prefix=prefix)
        cf.reserve(100)
        cf.insert("live")
        info = cf.bulk_load(["a", "b", "c"], 100, promote=False)
        assert info.items == 3 and cf.info().items == 1
        staging = cf.staging()
        assert staging.insert("d") and staging.delete("a")
        assert staging.promote()
        assert cf.lookup_many(["a", "b", "c", "d", "live"]) == [False, True, True, True, False]

    def test_staging_handle_builds_itself(self, sync_redis: redis.Redis, prefix: str) -> None:
        """On a staging handle the build is its own keys; promoting stays its promote()."""
        cf = SyncCuckooFilter(sync_redis, "s", prefix=prefix)
        staging = cf.staging()
        with pytest.raises(InvalidParameterError, match="promote=False"):
            staging.bulk_load(["a"])
        assert staging.bulk_load(["a", "b"], promote=False).items == 2
        assert staging.promote() and cf.lookup_many(["a", "b"]) == [True, True]

    def test_options_checked_as_reserve_checks_them(
        self, sync_redis: redis.Redis, prefix: str
    ) -> None:
        cf = SyncCuckooFilter(sync_redis, "v", prefix=prefix)
        bad: list[tuple[dict[str, Any], str]] = [
            ({"bucket_sise": 2}, "unknown reserve option"),
            ({"capacity": 0}, "capacity"),
            ({"error_rate": 2}, "error_rate"),
            ({"applied": -1}, "applied"),
            ({"applied": 2**53}, "applied"),
            ({"source": 2**64}, "source"),
        ]
        for options, match in bad:
            with pytest.raises(InvalidParameterError, match=match):
                cf.bulk_load(["a"], **options)
        assert no_keys(sync_redis, prefix)

    def test_change_position_is_stored(self, sync_redis: redis.Redis, prefix: str) -> None:
        """``applied``/``source`` go into sub-filter 0's header only; the change scripts then
        read them and carry on from there."""
        cf = SyncCuckooFilter(sync_redis, "p", prefix=prefix)
        cf.bulk_load([f"i{k}" for k in range(500)], 100, applied=7, source=9)
        headers = [layout.unpack_header(s) for s in stored_strings(sync_redis, cf.key)]
        assert len(headers) > 1 and (headers[0].applied, headers[0].source) == (7, 9)
        assert all((h.applied, h.source) == (0, 0) for h in headers[1:])
        info = cf.info()
        assert (info.applied_change, info.change_source) == (7, 9)
        assert cf.applied_change() == 7
        result = cf.apply_changes(
            [Change(7, True, "old"), Change(8, True, "new"), Change(9, False, "i3")], source=9
        )
        assert (result.applied, result.gap) == (9, False)
        assert cf.lookup_many(["new", "i3", "i4"]) == [True, False, True]

    def test_runs_alone_not_in_a_pipeline(self, sync_redis: redis.Redis, prefix: str) -> None:
        """A build writes with plain commands, which a pipeline would batch as reads: it is
        refused there, before it writes anything, and the pipeline's other calls run."""
        cf = SyncCuckooFilter(sync_redis, "p", prefix=prefix)
        cf.reserve(100)
        pipe = cf.pipeline()
        pipe.insert("a")
        pipe.bulk_load(["x", "y"], replace=True)
        with pytest.raises(TypeError, match="not in a pipeline"):
            pipe.execute()
        assert cf.lookup("a") and cf.info().items == 1
        assert not sync_redis.exists(cf.staging().key())

    def test_blocking_handle_refuses_an_async_iterable(
        self, sync_redis: redis.Redis, prefix: str
    ) -> None:
        cf = SyncCuckooFilter(sync_redis, "a", prefix=prefix)
        with pytest.raises(TypeError, match="asyncio"):
            cf.bulk_load(batches(["a"], 1))
        assert no_keys(sync_redis, prefix)


class FailingClient:
    """A client whose pipelines fail (connection lost) from the ``after``-th one on."""

    def __init__(self, client: Any, after: int) -> None:
        self._client = client
        self.after = after

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def pipeline(self, *args: Any, **kwargs: Any) -> Any:
        pipe = self._client.pipeline(*args, **kwargs)
        if self.after <= 0:
            queue, execute, names = pipe.execute_command, pipe.execute, []

            def record(*command: Any, **options: Any) -> Any:
                names.append(command[0])
                return queue(*command, **options)

            def fail(*a: Any, **k: Any) -> Any:
                if "SETRANGE" in names:
                    raise redis.ConnectionError("connection lost (injected)")
                return execute(*a, **k)

            pipe.execute_command, pipe.execute = record, fail
        self.after -= 1
        return pipe


class TestFailures:
    def test_upload_cut_leaves_the_live_filter(
        self, sync_redis: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(bulk, "UPLOAD_BYTES", 512)
        monkeypatch.setattr(bulk, "PIPELINE_BYTES", 2048)
        cf = SyncCuckooFilter(sync_redis, "live", prefix=prefix)
        cf.bulk_load([f"old{k}" for k in range(1000)])
        before = stored_strings(sync_redis, cf.key)
        broken = SyncCuckooFilter(FailingClient(sync_redis, after=3), "live", prefix=prefix)
        with pytest.raises(redis.ConnectionError):
            broken.bulk_load([f"new{k}" for k in range(5000)], replace=True)
        assert stored_strings(sync_redis, cf.key) == before
        assert not sync_redis.exists(cf.staging().key())

    def test_damaged_staging_copy_is_not_promoted(
        self, sync_redis: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Bytes changed between the upload and the swap: promote's own check refuses them,
        as corruption (not mistaken for anything else), and the live filter stays."""
        cf = SyncCuckooFilter(sync_redis, "d", prefix=prefix)
        cf.bulk_load(["old"])
        upload = bulk.upload_op

        def damaging(key: Any, built: Any) -> Any:
            yield from upload(key, built)
            sync_redis.setrange(key(0), 0, b"XXXX")

        monkeypatch.setattr(bulk, "upload_op", damaging)
        with pytest.raises(FilterCorruptError, match="bad magic"):
            cf.bulk_load(["new"], replace=True)
        assert cf.lookup_many(["old", "new"]) == [True, False]
        assert not sync_redis.exists(cf.staging().key())

    def test_out_of_memory_leaves_the_live_filter(self) -> None:
        """A real failure half-way: Redis refuses the upload (maxmemory)."""
        server = RedisProcess.start("--maxmemory", "3mb", "--maxmemory-policy", "noeviction")
        client = redis.Redis(port=server.port)
        try:
            cf = SyncCuckooFilter(client, "live")
            cf.bulk_load([f"old{k}" for k in range(1000)])
            before = stored_strings(client, cf.key)
            with pytest.raises(redis.ResponseError, match="maxmemory"):
                cf.bulk_load([f"new{k}" for k in range(3_000_000)], replace=True)
            assert stored_strings(client, cf.key) == before
            assert all(cf.lookup_many([f"old{k}" for k in range(1000)]))
            assert not client.exists(cf.staging().key())
        finally:
            client.close()
            server.stop()


class TestSharded:
    def test_each_shard_built(self, sync_redis: redis.Redis, prefix: str) -> None:
        sf = SyncShardedCuckooFilter(sync_redis, "sh", prefix=prefix, shards=3)
        items = [f"u{k}" for k in range(6000)] + ["dup"] * 5
        info = sf.bulk_load(items, 6000, error_rate=0.001)
        assert info.items == len(items) and info.shards == 3
        assert all(sf.lookup_many(items))
        seed = stored_layout(sync_redis, partial(sf.key, 0)).seed
        for i in range(3):
            mine = [x for x in items if hashing.shard_of(x.encode(), seed, 3) == i]
            check_stored(sync_redis, partial(sf.key, i), sf.name, mine)
            assert layout.unpack_header(sync_redis.get(sf.key(i))).shards == 3
        assert sf.delete("dup") and sf.count("dup") == 4

    def test_replace_keeps_the_seed(self, sync_redis: redis.Redis, prefix: str) -> None:
        """An item routes to the same shard in the old and the new copy."""
        sf = SyncShardedCuckooFilter(sync_redis, "sh", prefix=prefix, shards=2)
        sf.bulk_load(["a"], 100)
        seed = layout.unpack_header(sync_redis.get(sf.key(0))).layout.seed
        sf.bulk_load(["b", "c"], 100, replace=True)
        assert layout.unpack_header(sync_redis.get(sf.key(1))).layout.seed == seed
        assert sf.lookup_many(["a", "b", "c"]) == [False, True, True]
        wrong = SyncShardedCuckooFilter(sync_redis, "sh", prefix=prefix, shards=3)
        with pytest.raises(InvalidParameterError, match="2 shard"):
            wrong.bulk_load(["x"], replace=True)

    def test_no_change_position(self, sync_redis: redis.Redis, prefix: str) -> None:
        """As reserve(): only a plain filter follows a change log."""
        sf = SyncShardedCuckooFilter(sync_redis, "sh", prefix=prefix, shards=2)
        with pytest.raises(InvalidParameterError, match="no applied or source"):
            sf.bulk_load(["a"], applied=3)

    def test_existing_shard_is_refused(self, sync_redis: redis.Redis, prefix: str) -> None:
        sf = SyncShardedCuckooFilter(sync_redis, "sh", prefix=prefix, shards=2)
        sf.reserve(100)
        with pytest.raises(FilterExistsError):
            sf.bulk_load(["a"])

    def test_filter_made_during_the_build_is_kept(
        self, sync_redis: redis.Redis, prefix: str
    ) -> None:
        """As for a plain filter: no shard is swapped in once any exists."""
        handle = partial(SyncShardedCuckooFilter, sync_redis, "race", prefix=prefix, shards=3)
        assert_made_meanwhile_is_kept(sync_redis, prefix, handle)


async def batches(items: list[str], size: int) -> AsyncIterator[list[str]]:
    for k in range(0, len(items), size):
        yield items[k : k + size]


class TestAsync:
    async def test_async_batches(self, async_redis: aioredis.Redis, prefix: str) -> None:
        """A database cursor's batches, as the records rebuild reads them."""
        cf = CuckooFilter(async_redis, "a", prefix=prefix)
        items = [f"row{k}" for k in range(20_000)]
        info = await cf.bulk_load(batches(items, 3000), 20_000, error_rate=0.001)
        assert info.items == 20_000
        assert all(await cf.lookup_many(items))

    async def test_async_items_and_staging(self, async_redis: aioredis.Redis, prefix: str) -> None:
        cf = CuckooFilter(async_redis, "a", prefix=prefix)

        async def one_by_one() -> AsyncIterator[str]:
            for k in range(100):
                yield f"r{k}"

        info = await cf.bulk_load(one_by_one(), 1000, promote=False)
        assert info.items == 100 and not await cf.exists()
        assert await cf.staging().promote()
        assert await cf.lookup("r5")
        info = await cf.bulk_load(["x", "y"], replace=True)
        assert info.items == 2 and not await cf.lookup("r5")

    async def test_async_sharded(self, async_redis: aioredis.Redis, prefix: str) -> None:
        sf = ShardedCuckooFilter(async_redis, "s", prefix=prefix, shards=4)
        items = [f"k{i}" for i in range(4000)]
        info = await sf.bulk_load(batches(items, 500), 4000)
        assert info.items == 4000 and info.shards == 4
        assert all(await sf.lookup_many(items))

    async def test_hashing_and_placement_run_off_the_event_loop(
        self, async_redis: aioredis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The CPU-heavy steps run in a worker thread, never in the event loop's own."""
        threads: list[tuple[str, int]] = []

        def recorded(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
            def run(*args: Any, **kwargs: Any) -> Any:
                threads.append((name, threading.get_ident()))
                return function(*args, **kwargs)

            return run

        monkeypatch.setattr(hashing, "item_hashes", recorded("hash", hashing.item_hashes))
        monkeypatch.setattr(bulk, "build", recorded("build", bulk.build))
        cf = CuckooFilter(async_redis, "t", prefix=prefix)
        for items in (batches([f"k{i}" for i in range(500)], 100), ["a", "b"]):
            assert (await cf.bulk_load(items, 1000, replace=True)).items in (500, 2)
        assert {name for name, _ in threads} == {"hash", "build"}
        assert threading.get_ident() not in {thread for _, thread in threads}

    async def test_async_refuses_existing(self, async_redis: aioredis.Redis, prefix: str) -> None:
        cf = CuckooFilter(async_redis, "a", prefix=prefix)
        await cf.reserve(10)
        with pytest.raises(FilterExistsError):
            await cf.bulk_load(["a"])


def test_fakeredis_and_redis_agree(real_redis: redis.Redis, prefix: str) -> None:
    """The same build, byte for byte, whichever server holds it."""
    fake = fakeredis.FakeRedis()
    items = [f"i{k}" for k in range(2000)]
    a = SyncCuckooFilter(real_redis, "same", prefix=prefix)
    b = SyncCuckooFilter(fake, "same", prefix=prefix)
    a.bulk_load(items, 500, seed=3)
    b.bulk_load(items, 500, seed=3)
    assert stored_strings(real_redis, a.key) == stored_strings(fake, b.key)
