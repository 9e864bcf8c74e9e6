"""The records filter follows the database's change feed: replay in order, and a follower.

Every Database gives each committed change of the guarded table a gapless position, in commit
order for changes of one key (app/db). The filter stores the position of the last change it
applied (guard/changes.py), so following the feed is: read the changes after the filter's
``applied``, apply them with ``apply_changes``, which skips whatever an earlier call already
applied. A follower that crashes and replays, or two followers (two service workers, ``guard
follow``) working at once, apply each change exactly once.

``replay`` is that loop, used by rebuilds (to bring a staging copy from its snapshot to now)
and by the ``Follower``, which runs it whenever the database reports a new change, for a
service write that waits for its own change (``sync``), and compacts the log behind itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from app.db import Database
from app.settings import Settings
from guard import ChangeSourceError, CuckooFilter, FilterNotFoundError
from guard.changes import Change

log = logging.getLogger(__name__)

IDLE_WAIT_S = 1.0  # the follower re-reads the filter's id at least this often
RETRY_S = 1.0  # after a failure, the follower tries again this much later


class NeedsRebuild(RuntimeError):
    """The filter cannot follow the change log from where it stands: rebuild it from the
    table (``RecordStore.rebuild()``). Subclasses say why."""


class FilterMissing(NeedsRebuild):
    """The filter does not exist (never built, dropped, or Redis lost it)."""

    def __init__(self, name: str) -> None:
        super().__init__(f"filter {name!r} does not exist: rebuild it from the table")
        self.filter = name


class ReplayImpossible(NeedsRebuild):
    """The log no longer holds the changes right after the filter's ``applied``."""

    def __init__(self, name: str, applied: int, oldest: int) -> None:
        super().__init__(
            f"filter {name!r} stands at change {applied}, but the change log starts at "
            f"{oldest}: the changes in between are compacted away; rebuild it from the table"
        )
        self.filter, self.applied, self.oldest = name, applied, oldest


class OtherSource(NeedsRebuild):
    """The filter follows another change log (another database, or the log re-installed)."""

    def __init__(self, error: ChangeSourceError) -> None:
        super().__init__(f"{error} from this table")
        self.filter = error.filter


# Awaited with the filter's ``applied`` as a replay read it, before anything after it is applied
# (the watchdog judges an id that went back before the replay mends it).
Observer = Callable[[int], Awaitable[None]]
# Awaited with each batch of changes before it is applied (the caches drop what it changes).
BeforeApply = Callable[[list[Change]], Awaitable[None]]


async def applied_of(cf: CuckooFilter) -> int:
    """The filter's ``applied``; FilterMissing when there is no filter."""
    try:
        return await cf.applied_change()
    except FilterNotFoundError:
        raise FilterMissing(cf.name) from None


async def replay(
    cf: CuckooFilter,
    db: Database,
    source: int,
    *,
    batch: int,
    upto: int | None = None,
    observe: Observer | None = None,
    after: int | None = None,
    before_apply: BeforeApply | None = None,
) -> int:
    """Apply the feed's committed changes after ``cf``'s ``applied``, in batches, up to
    ``upto`` (None: until the feed has no more); return the filter's ``applied``.

    Raises FilterMissing, OtherSource, or ReplayImpossible when the log was compacted past
    the filter's id. Another caller applying the same changes meanwhile is harmless: the
    script skips what is done, and a gap (the filter moved, backwards or forwards) makes
    this read the log again from the filter's id. ``after``: where the filter stood a moment
    ago, read from the log without asking the filter first (a wrong guess costs a gap).
    ``observe`` is awaited with the filter's id each time it is read from the filter (at the
    start, or from a gap), before anything is applied after it. ``before_apply`` is awaited
    with each batch before it is applied.
    """
    applied = await applied_of(cf) if after is None else after
    if observe is not None and after is None:
        await observe(applied)
    rereads = 0
    while upto is None or applied < upto:
        limit = batch if upto is None else min(batch, upto - applied)
        changes = await db.changes_after(applied, limit)
        if not changes or changes[0].id != applied + 1:
            oldest = await db.oldest_change()
            if applied + 1 < oldest:
                raise ReplayImpossible(cf.name, applied, oldest)
            if not changes:
                return applied  # the end of the feed
            # Compacted between the two reads: the next read tells. A log that keeps
            # answering out of order is broken, not racing.
            rereads += 1
            if rereads > 3:
                raise RuntimeError(f"change log answered change {changes[0].id} after {applied}")
            continue
        if before_apply is not None:
            await before_apply(changes)
        try:
            result = await cf.apply_changes(changes, source=source)
        except ChangeSourceError as exc:
            raise OtherSource(exc) from None
        except FilterNotFoundError:
            raise FilterMissing(cf.name) from None
        applied = result.applied
        if result.gap and observe is not None:
            await observe(applied)
    return applied


