"""Export and import, run unchanged against a real Redis Cluster: each shard's snapshot is one
MULTI in its own slot, and a sharded dump's chunks are read from every node."""

from __future__ import annotations

from tests.test_dump_ops import TestAsync, TestFormat, TestSharded

__all__ = ["TestAsync", "TestFormat", "TestSharded"]
