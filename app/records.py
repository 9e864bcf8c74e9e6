"""Guarded records: reads through the cache, writes the filter follows, rebuilds, the watchdog.

Each job has its module: app/cache.py (read-through cache, single-flight loads), app/feed.py
(following the database's change feed, whoever writes), app/rebuild.py (the filter made again
from the table), app/watchdog.py (knowing when the filter cannot be trusted, and repairing
it). A ``RecordStore`` puts them together for one table, and ``RecordStore.running`` runs
its background work (start-up rebuild, follower, watchdog) for as long as a block lasts.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager, suppress
from typing import Any, TypeVar

import redis.asyncio as aioredis

from app.cache import RecordCache
from app.db import Database, Stored
from app.feed import Follower, NeedsRebuild
from app.metrics import Metrics
from app.rebuild import Rebuild, RebuildInProgress
from app.settings import Settings
from app.tasks import cancel
from app.watchdog import Watchdog, WatchdogSettings
from guard import CuckooFilter, FilterInfo, FilterNotFoundError
from guard.breaker import RedisBreaker
from guard.errors import RedisUnreachable

__all__ = ["RebuildInProgress", "RecordStore", "Tables"]

log = logging.getLogger(__name__)
T = TypeVar("T")
REBUILD_RETRY_S = 5.0  # a start-up rebuild that found Redis away tries again this often


class RecordStore:
    """Reads and writes of the records table, keeping cache and filter in step with it.

    A write commits in the database first; its change then reaches the filter through the
    change feed like anyone else's, and the write waits for that (``Follower.sync``) before
    it answers: a write acknowledged to its caller is in the filter, and applied once.
    """

    def __init__(
        self,
        redis: aioredis.Redis,
        db: Database,
        settings: Settings,
        metrics: Metrics,
        breaker: RedisBreaker | None = None,
        admin: aioredis.Redis | None = None,
        on_needs_rebuild: Callable[[NeedsRebuild], Awaitable[None]] | None = None,
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
        self.cache = RecordCache(redis, db, settings, metrics, self.breaker)
        # Every change applied drops what the caches hold of its key, in every process.
        forget = self.cache.changed if self.cache.enabled else None
        self.rebuilder = Rebuild(
            admin if admin is not None else redis,
            db,
            settings,
            paused=self._paused,
            before_apply=forget,
        )
        self.follower = Follower(
            self.filter,
            db,
            settings,
            pinned=self.rebuilder.pinned,
            on_needs_rebuild=on_needs_rebuild,
            before_apply=forget,
        )
        self.staging = self.rebuilder.staging
        self.watchdog: Watchdog | None = None  # set by running() when GUARD_WATCHDOG is on

    @asynccontextmanager
    async def running(self) -> AsyncIterator[RecordStore]:
        """This store, its background work running during the block: the start-up rebuild
        (retried while Redis is away), the follower (GUARD_FEED; with it off here, `guard
        follow` elsewhere, the follower still serves this process's writes and the
        watchdog's repairs) and the watchdog (GUARD_WATCHDOG)."""
        async with AsyncExitStack() as stack:
            if self.settings.rebuild_on_startup and not await self._rebuild_once():
                stack.push_async_callback(cancel, asyncio.create_task(self._rebuild_later()))
            if self.settings.feed:
                stack.push_async_callback(cancel, asyncio.create_task(self.follower.run()))
            if self.settings.watchdog:
                self.watchdog = self._watchdog()
                await self.watchdog.start()
                stack.push_async_callback(cancel, asyncio.create_task(self.watchdog.run()))
            yield self

    def _watchdog(self) -> Watchdog:
        cfg = self.settings
        watchdog = Watchdog(
            self.filter,
            self.db,
            rebuild=self.rebuild,
            catch_up=self.follower.catch_up,
            settings=WatchdogSettings(
                interval=cfg.watchdog_interval,
                max_lag=cfg.watchdog_max_lag,
                audit_interval=cfg.audit_interval,
                audit_sample=cfg.audit_sample,
            ),
            metrics=self.metrics,
        )
        # A replay about to mend a rolled-back filter shows the watchdog its id first; a
        # change the filter had no room for makes it stale at once.
        self.follower.watch(watchdog.observe)
        self.follower.on_failure(watchdog.follower_failed)
        return watchdog

    async def _rebuild_once(self) -> bool:
        """One start-up rebuild attempt; False when Redis is unreachable."""
        try:
            await self.rebuild()
        except RebuildInProgress:
            log.info("records filter: another process is rebuilding it")
        except RedisUnreachable as exc:
            log.warning(
                "records filter rebuild failed (%r); retrying every %.0f s", exc, REBUILD_RETRY_S
            )
            return False
        return True

    async def _rebuild_later(self) -> None:
        """Keep trying in the background while Redis is down (the guard fails open meanwhile,
        so the service stays usable; readers never see the half-built filter)."""
        while True:
            await asyncio.sleep(REBUILD_RETRY_S)
            try:
                await self.rebuild()
                log.info("records filter rebuilt after Redis came back")
                return
            except RebuildInProgress:
                return
            except RedisUnreachable:
                continue

    def _paused(self) -> Any:
        return self.follower.paused()

    async def get(self, key: str, *, suspect: bool = False) -> tuple[bool, Any]:
        """(found, value). `suspect`: the filter said "maybe", so a miss is a false positive."""
        return await self.cache.get(key, suspect=suspect)

    async def put(self, key: str, value: Any) -> tuple[bool, Any]:
        """Insert or replace; (whether the row is new, the row as stored). Redis down →
        raises before anything is written."""
        # allow_nan=False: NaN is no JSON, and must fail here, before any write.
        raw = json.dumps(value, separators=(",", ":"), allow_nan=False)
        stored: Stored = await self._write(key, lambda: self.db.put(key, raw), lambda s: s.created)
        return stored.created, json.loads(stored.record)

    async def delete(self, key: str) -> bool:
        """Delete; True if a row was deleted. Redis down → raises before anything is written."""
        return await self._write(key, lambda: self.db.delete(key), bool)

    async def _write(
        self, key: str, write: Callable[[], Awaitable[T]], changed_key: Callable[[T], bool]
    ) -> T:
        # Invalidated before (Redis up, or nothing is written) and after the write.
        await self.cache.invalidate(key)
        result = await write()
        if changed_key(result):
            await self._synced(key, insert=isinstance(result, Stored))
        await self.cache.written(key)
        return result

    async def _synced(self, key: str, insert: bool) -> None:
        """Wait until the filter applied the write's change (and every one before it). The
        write is committed whatever happens here: nothing raises."""
        try:
            await self.follower.sync()
        except NeedsRebuild as exc:
            # The filter cannot follow the feed (the watchdog rebuilds it): a new key goes in
            # as a plain insert meanwhile, an extra fingerprint the rebuild drops.
            log.warning("write of %r: %s", key, exc)
            if insert:
                with suppress(FilterNotFoundError, *RedisUnreachable):
                    await self.filter.insert(key)
        except Exception as exc:  # Redis or the database away after the commit
            log.warning("write of %r is committed; the filter follows once the feed can (%r)",
                        key, exc)  # fmt: skip

    async def rebuild(self) -> FilterInfo:
        """Build the filter from the table and swap it in atomically (app/rebuild.py).

        Readers use the old filter until the swap, so no present key ever reads as absent.
        """
        return await self.rebuilder.run()


class Tables:
    """The records subsystems of one service, one per guarded table (app/rules.py says which
    tables): ``primary`` is the one the /records routes read and write."""

    def __init__(self, stores: Sequence[RecordStore]) -> None:
        if not stores:
            raise ValueError("a service guards one table at least")
        self.stores = list(stores)
        self.primary = stores[0]
        self._by_table = {s.settings.records_table: s for s in stores}
        self._by_filter = {s.filter.name: s for s in stores}

    def __iter__(self) -> Iterator[RecordStore]:
        return iter(self.stores)

    def of_table(self, table: str | None) -> RecordStore | None:
        return self._by_table.get(table or "")

    def of_filter(self, name: str) -> RecordStore | None:
        """The store whose filter this is: a filter that follows a table."""
        return self._by_filter.get(name)

    @classmethod
    @asynccontextmanager
    async def running(
        cls,
        views: Sequence[Settings],
        clients: Any,
        metrics: Metrics,
        breaker: RedisBreaker,
        open_db: Callable[[Settings], Awaitable[Database]],
    ) -> AsyncIterator[Tables]:
        """A store per settings view (one per table), each on a database of its own and
        running its background work, for the block."""
        async with AsyncExitStack() as stack:
            stores = []
            for view in views:
                db = await open_db(view)
                stack.push_async_callback(db.close)
                seeded = await db.seed(view.demo_records)
                if seeded:
                    log.info("seeded %d demo records into %s", seeded, view.records_table)
                store = RecordStore(clients.main, db, view, metrics, breaker, clients.admin)
                stores.append(await stack.enter_async_context(store.running()))
            yield cls(stores)
