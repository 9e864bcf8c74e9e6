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
# A key's version lives while loads of it may be in flight: a load that takes longer finds it
# gone and does not cache what it read (a version is random, so a newer one never matches).
_VERSION_TTL_MS = 60_000
UNKNOWN = b"?"  # the version when Redis could not be asked (never a stored version)

# KEYS[1] the key's version, KEYS[2] its cache entry
# ARGV[1] a new random version, ARGV[2] the version's TTL in milliseconds
# Reply: {false, entry} when cached; else {version, false}: the version a load must still find
# when it stores what it read, made now from ARGV[1] when no load in flight made one. Only a
# miss writes, and only loads leave versions behind (a change does not: it deletes them).
_READ = """
local entry = redis.call('GET', KEYS[2])
if entry then return {false, entry} end
local version = redis.call('GET', KEYS[1])
if not version then
  version = ARGV[1]
  redis.call('SET', KEYS[1], version, 'PX', ARGV[2])
end
return {version, false}
"""

# KEYS[1] the key's version, KEYS[2] its cache entry
# ARGV[1] the version the load began with
# ARGV[2] the entry's TTL in milliseconds, ARGV[3] the entry
# Reply: 1 stored; 0 a change deleted the version meanwhile, so the loaded value may be stale.
_SET_IF_UNCHANGED = """
local seen = redis.call('GET', KEYS[1]) or ''
if seen ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[2])
return 1
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
    """Rows read through a Redis cache: a load registers a random version beside the key's
    entry, and stores what it read only if that version is still there; a change deletes
    both, so a load that started before a change never caches what it read. (Versions
    bumped by every change instead outlived it: an hour of every changed key's counter in
    Redis.)"""

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
        self._read = FlushSafeScript(redis, _READ)
        self._set_if_unchanged = FlushSafeScript(redis, _SET_IF_UNCHANGED)
        self._flight = SingleFlight()

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
                # A number: a process of an earlier version, during a rolling upgrade,
                # bumps versions with INCR.
                version, cached = await self._read(
                    keys=[version_key, cache_key], args=[random.getrandbits(62), _VERSION_TTL_MS]
                )
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
        """Drop the cached entry and the version, so an in-flight load won't re-cache it."""
        await self.redis.delete(*self._keys(key))

    async def changed(self, changes: Sequence[Change]) -> None:
        """Before the filter applies `changes`: drop their keys' entries and versions, so that
        a load in flight does not cache what it read before the change."""
        keys: list[str] = []
        for change in changes:
            item = change.item
            keys.extend(self._keys(item if isinstance(item, str) else item.decode()))
        if keys:
            # One command (a cluster client splits it by slot).
            await self.redis.delete(*keys)

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
