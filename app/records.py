"""Guarded records: reads through the cache, writes that keep the filter in step, rebuilds.

Each job has its module: app/cache.py (read-through cache, single-flight loads),
app/filter_writes.py (the filter's change inside each write's transaction), app/rebuild.py
(the filter made again from the table), app/feed.py (following changes made by anyone).
"""

from __future__ import annotations

import json
from typing import Any

import redis.asyncio as aioredis

from app.cache import RecordCache
from app.db import Database
from app.feed import FeedState, Follower
from app.filter_writes import FilterWrites, Write
from app.metrics import Metrics
from app.rebuild import Rebuild, RebuildInProgress
from app.settings import Settings
from guard import CuckooFilter, FilterInfo
from guard.breaker import RedisBreaker

__all__ = ["RebuildInProgress", "RecordStore"]


class RecordStore:
    """Reads and writes of the records table, keeping cache and filter in step with it."""

    def __init__(
        self,
        redis: aioredis.Redis,
        db: Database,
        settings: Settings,
        metrics: Metrics,
        breaker: RedisBreaker | None = None,
        admin: aioredis.Redis | None = None,
    ):
        self.redis = redis
        self.db = db
        self.settings = settings
        self.metrics = metrics
        # Shared with the guard middleware: a failed guard lookup spares the cache read.
        self.breaker = breaker if breaker is not None else RedisBreaker(settings.redis_cooldown)
        self.filter = CuckooFilter(
            redis,
            settings.records_filter,
            prefix=settings.key_prefix,
            coalesce=settings.lookup_coalescing,
        )
        self.state = FeedState()
        self.cache = RecordCache(redis, db, settings, metrics, self.breaker)
        self.writes = FilterWrites(self.filter, db, settings, self.state)
        self.rebuilder = Rebuild(admin if admin is not None else redis, db, settings, self.state)
        self.staging = self.rebuilder.staging

    def follower(self) -> Follower:
        """A follower of the change log for this filter (the service's and ``guard
        follow``'s), that never compacts past a running rebuild's snapshot."""
        return Follower(
            self.filter, self.db, self.settings, self.state, pinned=self.rebuilder.pinned
        )

    async def get(self, key: str, *, suspect: bool = False) -> tuple[bool, Any]:
        """(found, value). `suspect`: the filter said "maybe", so a miss is a false positive."""
        return await self.cache.get(key, suspect=suspect)

    async def put(self, key: str, value: Any) -> bool:
        """Insert or replace; True if the row is new. Redis down → raises before any write."""
        # allow_nan=False: NaN is no JSON, and must fail here, before any write.
        raw = json.dumps(value, separators=(",", ":"), allow_nan=False)
        return await self._write(key, lambda hook: self.db.put(key, raw, hook))

    async def delete(self, key: str) -> bool:
        """Delete; True if a row was deleted. Redis down → raises before any write."""
        return await self._write(key, lambda hook: self.db.delete(key, hook))

    async def _write(self, key: str, write: Write) -> bool:
        # Invalidated before (Redis up, or nothing is written) and after the write.
        await self.cache.invalidate(key)
        changed = await self.writes.run(write)
        await self.cache.written(key)
        return changed

    async def rebuild(self) -> FilterInfo:
        """Build the filter from the table and swap it in atomically (app/rebuild.py).

        Readers use the old filter until the swap, so no present key ever reads as absent.
        """
        return await self.rebuilder.run()
