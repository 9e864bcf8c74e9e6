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

from guard import FilterFullError, SyncCuckooFilter
from guard import layout as fmt
from tests.reference import ReferenceFilter

ITEMS = st.text(alphabet="abcdefghij", min_size=1, max_size=3)


def redis_tables(client: redis.Redis, cf: SyncCuckooFilter, lay: fmt.Layout) -> list[list[int]]:
    return [
        fmt.unpack_table(client.get(cf.key(n)), lay.buckets(n), lay.bucket_size, lay.fp_bits_at(n))
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
    )
    def create(self, capacity, bucket_size, bits, expansion, kicks, by_error_rate, seed) -> None:
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
        )
        self.ref = ReferenceFilter(self.cf._layout)
        self.live: Counter[str] = Counter()

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
