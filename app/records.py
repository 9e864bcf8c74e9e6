"""Guarded records: read-through cache, single-flight loads, a filter that follows the table."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import uuid
from collections.abc import Awaitable, Callable, Hashable
from contextlib import suppress
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import LockError

from app.db import ChangeHook, Database
from app.metrics import Metrics
from app.redis_conn import FlushSafeLock, FlushSafeScript
from app.settings import Settings
from guard import CuckooFilter, FilterInfo, FilterNotFoundError
from guard.breaker import RedisBreaker
from guard.changes import Change
from guard.errors import RedisUnreachable

log = logging.getLogger(__name__)

# Cache entries: b"+" + the row's JSON text, or b"-" for "no such row" (negative entry).
_NEGATIVE = b"-"
_VERSION_TTL_MS = 3_600_000  # far longer than any read that could still be in flight
_UNKNOWN = b"?"  # the version when Redis could not be asked (never a counter's value)

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


class RebuildInProgress(Exception):
    """Another rebuild of this filter holds the lock."""


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
        # Rebuilds write a whole filter: on the client with the admin timeout.
        self.admin = admin if admin is not None else redis
        self.db = db
        self.settings = settings
        self.metrics = metrics
        prefix = settings.key_prefix
        self.filter = CuckooFilter(
            redis, settings.records_filter, prefix=prefix, coalesce=settings.lookup_coalescing
        )
        self.staging = CuckooFilter(self.admin, settings.records_filter, prefix=prefix).staging()
        self._writers_staging = self.filter.staging()
        tag = "{" + settings.records_filter + "}"
        # Set (under the database's write barrier) once the rebuild's snapshot is taken:
        # from then on writers must also apply their change to the staging copy.
        self._snapshot_flag = f"{prefix}app:rebuild:{tag}:snapshot"
        self._journal = f"{prefix}app:rebuild:{tag}:deletes"
        self._rebuild_lock = f"{prefix}app:rebuild:{tag}:lock"
        self._cache_prefix = f"{prefix}app:cache:"
        self._set_if_unchanged = FlushSafeScript(redis, _SET_IF_UNCHANGED)
        self._flight = SingleFlight()
        # Shared with the guard middleware: a failed guard lookup spares the cache read.
        self.breaker = breaker if breaker is not None else RedisBreaker(settings.redis_cooldown)

    # ---- reads -------------------------------------------------------------------------

    def _keys(self, key: str) -> tuple[str, str]:
        # Hash tag on the record key: both keys share a slot, records spread over the cluster.
        base = f"{self._cache_prefix}{{{key}}}"
        return base + ":v", base

    async def get(self, key: str, *, suspect: bool = False) -> tuple[bool, Any]:
        """(found, value). `suspect`: the filter said "maybe", so a miss is a false positive."""
        version_key, cache_key = self._keys(key)
        version: bytes | str | None = _UNKNOWN
        cached = None
        if self._cache_usable():
            try:
                version, cached = await self.redis.mget(version_key, cache_key)
            except RedisUnreachable:
                self._cache_failed()
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
        if version == _UNKNOWN:
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
        try:
            await self._set_if_unchanged(
                keys=[version_key, cache_key], args=[version or b"", max(1, int(ttl * 1000)), entry]
            )
        except RedisUnreachable:
            self._cache_failed()
        return raw

    def _cache_usable(self) -> bool:
        return not self.breaker.open

    def _cache_failed(self) -> None:
        # Reads skip the cache for a while: against a Redis that is black-holed rather than
        # refusing, every cache call would otherwise add a socket timeout to every read.
        self.metrics.redis_error("cache")
        self.breaker.trip()

    async def _invalidate(self, key: str) -> None:
        """Drop the cached entry and bump the version so an in-flight load won't re-cache it."""
        version_key, cache_key = self._keys(key)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.incr(version_key)
            pipe.pexpire(version_key, _VERSION_TTL_MS)
            pipe.delete(cache_key)
            await pipe.execute()

    # ---- writes ------------------------------------------------------------------------
    #
    # The filter changes inside the database's write transaction: before the new row becomes
    # visible, and after the DELETE statement confirmed a row but before it commits. Holding
    # the write lock there is what lets a rebuild swap filters with no writer half-way (its
    # barrier waits for us). If the commit then fails, the filter change is undone.

    async def put(self, key: str, value: Any) -> bool:
        """Insert or replace; True if the row is new. Redis down → raises before any write."""
        # allow_nan=False: NaN is no JSON, and must fail here, before any write.
        raw = json.dumps(value, separators=(",", ":"), allow_nan=False)
        return await self._write(key, add=True, write=lambda hook: self.db.put(key, raw, hook))

    async def delete(self, key: str) -> bool:
        """Delete; True if a row was deleted. Redis down → raises before any write."""
        return await self._write(key, add=False, write=lambda hook: self.db.delete(key, hook))

    async def _write(
        self, key: str, *, add: bool, write: Callable[[ChangeHook], Awaitable[bool]]
    ) -> bool:
        """Run a database write whose hook changes the filter inside its transaction (see
        above); if the transaction then fails, the filter change is undone."""
        await self._invalidate(key)
        applied = False

        async def apply(_change: Change) -> None:
            nonlocal applied
            try:
                await self._filters_apply(key, add=add)
            except RedisUnreachable:
                # No answer: the change may have happened anyway. A delete that did would
                # leave the row, once rolled back, without its fingerprint (a false negative),
                # so it is put back; an insert that did adds a false positive at worst, and
                # undoing it could remove another key's fingerprint.
                applied = not add
                raise
            applied = True

        try:
            changed = await write(apply)
        except BaseException:
            if applied:
                await self._undo(key, add=add)
            raise
        # A load started without Redis (version unknown) may predate this write.
        self._flight.forget((key, _UNKNOWN))
        await self._invalidate_after_write(key)
        return changed

    async def _filters_apply(self, key: str, *, add: bool) -> None:
        """Apply one row change to the live filter, and to a rebuild's staging copy once the
        rebuild took its snapshot (changes before that are in the snapshot itself)."""
        rebuilding = await self.redis.exists(self._snapshot_flag)
        try:
            if add:
                await self.filter.insert(key)
            elif not await self.filter.delete(key):
                log.warning("%s: no fingerprint for deleted row %r", self.filter.name, key)
        except FilterNotFoundError:
            # No live filter yet (first build running) or it was dropped: a missing filter
            # blocks nothing, and the next rebuild reads the table.
            pass
        if not rebuilding:
            return
        if add:
            with suppress(FilterNotFoundError):  # the rebuild was aborted
                await self._writers_staging.insert(key)
        else:
            # The snapshot's keys may not all be in staging yet, and deleting an item a cuckoo
            # filter never got can remove another item's fingerprint (a false negative), so
            # the rebuild applies these deletes once its load is complete.
            await self.redis.rpush(self._journal, key)

    async def _undo(self, key: str, *, add: bool) -> None:
        try:
            await self._filters_apply(key, add=not add)
        except Exception:
            log.exception("could not undo filter change for %r; rebuild to repair", key)

    async def _invalidate_after_write(self, key: str) -> None:
        # The first invalidation proved Redis was up; if it died since, the write stands and
        # the entry will expire on its own.
        try:
            await self._invalidate(key)
        except RedisUnreachable:
            self.metrics.redis_error("cache")
            log.warning("could not invalidate cache for %r after write", key)

    # ---- rebuild -----------------------------------------------------------------------

    async def rebuild(self) -> FilterInfo:
        """Build the filter from the table into a staging copy and swap it in atomically.

        Readers use the old filter until the swap, so no present key ever reads as absent.
        """
        lock = self.admin.lock(
            self._rebuild_lock, timeout=600, blocking=False, lock_class=FlushSafeLock
        )
        if not await lock.acquire(token=uuid.uuid4().hex):
            raise RebuildInProgress(f"a rebuild of {self.filter.name!r} is already running")
        try:
            await self._build(lock)
        except BaseException:
            await asyncio.shield(self._abort())
            raise
        finally:
            try:
                await lock.release()
            except (LockError, *RedisUnreachable):
                pass
        return await self.filter.info()

    async def _build(self, lock: Any) -> None:
        async with self.db.write_barrier():  # leftovers of a crashed rebuild
            await self.redis.delete(self._snapshot_flag, self._journal)
            await self.staging.drop()
        rows = await self.db.count()
        capacity = self.settings.capacity_for(rows)
        await self.staging.reserve(capacity, error_rate=self.settings.records_error_rate)

        async def mark_snapshot(_change_id: int) -> None:
            await self.redis.set(self._snapshot_flag, b"1")

        async for batch in self.db.iter_keys(self.settings.rebuild_batch, mark_snapshot):
            await self.staging.insert_many(batch)
            await lock.reacquire()  # a long build keeps its lock
        await self._drain_deletes()  # most of them, without holding writers off
        async with self.db.write_barrier():
            await self._drain_deletes()
            await self.staging.promote()
            await self.redis.delete(self._snapshot_flag, self._journal)
        log.info("filter %s rebuilt from %d rows (capacity %d)", self.filter.name, rows, capacity)

    async def _drain_deletes(self) -> None:
        while True:
            keys: list[bytes] | None = await self.redis.lpop(  # type: ignore[assignment]
                self._journal, self.settings.rebuild_batch
            )
            if not keys:
                return
            await self.staging.delete_many(keys)

    async def _abort(self) -> None:
        try:
            async with self.db.write_barrier():
                await self.redis.delete(self._snapshot_flag, self._journal)
                await self.staging.drop()
        except Exception:
            log.exception("could not clean up after a failed rebuild")
