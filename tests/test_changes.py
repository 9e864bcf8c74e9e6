"""Database changes applied exactly once (guard/changes.py), on a real Redis and on fakeredis.

The stored watermark (`applied`, the id of the last change applied) moves in the script that
applies the changes: replays, overlaps and crashes between calls apply nothing twice; a gap is
refused; a filter built from another change log is refused; undo takes back only the last
change. tests/test_model.py replays random sequences of the same against tests/reference.py.
"""

from __future__ import annotations

import pytest
import redis
import redis.asyncio as aioredis

from guard import (
    ApplyResult,
    Change,
    ChangeSourceError,
    CuckooFilter,
    FilterCorruptError,
    FilterFullError,
    FilterNotFoundError,
    InvalidParameterError,
    SyncCuckooFilter,
    layout,
)

SOURCE = 0xFEED_F00D


def changes(first: int, *ops: tuple[str, str]) -> list[Change]:
    """Changes with consecutive ids from ``first``: ("+", item) inserts, ("-", item) deletes."""
    return [Change(first + k, op == "+", item) for k, (op, item) in enumerate(ops)]


def adds(first: int, count: int, tag: str = "k") -> list[Change]:
    return [Change(first + k, True, f"{tag}{first + k}") for k in range(count)]


@pytest.fixture
def cf(sync_redis: redis.Redis, prefix: str) -> SyncCuckooFilter:
    f = SyncCuckooFilter(sync_redis, "feed", prefix=prefix)
    f.reserve(1000, seed=11)
    return f


class TestApply:
    def test_applies_in_order_and_moves_the_watermark(self, cf: SyncCuckooFilter) -> None:
        result = cf.apply_changes(changes(1, ("+", "a"), ("+", "b"), ("-", "a")), source=SOURCE)
        assert result == ApplyResult(applied=3, handled=3, gap=False, results=[True] * 3)
        assert cf.lookup_many(["a", "b"]) == [False, True]
        assert cf.applied_change() == 3
        info = cf.info()
        assert (info.applied_change, info.change_source) == (3, SOURCE)
        assert (info.items, info.deletes, info.missed_deletes) == (1, 1, 0)

    def test_replaying_a_batch_applies_nothing_twice(self, cf: SyncCuckooFilter) -> None:
        batch = changes(1, ("+", "a"), ("+", "a"), ("-", "b"))
        first = cf.apply_changes(batch, source=SOURCE)
        again = cf.apply_changes(batch, source=SOURCE)
        assert first.results == [True, True, False]  # the delete found nothing: missed
        assert again == ApplyResult(3, 3, False, [True] * 3, skipped=3)
        assert cf.count("a") == 2  # not 4
        info = cf.info()
        assert (info.items, info.missed_deletes, info.applied_change) == (2, 1, 3)

    def test_overlapping_batches_apply_the_new_part_only(self, cf: SyncCuckooFilter) -> None:
        cf.apply_changes(adds(1, 5), source=SOURCE)
        result = cf.apply_changes(adds(3, 6), source=SOURCE)  # ids 3..8: 3..5 applied already
        assert (result.applied, result.handled, result.skipped) == (8, 6, 3)
        assert cf.info().items == 8
        assert all(cf.lookup_many([c.item for c in adds(1, 8)]))

    def test_a_crash_between_calls_is_replayed_exactly_once(self, cf: SyncCuckooFilter) -> None:
        """A follower applied a prefix, crashed before recording it, and sends it all again."""
        batch = [*adds(1, 4), *changes(5, ("-", "k2"), ("-", "k3"), ("+", "z"))]
        cf.apply_changes(batch[:5], source=SOURCE)  # ... crash here ...
        result = cf.apply_changes(batch, source=SOURCE)
        assert (result.applied, result.skipped, result.results) == (7, 5, [True] * 7)
        assert cf.lookup_many(["k1", "k2", "k3", "k4", "z"]) == [True, False, False, True, True]
        info = cf.info()
        assert (info.items, info.deletes, info.missed_deletes) == (3, 2, 0)

    def test_a_gap_writes_nothing(self, cf: SyncCuckooFilter, sync_redis: redis.Redis) -> None:
        cf.apply_changes(adds(1, 2), source=SOURCE)
        before = sync_redis.get(cf.key())
        result = cf.apply_changes(adds(4, 3), source=SOURCE)  # change 3 is missing
        assert result == ApplyResult(applied=2, handled=0, gap=True, results=[])
        assert sync_redis.get(cf.key()) == before
        # A batch reaching back over the watermark but gapless is applied from 3 on.
        assert cf.apply_changes(adds(2, 5), source=SOURCE).applied == 6

    def test_an_empty_batch_adopts_the_source(self, cf: SyncCuckooFilter) -> None:
        assert cf.apply_changes([], source=SOURCE) == ApplyResult(0, 0, False, [])
        assert cf.info().change_source == SOURCE
        with pytest.raises(ChangeSourceError) as raised:
            cf.apply_changes([], source=SOURCE + 1)
        assert (raised.value.stored, raised.value.given) == (SOURCE, SOURCE + 1)

    def test_another_change_log_is_refused(
        self, cf: SyncCuckooFilter, sync_redis: redis.Redis
    ) -> None:
        cf.apply_changes(adds(1, 3), source=SOURCE)
        before = sync_redis.get(cf.key())
        with pytest.raises(ChangeSourceError, match="rebuild") as raised:
            cf.apply_changes(adds(4, 1), source=SOURCE + 1)
        assert raised.value.filter == "feed"
        with pytest.raises(ChangeSourceError):
            cf.undo_change(adds(3, 1)[0], source=SOURCE + 1)
        assert sync_redis.get(cf.key()) == before

    def test_long_batches_are_split_and_still_exact(self, cf: SyncCuckooFilter) -> None:
        """More changes than one script call carries (INSERT_CHUNK), growing the filter."""
        batch = [*adds(1, 3000), *[Change(3001 + k, False, f"k{k + 1}") for k in range(1000)]]
        result = cf.apply_changes(batch, source=SOURCE)
        assert (result.applied, result.handled, result.gap) == (4000, 4000, False)
        info = cf.info()
        assert info.subfilters > 1 and info.items == 2000 and info.deletes == 1000
        assert all(cf.lookup_many([f"k{k}" for k in range(1001, 3001)]))
        assert cf.apply_changes(batch, source=SOURCE).skipped == 4000
        assert cf.info().items == 2000

    def test_a_full_filter_stops_at_the_change_it_cannot_place(
        self, sync_redis: redis.Redis, prefix: str
    ) -> None:
        cf = SyncCuckooFilter(sync_redis, "fixed", prefix=prefix)
        cf.reserve(20, expansion=0, bucket_size=2, seed=3)
        with pytest.raises(FilterFullError) as full:
            cf.apply_changes(adds(1, 200), source=SOURCE)
        placed = full.value.results.index(False)
        assert full.value.results == [True] * placed + [False] * (200 - placed)
        assert cf.applied_change() == placed  # the ids of the changes handled, no further
        assert cf.info().items == placed
        assert all(cf.lookup_many([c.item for c in adds(1, placed)]))
        # Deletes make room: the feed carries on from the change that did not fit.
        rest = [*changes(placed + 1, ("-", "k1"), ("-", "k2")), *adds(placed + 3, 1, "k")]
        assert cf.apply_changes(rest, source=SOURCE).applied == placed + 3


