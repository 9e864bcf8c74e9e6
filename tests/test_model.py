"""Property-based tests: random operation sequences against a model of the multiset.

Two models at once: the multiset of live items (the contract: no false negatives, counts at
least the true multiplicity), and tests/reference.py (the algorithm: Redis's tables must equal
the reference's slot for slot after every step).
"""

from __future__ import annotations

from collections import Counter

import fakeredis
import hypothesis.strategies as st
import pytest
import redis
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from guard import Change, ChangeSourceError, FilterFullError, SyncCuckooFilter, layout
from tests.reference import ReferenceFilter, SourceMismatch, unpack_table

ITEMS = st.text(alphabet="abcdefghij", min_size=1, max_size=3)
SOURCE = 0xC0FFEE  # the change log the model's filters follow (another one is refused)


def redis_tables(client: redis.Redis, cf: SyncCuckooFilter, lay: layout.Layout) -> list[list[int]]:
    return [
        unpack_table(client.get(cf.key(n)), lay.buckets(n), lay.bucket_size, lay.fp_bits_at(n))
        for n in range(lay.subfilters)
    ]


class FilterMachine(RuleBasedStateMachine):
    """Subclasses pick the backend; everything else is shared."""

    client: redis.Redis
    counter = 0
    # Under the test's own prefix, which its fixture deletes whatever happens to a run.
    base_prefix = "test:model:"

    @initialize(
        capacity=st.integers(4, 60),
        bucket_size=st.sampled_from([1, 2, 4, 8]),
        bits=st.sampled_from([4, 6, 8, 12, 16]),
        expansion=st.sampled_from([0, 1, 2, 3]),
        kicks=st.sampled_from([0, 1, 20, 500]),
        by_error_rate=st.booleans(),
        seed=st.integers(0, 2**32 - 1),
        stamped=st.booleans(),
    )
    def create(
        self, capacity, bucket_size, bits, expansion, kicks, by_error_rate, seed, stamped
    ) -> None:
        FilterMachine.counter += 1
        self.prefix = f"{self.base_prefix}{FilterMachine.counter}:"
        self.cf = SyncCuckooFilter(self.client, "m", prefix=self.prefix)
        self.cf.drop()
        sizing = {"error_rate": 0.5**bits} if by_error_rate else {"fingerprint_bits": bits}
        self.cf.reserve(
            capacity,
            bucket_size=bucket_size,
            max_kicks=kicks,
            expansion=expansion,
            seed=seed,
            **sizing,
            # As a rebuild from a database snapshot stamps it; else the first apply adopts.
            **({"applied": 3, "source": SOURCE} if stamped else {}),
        )
        self.ref = ReferenceFilter(self.cf._layout)
        self.live: Counter[str] = Counter()
        # The change log: log[k] has id k + 1. Ids up to the reserve stamp were never seen.
        self.log: list[Change] = [Change(k + 1, True, "") for k in range(3 if stamped else 0)]
        self.ref.applied, self.ref.source = (3, SOURCE) if stamped else (0, 0)

    def teardown(self) -> None:
        if hasattr(self, "cf"):
            self.cf.drop()

    @rule(item=ITEMS, unique=st.booleans())
    def insert(self, item: str, unique: bool) -> None:
        expected = self.ref.insert(item, unique)
        try:
            added = self.cf.insert_many([item], unique=unique)[0]
        except FilterFullError:
            assert expected is None, "Redis refused an item the reference placed"
            return
        assert added == expected
        if added:
            self.live[item] += 1

    @rule(batch=st.lists(ITEMS, max_size=12))
    def insert_batch(self, batch: list[str]) -> None:
        expected = []
        for x in batch:
            r = self.ref.insert(x)
            if r is None:
                break
            expected.append(r)
        try:
            got = self.cf.insert_many(batch)
        except FilterFullError as full:
            got = full.results[: len(expected)]
            assert len(expected) < len(batch)
        assert got == expected
        self.live.update(batch[: len(expected)])

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def delete_present(self, data: st.DataObject) -> None:
        item = data.draw(st.sampled_from(sorted(self.live)))
        assert self.cf.delete(item) is True
        assert self.ref.delete(item) is True
        self.live[item] -= 1
        if not self.live[item]:
            del self.live[item]

    # -- the change feed ----------------------------------------------------------------

    def _apply(self, changes: list[Change], source: int = SOURCE) -> None:
        """Apply on both; the same outcome, and the live multiset follows what was applied."""
        try:
            expected = self.ref.apply(changes, source)
        except SourceMismatch:
            with pytest.raises(ChangeSourceError):
                self.cf.apply_changes(changes, source=source)
            return
        try:
            got = self.cf.apply_changes(changes, source=source)
        except FilterFullError as full:
            assert expected.full, "Redis refused a change the reference applied"
            handled = len(expected.results)
            assert full.results == expected.results + [False] * (len(changes) - handled)
        else:
            assert not expected.full
            assert (got.applied, got.gap, got.results, got.skipped) == (
                expected.applied, expected.gap, expected.results, expected.skipped,
            )  # fmt: skip
            assert got.handled == len(got.results)
        done = slice(expected.skipped, len(expected.results))
        for change, hit in zip(changes[done], expected.results[done], strict=True):
            self.log.append(change)
            if change.insert:
                self.live[change.item] += 1
            elif hit:  # a missed delete removed nothing
                self._forget(change.item)

    def _forget(self, item: str) -> None:
        self.live[item] -= 1
        if not self.live[item]:
            del self.live[item]

    @rule(data=st.data(), back=st.integers(0, 4), size=st.integers(0, 8))
    def apply_batch(self, data: st.DataObject, back: int, size: int) -> None:
        """Changes from `back` ids before the watermark on: the overlap replays logged ones
        (a follower that crashed, or a batch sent twice), which must be skipped."""
        start = self.ref.applied + 1 - min(back, self.ref.applied)
        changes = self.log[start - 1 : self.ref.applied]
        pending = Counter(self.live)
        for _ in range(size):
            if pending and data.draw(st.booleans()):  # delete something live, once
                item = data.draw(st.sampled_from(sorted(pending)))
                pending[item] -= 1
                pending += Counter()  # drops the zeros
                changes.append(Change(start + len(changes), False, item))
            else:
                item = data.draw(ITEMS)
                pending[item] += 1
                changes.append(Change(start + len(changes), True, item))
        self._apply(changes)

    @rule(item=ITEMS)
    def apply_missed_delete(self, item: str) -> None:
        """A delete of what the filter does not hold: handled, counted as missed."""
        if not self.ref.lookup(item):
            self._apply([Change(self.ref.applied + 1, False, item)])

    @rule(item=ITEMS, ahead=st.integers(2, 5))
    def apply_after_a_gap(self, item: str, ahead: int) -> None:
        self._apply([Change(self.ref.applied + ahead, True, item)])

    @precondition(lambda self: self.ref.source)
    @rule(item=ITEMS)
    def apply_from_another_log(self, item: str) -> None:
        self._apply([Change(self.ref.applied + 1, True, item)], source=SOURCE + 1)

    @precondition(lambda self: self.log)
    @rule(data=st.data(), last=st.booleans())
    def undo(self, data: st.DataObject, last: bool) -> None:
        """The last change applied is taken back; any other is left alone."""
        change = self.log[-1] if last else data.draw(st.sampled_from(self.log))
        if not change.item:
            return  # an id before the reserve stamp: not a change this test made
        if change.insert and not self.live[change.item]:
            # Deleted since by a plain delete: undoing the insert would delete what is not
            # there, which may remove another item's copy (docs/format.md); not a feed's use.
            return
        expected = self.ref.undo(change, SOURCE)
        try:
            got = self.cf.undo_change(change, source=SOURCE)
        except FilterFullError:
            assert expected is None, "Redis could not undo what the reference undid"
            return
        assert got == expected
        if got:
            self.log.pop()
            if change.insert:
                self._forget(change.item)
            else:
                self.live[change.item] += 1

    @rule(probe=st.lists(ITEMS, max_size=8))
    def lookup(self, probe: list[str]) -> None:
        assert self.cf.lookup_many(probe) == [self.ref.lookup(x) for x in probe]

    @rule(item=ITEMS)
    def count(self, item: str) -> None:
        assert self.cf.count(item) == self.ref.count(item) >= self.live[item]

    @invariant()
    def no_false_negatives(self) -> None:
        if hasattr(self, "cf") and self.live:
            assert all(self.cf.lookup_many(list(self.live)))

    @invariant()
    def tables_equal_reference(self) -> None:
        if hasattr(self, "cf"):
            info = self.cf.info()
            assert info.items == sum(self.live.values())
            assert info.subfilters == len(self.ref.tables)
            assert (info.applied_change, info.change_source) == (self.ref.applied, self.ref.source)
            assert self.cf.applied_change() == self.ref.applied
            assert redis_tables(self.client, self.cf, self.cf._layout) == self.ref.tables


MODEL_SETTINGS = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class RealRedisMachine(FilterMachine):
    pass


class FakeRedisMachine(FilterMachine):
    client = fakeredis.FakeRedis()


@pytest.fixture
def _real_client(real_redis: redis.Redis) -> redis.Redis:
    return real_redis


def test_model_on_real_redis(_real_client: redis.Redis, prefix: str) -> None:
    RealRedisMachine.client = _real_client
    RealRedisMachine.base_prefix = f"{prefix}model:"
    RealRedisMachine.TestCase.settings = MODEL_SETTINGS
    RealRedisMachine.TestCase().runTest()


def test_model_on_fakeredis() -> None:
    FakeRedisMachine.TestCase.settings = MODEL_SETTINGS
    FakeRedisMachine.TestCase().runTest()
