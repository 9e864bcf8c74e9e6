"""The bulk builder's tests, run unchanged against a real Redis Cluster: a filter's keys
(sub-filters and staging copy) share one slot, each shard of a sharded filter has its own."""

from __future__ import annotations

from tests.test_bulk import TestAsync, TestBulkLoad, TestFailures, TestSharded

__all__ = ["TestAsync", "TestBulkLoad", "TestFailures", "TestSharded"]
