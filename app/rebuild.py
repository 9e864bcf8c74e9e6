"""Rebuilding the records filter from its table: a bulk build of one snapshot, brought up to
date from the change feed, promoted once it has every change the live filter has."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, nullcontext
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import LockError

from app.db import Database
from app.feed import BeforeApply, replay
from app.redis_conn import FlushSafeLock
from app.settings import Settings
from guard import CuckooFilter, FilterInfo, StagingBehindError
from guard.errors import RedisUnreachable

log = logging.getLogger(__name__)

LOCK_S = 600  # a rebuild's lock (and its snapshot mark) lapse this long after its last sign
READ_AHEAD = 64  # pages of keys read from the database ahead of the builder
# Promote attempts refused because a follower of another process moved the live filter on
# (each is followed by a replay to where it stands); then one more that replaces it anyway.
PROMOTE_ATTEMPTS = 50


class RebuildInProgress(Exception):
    """Another rebuild of this filter holds the lock."""


class Rebuild:
    """Builds the filter from the table into its staging copy and swaps it in atomically.

    1. ``iter_keys`` gives the keys of one snapshot and the position of the newest change in
       it; the bulk builder (guard/bulk.py) makes the staging copy from them, with that
       position as its ``applied`` and the feed's ``source`` in its header;
    2. the copy applies the changes fed since, while writers go on (nothing holds them off);
    3. it is promoted with ``unless_behind``: the script refuses while the live filter (which
       followers keep moving) has applied more of the feed than the copy, and the copy
       catches up and tries again. The promoted copy has every change the live filter had.

    Writers and readers use only the live filter until the promote: no present key reads as
    absent at any point. ``paused()`` holds this process's follower between rounds while the
    copy catches up and is promoted (another process's follower is what the refusal is for).
    While a rebuild runs, its snapshot's position is kept in Redis (``pinned()``) so that no
    follower compacts the log past what the copy still needs.
    """

    def __init__(
        self,
        admin: aioredis.Redis,
        db: Database,
        settings: Settings,
        *,
        paused: Callable[[], AbstractAsyncContextManager[Any]] = nullcontext,
        before_apply: BeforeApply | None = None,
    ) -> None:
        self.admin = admin  # a whole filter is written: the admin client's timeout
        self.db = db
        self.settings = settings
        self.paused = paused
        self.before_apply = before_apply
        prefix = settings.key_prefix
        self.filter = CuckooFilter(admin, settings.records_filter, prefix=prefix)
        self.staging = self.filter.staging()
        tag = "{" + settings.records_filter + "}"
        self.lock_key = f"{prefix}app:rebuild:{tag}:lock"
        self.snapshot_key = f"{prefix}app:rebuild:{tag}:snapshot"

    async def pinned(self) -> int | None:
        """The snapshot id of a rebuild running now (in any process), else None."""
        raw = await self.admin.get(self.snapshot_key)
        return None if raw is None else int(raw)

    async def run(self) -> FilterInfo:
        """Rebuild; the new filter's info. RebuildInProgress when another one runs."""
        lock = self.admin.lock(
            self.lock_key, timeout=LOCK_S, blocking=False, lock_class=FlushSafeLock
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
        db, cfg = self.db, self.settings
        source = await db.feed_source()
        rows = await db.count()
        capacity = cfg.capacity_for(rows)
        snapshot: int | None = None

        async def at_snapshot(change_id: int) -> None:
            nonlocal snapshot
            snapshot = change_id
            await self.admin.set(self.snapshot_key, change_id, ex=LOCK_S)

        pages = db.iter_keys(cfg.rebuild_batch, at_snapshot)
        try:
            # The snapshot is taken when the first page is asked for; its id goes into the
            # header the builder writes, so it must be known before the build starts.
            first = await anext(pages, None)
            if snapshot is None:
                raise RuntimeError("the database's iter_keys took no snapshot")

            async def keys() -> AsyncIterator[list[str]]:
                if first is not None:
                    yield first
                signed = time.monotonic()
                async for page in _read_ahead(pages):
                    yield page
                    if time.monotonic() - signed > LOCK_S / 10:  # a long build keeps its lock
                        signed = time.monotonic()
                        await lock.reacquire()
                        await self.admin.expire(self.snapshot_key, LOCK_S)

            await self.filter.bulk_load(
                keys(),
                capacity,
                error_rate=cfg.records_error_rate,
                promote=False,
                applied=snapshot,
                source=source,
            )
        finally:
            await _close(pages)
        await self._promote(source)
        await self.admin.delete(self.snapshot_key)
        log.info(
            "filter %s rebuilt from %d rows (capacity %d, at change %d)",
            self.filter.name, rows, capacity, snapshot,
        )  # fmt: skip

    async def _promote(self, source: int) -> None:
        """Bring the copy up to the feed's newest change and promote it, unless the live
        filter has applied more meanwhile; then catch up to where it stands and try again. A
        live filter that stands past every change the feed has (the database lost commits)
        is replaced as it is."""

        async def catch_up(upto: int | None = None) -> int:
            return await replay(
                self.staging, self.db, source, batch=self.settings.feed_batch, upto=upto,
                before_apply=self.before_apply,
            )  # fmt: skip

        await catch_up()  # most of what was written meanwhile, before pausing anything
        async with self.paused():
            for _ in range(PROMOTE_ATTEMPTS):
                await catch_up()
                try:
                    await self.staging.promote(unless_behind=True)
                    return
                except StagingBehindError as exc:
                    if await catch_up(exc.live_applied) < exc.live_applied:
                        break  # the live filter is ahead of the database itself
            await self.staging.promote()

    async def _abort(self) -> None:
        # Writers never touch the staging copy: it goes without holding them off.
        try:
            await self.staging.drop()
            await self.admin.delete(self.snapshot_key)
        except Exception:
            log.exception("could not clean up after a failed rebuild")


async def _read_ahead(pages: AsyncIterator[list[str]]) -> AsyncIterator[list[str]]:
    """``pages``, read by a task of their own up to READ_AHEAD pages ahead: the database's
    reads go on while the builder hashes what it has (in a worker thread)."""
    queue: asyncio.Queue[list[str] | BaseException | None] = asyncio.Queue(READ_AHEAD)

    async def pump() -> None:
        try:
            async for page in pages:
                await queue.put(page)
        except BaseException as exc:  # handed to the reader, which raises it
            await queue.put(exc)
            return
        await queue.put(None)

    task = asyncio.create_task(pump())
    try:
        while (page := await queue.get()) is not None:
            if isinstance(page, BaseException):
                raise page
            yield page
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def _close(pages: AsyncIterator[list[str]]) -> None:
    """End the database's iteration (its snapshot) now, not when it is garbage-collected."""
    close = getattr(pages, "aclose", None)
    if close is not None:
        await close()