class TestUndo:
    def test_undoes_the_last_change_only(self, cf: SyncCuckooFilter) -> None:
        batch = changes(1, ("+", "a"), ("+", "b"))
        cf.apply_changes(batch, source=SOURCE)
        assert cf.undo_change(batch[0], source=SOURCE) is False  # not the last one
        assert cf.lookup("a") and cf.applied_change() == 2
        assert cf.undo_change(batch[1], source=SOURCE) is True
        assert not cf.lookup("b") and cf.applied_change() == 1
        assert cf.undo_change(batch[1], source=SOURCE) is False  # already undone
        assert cf.undo_change(batch[0], source=SOURCE) is True
        assert cf.applied_change() == 0 and cf.info().items == 0

    def test_undoing_a_delete_puts_the_item_back(self, cf: SyncCuckooFilter) -> None:
        batch = changes(1, ("+", "a"), ("-", "a"))
        cf.apply_changes(batch, source=SOURCE)
        assert not cf.lookup("a")
        assert cf.undo_change(batch[1], source=SOURCE) is True
        assert cf.lookup("a") and cf.applied_change() == 1
        # The id is free again: the next change takes it (a rolled-back transaction's id).
        assert cf.apply_changes(changes(2, ("+", "c")), source=SOURCE).applied == 2

    def test_undo_on_a_filter_with_nothing_applied(self, cf: SyncCuckooFilter) -> None:
        assert cf.undo_change(Change(1, True, "a"), source=SOURCE) is False
        assert cf.info().items == 0


