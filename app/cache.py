"""The records' read-through cache in Redis, with single-flight loads from the database.

Negative entries ("no such row", for keys the filter let through: its false positives) and,
when GUARD_CACHE_TTL is set, the rows themselves. Both follow the change feed: every insert,
delete and key change applied to the filter drops the key's entries first (``changed``), in
every process, whoever wrote it. UPDATEs of other columns are not in the feed (logging them
would cost every writer of the table: docs/postgresql.md), which is why rows are cached only
on request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from app.db import Database
from app.metrics import Metrics
from app.redis_conn import FlushSafeScript
from app.settings import Settings
from guard.breaker import RedisBreaker
from guard.changes import Change
from guard.errors import RedisUnreachable

log = logging.getLogger(__name__)
# Cache entries: b"+" + the row's JSON text, or b"-" for "no such row" (negative entry).
_NEGATIVE = b"-"
_VERSION_TTL_MS = 3_600_000  # far longer than any read that could still be in flight
UNKNOWN = b"?"  # the version when Redis could not be asked (never a counter's value)

# KEYS[1] the key's version counter, KEYS[2] its cache entry
# ARGV[1] version read before the database query ("" when there was none)
# ARGV[2] the entry's TTL in milliseconds, ARGV[3] the entry
# Reply: 1 stored; 0 a write bumped the version meanwhile, so the loaded value may be stale.
_SET_IF_UNCHANGED = """
local seen = redis.call('GET', KEYS[1]) or ''
if seen ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[2])
return 1
"""

# KEYS: version counter 1, cache entry 1, version counter 2, entry 2, ...
# ARGV[1]: the counters' TTL in milliseconds. Reply: the number of keys.
# Bumps each version (a load in flight won't cache what it read) and drops each entry.
_FORGET = """
for i = 1, #KEYS, 2 do
  redis.call('INCR', KEYS[i])
  redis.call('PEXPIRE', KEYS[i], ARGV[1])
  redis.call('DEL', KEYS[i + 1])