class Follower:
    """Keeps one filter on the change feed: ``run()`` applies each change as the database
    reports it (``wait_for_change``), and compacts the log behind the filter.

    ``sync()`` returns once every change committed before the call is applied (a service
    write waits for its own change with it; callers at once share one round). ``catch_up()``
    is the same from the filter's own id (the watchdog's repair). ``problem`` is the reason
    the last attempt could not follow the feed (a NeedsRebuild or any other exception), None
    when it could. ``pinned`` answers the position a running rebuild's snapshot still needs
    (the log is never compacted past it), None when no rebuild runs.
    ``on_needs_rebuild``, when given, is awaited with the reason whenever the filter cannot
    follow (``guard follow`` rebuilds there; in the service the watchdog decides).
    ``watch(observer)`` registers who sees the filter's id as each replay reads it, and
    ``on_failure(callback)`` who hears at once of a round that failed (the watchdog stops
    trusting a filter that cannot take a change); ``before_apply`` is awaited with each batch
    before it is applied.
    """

    def __init__(
        self,
        cf: CuckooFilter,
        db: Database,
        settings: Settings,
        pinned: Callable[[], Awaitable[int | None]] | None = None,
        on_needs_rebuild: Callable[[NeedsRebuild], Awaitable[None]] | None = None,
        before_apply: BeforeApply | None = None,
    ) -> None:
        self.cf = cf
        self.db = db
        self.batch = settings.feed_batch
        self.retain = settings.feed_retain
        self.compact_every = settings.feed_compact_interval
        self.pinned = pinned
        self.on_needs_rebuild = on_needs_rebuild
        self.before_apply = before_apply
        self.problem: Exception | None = None
        self.applied = 0  # the filter's id after the last successful round
        self.compacted = 0  # the log was compacted up to this id (by this follower)
        self._source: int | None = None
        self._observers: list[Observer] = []
        self._failure_callbacks: list[Callable[[Exception], Awaitable[None]]] = []
        # Rounds: one at a time; a caller of sync() waits for one that began after its call.
        self._round = asyncio.Lock()
        self._rounds_begun = 0
        self._rounds_done = 0

    @asynccontextmanager
    async def paused(self) -> AsyncIterator[None]:
        """No round of this follower runs during the block (a rebuild's promote)."""
        async with self._round:
            yield

    def watch(self, observer: Observer) -> None:
        """``observer(applied)`` is awaited whenever a replay reads the filter's id, before it
        applies anything after it."""
        self._observers.append(observer)

    def on_failure(self, callback: Callable[[Exception], Awaitable[None]]) -> None:
        """``callback(exc)`` is awaited when a round fails, before the failure is raised."""
        self._failure_callbacks.append(callback)

    async def _observe(self, applied: int) -> None:
        for observer in self._observers:
            await observer(applied)

    async def source(self) -> int:
        if self._source is None:
            self._source = await self.db.feed_source()
        return self._source

    async def catch_up(self) -> int:
        """Apply every change committed now, reading the filter's id first; return the
        filter's ``applied``. Raises a NeedsRebuild (FilterMissing, ReplayImpossible,
        OtherSource) when the filter cannot follow the feed."""
        return await self._sync(from_filter=True)

    async def sync(self) -> int:
        """Return once every change committed before this call is applied (the filter's
        ``applied`` then); raises as catch_up() does."""
        return await self._sync(from_filter=False)

    async def _sync(self, *, from_filter: bool) -> int:
        wanted = self._rounds_begun + 1  # a round that begins after this call
        async with self._round:
            if self._rounds_done >= wanted and not from_filter:
                return self.applied
            self._rounds_begun += 1
            begun = self._rounds_begun
            await self._one_round(None if from_filter or self.problem else self.applied)
            self._rounds_done = begun
            return self.applied

    async def _advance(self, newest: int) -> int:
        """Apply the changes up to ``newest`` (a tick just taken) from where our last round
        left the filter. Not a round sync() callers can share: its tick may predate them."""
        async with self._round:
            await self._one_round(None if self.problem else self.applied, newest)
            return self.applied

    async def _one_round(self, after: int | None, newest: int | None = None) -> None:
        """Apply the changes up to ``newest`` (None: ticked now), starting from ``after``
        (where the filter stood after our last round) or, if None, from the filter's own id."""
        try:
            source = await self.source()
            if newest is None:
                newest = await self.db.newest_change()
            self.applied = await replay(
                self.cf, self.db, source, batch=self.batch, upto=newest, after=after,
                observe=self._observe, before_apply=self.before_apply,
            )  # fmt: skip
        except Exception as exc:
            if isinstance(exc, OtherSource):
                self._source = None  # read again next time: the log may have been re-installed
            for callback in self._failure_callbacks:
                await callback(exc)
            raise

    async def compact(self) -> int:
        """Delete log rows the filter has passed, keeping the newest GUARD_FEED_RETAIN of
        those and whatever a running rebuild still needs; the rows deleted."""
        # Read in this order: a rebuild that takes its snapshot after these reads gets an id
        # at least `newest`, so compacting to min(applied, newest) cannot reach past it.
        applied = await applied_of(self.cf)
        upto = min(applied, await self.db.newest_change())
        pinned = await self.pinned() if self.pinned is not None else None
        if pinned is not None:
            upto = min(upto, pinned)
        upto -= self.retain
        if upto <= self.compacted:
            return 0
        deleted = await self.db.compact(upto)
        self.compacted = upto
        return deleted

    async def run(self) -> None:
        """Follow the feed until cancelled; failures are logged once each and retried."""
        last_compaction = 0.0
        newest: int | None = None
        while True:
            _stop_if_cancelled()
            try:
                # After a tick that found changes: read the feed up to it, from where the
                # filter stood after our last round (one round trip less per change). Otherwise
                # (a timeout, a failure) ask the filter: it may have been restored from an
                # older copy meanwhile.
                applied = await (self.catch_up() if newest is None else self._advance(newest))
                if time.monotonic() - last_compaction >= self.compact_every:
                    last_compaction = time.monotonic()
                    await self.compact()
                _stop_if_cancelled()
                if self.problem is not None:
                    log.info("filter %s follows the change feed again (at %d)", self.cf.name,
                             applied)  # fmt: skip
                    self.problem = None
                newest = await self.db.wait_for_change(applied, IDLE_WAIT_S)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the database or Redis away, the filter unfit: retried
                _stop_if_cancelled()
                newest = None
                await self._failed(exc)
                await asyncio.sleep(RETRY_S)

    async def _failed(self, exc: Exception) -> None:
        if repr(exc) != repr(self.problem):  # once per distinct failure, not every second
            if isinstance(exc, NeedsRebuild):
                log.warning("change feed: %s", exc)
            else:
                log.warning("change feed: %s: %r; retrying", self.cf.name, exc)
        self.problem = exc
        if isinstance(exc, NeedsRebuild) and self.on_needs_rebuild is not None:
            try:
                await self.on_needs_rebuild(exc)
            except Exception as again:
                log.warning("change feed: rebuild of %s failed: %r", self.cf.name, again)


def _stop_if_cancelled() -> None:
    """Raise the cancellation a Redis command swallowed: redis-py's asyncio client lets a
    command that was cancelled run to its end and return normally (so that its connection
    stays in step), and the task goes on with its cancellation pending."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