class TestWatermark:
    def test_reserve_stamps_a_snapshot(self, sync_redis: redis.Redis, prefix: str) -> None:
        cf = SyncCuckooFilter(sync_redis, "built", prefix=prefix)
        info = cf.reserve(100, applied=41, source=SOURCE)
        assert (info.applied_change, info.change_source) == (41, SOURCE)
        assert SyncCuckooFilter(sync_redis, "built", prefix=prefix).applied_change() == 41
        # The snapshot holds changes up to 41: a follower replaying from older ids skips them.
        result = cf.apply_changes(adds(40, 3), source=SOURCE)
        assert (result.applied, result.skipped, cf.info().items) == (42, 2, 1)

    def test_a_copy_rolled_back_reads_its_own_older_id(
        self, cf: SyncCuckooFilter, sync_redis: redis.Redis
    ) -> None:
        cf.apply_changes(adds(1, 3), source=SOURCE)
        older = sync_redis.get(cf.key())
        cf.apply_changes(adds(4, 3), source=SOURCE)
        assert cf.applied_change() == 6
        sync_redis.set(cf.key(), older)  # restored from an older snapshot
        assert cf.applied_change() == 3  # the same handle, its layout cached
        assert cf.apply_changes(adds(4, 3), source=SOURCE).applied == 6

    def test_applied_change_grown_filter_and_stale_handle(
        self, sync_redis: redis.Redis, prefix: str
    ) -> None:
        cf = SyncCuckooFilter(sync_redis, "g", prefix=prefix)
        cf.reserve(50, seed=1)
        reader = SyncCuckooFilter(sync_redis, "g", prefix=prefix)
        assert reader.applied_change() == 0  # caches a one-sub-filter layout
        cf.apply_changes(adds(1, 500), source=SOURCE)
        assert cf.info().subfilters > 1
        assert reader.applied_change() == 500  # its tag read fails: the probe answers

    @pytest.mark.parametrize(
        ("ids", "source", "match"),
        [
            ([0], SOURCE, r"changes\[0\].id must be an integer from 1"),
            ([1, 3], SOURCE, r"changes\[1\].id must be 2"),
            ([2**53], SOURCE, "changes"),
            ([1], 0, "source must be an integer from 1"),
            ([1], 2**64, "source"),
        ],
    )
    def test_bad_input_is_refused_before_any_write(
        self, cf: SyncCuckooFilter, ids: list[int], source: int, match: str
    ) -> None:
        with pytest.raises(InvalidParameterError, match=match):
            cf.apply_changes([Change(i, True, "x") for i in ids], source=source)
        assert cf.info().items == 0

    def test_reserve_refuses_a_bad_stamp(self, sync_redis: redis.Redis, prefix: str) -> None:
        cf = SyncCuckooFilter(sync_redis, "bad", prefix=prefix)
        with pytest.raises(InvalidParameterError, match="applied"):
            cf.reserve(100, applied=2**53)
        with pytest.raises(InvalidParameterError, match="source"):
            cf.reserve(100, source=-1)
        assert not cf.exists()

    def test_missing_and_damaged_filters(
        self, cf: SyncCuckooFilter, sync_redis: redis.Redis, prefix: str
    ) -> None:
        gone = SyncCuckooFilter(sync_redis, "gone", prefix=prefix)
        for op in (
            gone.applied_change,
            lambda: gone.apply_changes(adds(1, 1), source=SOURCE),
            lambda: gone.undo_change(adds(1, 1)[0], source=SOURCE),
        ):
            with pytest.raises(FilterNotFoundError):
                op()
        cf.apply_changes(adds(1, 1), source=SOURCE)
        sync_redis.setrange(cf.key(), layout.APPLIED_AT, b"\x80")  # above 2**53: out of range
        for op in (
            cf.applied_change,
            lambda: cf.apply_changes(adds(2, 1), source=SOURCE),
            lambda: cf.undo_change(adds(1, 1)[0], source=SOURCE),
        ):
            with pytest.raises(FilterCorruptError, match="applied"):
                op()


async def test_async_handle(async_redis: aioredis.Redis, prefix: str) -> None:
    cf = CuckooFilter(async_redis, "feed", prefix=prefix)
    await cf.reserve(100, seed=5)
    batch = changes(1, ("+", "a"), ("+", "b"))
    assert (await cf.apply_changes(batch, source=SOURCE)).applied == 2
    assert (await cf.apply_changes(batch, source=SOURCE)).skipped == 2
    assert await cf.applied_change() == 2
    assert await cf.undo_change(batch[1], source=SOURCE) is True
    assert await cf.lookup_many(["a", "b"]) == [True, False]
    with pytest.raises(ChangeSourceError):
        await cf.apply_changes(batch, source=1)