end
return #KEYS / 2
"""


class SingleFlight:
    """Concurrent calls for one key share one execution (and its result or error)."""

    def __init__(self) -> None:
        self._calls: dict[Hashable, asyncio.Task[Any]] = {}

    async def do(self, key: Hashable, fn: Callable[[], Awaitable[Any]]) -> Any:
        task = self._calls.get(key)
        if task is None:
            # A task of its own: a caller that disconnects must not cancel the others' load.
            task = asyncio.ensure_future(fn())
            self._calls[key] = task
            task.add_done_callback(lambda t: self._finished(key, t))
        return await asyncio.shield(task)

    def forget(self, key: Hashable) -> None:
        """Later calls for `key` start a new execution; the running one still answers its
        callers."""
        self._calls.pop(key, None)

    def _finished(self, key: Hashable, task: asyncio.Task[Any]) -> None:
        if self._calls.get(key) is task:  # not a newer execution started after forget()
            del self._calls[key]
        if not task.cancelled():
            task.exception()  # mark it retrieved even if every waiter went away


class RecordCache:
    """Rows read through a Redis cache: each key's entry beside a version counter that every
    write bumps, so a load that started before a write never caches what it read."""

    def __init__(
        self,
        redis: aioredis.Redis,
        db: Database,
        settings: Settings,
        metrics: Metrics,
        breaker: RedisBreaker,
    ) -> None:
        self.redis = redis
        self.db = db
        self.settings = settings
        self.metrics = metrics
        self.breaker = breaker
        # Per filter: two guarded tables may both have a row "42".
        self._prefix = f"{settings.key_prefix}app:cache:{settings.records_filter}:"
        self._set_if_unchanged = FlushSafeScript(redis, _SET_IF_UNCHANGED)
        self._forget = FlushSafeScript(redis, _FORGET)
        self._flight = SingleFlight()
        # A cluster takes a script's keys from one slot only; records spread over slots.
        self._cluster = isinstance(redis, RedisCluster)

    @property
    def enabled(self) -> bool:
        """Whether anything is cached at all (negative entries or rows)."""
        return self.settings.negative_ttl > 0 or self.settings.cache_ttl > 0

    def _keys(self, key: str) -> tuple[str, str]:
        # Hash tag on the record key: both keys share a slot, records spread over the cluster.
        base = f"{self._prefix}{{{key}}}"
        return base + ":v", base

    async def get(self, key: str, *, suspect: bool = False) -> tuple[bool, Any]:
        """(found, value). `suspect`: the filter said "maybe", so a miss is a false positive."""
        version_key, cache_key = self._keys(key)
        version: bytes | str | None = UNKNOWN
        cached = None
        if self.enabled and not self.breaker.open:
            try:
                version, cached = await self.redis.mget(version_key, cache_key)
            except RedisUnreachable:
                self._failed()
        if cached is not None:
            negative = cached == _NEGATIVE
            self.metrics.cache_hit(negative)
            return (False, None) if negative else (True, json.loads(cached[1:]))
        # Keyed by the version too: a load that started before a write acknowledged to this
        # caller read an older version (and maybe the older row), so it is not joined.
        raw = await self._flight.do((key, version), lambda: self._load(key, version, suspect))
        return (False, None) if raw is None else (True, json.loads(raw))

    async def _load(self, key: str, version: bytes | str | None, suspect: bool) -> str | None:
        """The row, cached unless `version` (read before the query) changed since."""
        version_key, cache_key = self._keys(key)
        raw = await self.db.get(key)
        if version == UNKNOWN:
            return raw  # Redis gone: nothing to cache into either
        if raw is None:
            if suspect:
                self.metrics.decision("false_positive")
            # Jitter: a burst of false positives must not expire (and reload) all at once.
            ttl = self.settings.negative_ttl * random.uniform(0.9, 1.1)
            entry = _NEGATIVE
        else:
            ttl = self.settings.cache_ttl
            entry = b"+" + raw.encode()
        if ttl <= 0:
            return raw
        try:
            await self._set_if_unchanged(
                keys=[version_key, cache_key], args=[version or b"", max(1, int(ttl * 1000)), entry]
            )
        except RedisUnreachable:
            self._failed()
        return raw

    def _failed(self) -> None:
        # Reads skip the cache for a while: against a Redis that is black-holed rather than
        # refusing, every cache call would otherwise add a socket timeout to every read.
        self.metrics.redis_error("cache")
        self.breaker.trip()

    async def invalidate(self, key: str) -> None:
        """Drop the cached entry and bump the version so an in-flight load won't re-cache it."""
        version_key, cache_key = self._keys(key)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.incr(version_key)
            pipe.pexpire(version_key, _VERSION_TTL_MS)
            pipe.delete(cache_key)
            await pipe.execute()

    async def changed(self, changes: Sequence[Change]) -> None:
        """Before the filter applies `changes`: drop their keys' entries, and bump their
        versions so that a load in flight does not cache what it read before the change."""
        keys: list[str] = []
        for change in changes:
            item = change.item
            keys.extend(self._keys(item if isinstance(item, str) else item.decode()))
        if self._cluster:
            async with self.redis.pipeline(transaction=False) as pipe:
                for version_key, cache_key in zip(keys[::2], keys[1::2], strict=True):
                    pipe.incr(version_key)
                    pipe.pexpire(version_key, _VERSION_TTL_MS)
                    pipe.delete(cache_key)
                await pipe.execute()
        elif keys:
            await self._forget(keys=keys, args=[_VERSION_TTL_MS])

    async def written(self, key: str) -> None:
        """After a write of `key` committed: loads started without Redis (version unknown)
        may predate it, and the entry goes again."""
        self._flight.forget((key, UNKNOWN))
        # The first invalidation proved Redis was up; if it died since, the write stands and
        # the entry will expire on its own.
        try:
            await self.invalidate(key)
        except RedisUnreachable:
            self.metrics.redis_error("cache")
            log.warning("could not invalidate cache for %r after write", key)
