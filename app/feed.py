"""The records filter follows the database's change log: replay in id order, and a follower.

Every Database keeps a trigger-maintained log of the guarded table's changes, with gapless ids
that commit in id order (app/db). The filter stores the id of the last change it applied
(guard/changes.py), so following the log is: read the changes after the filter's ``applied``,
apply them with ``apply_changes``, which skips whatever an earlier call already applied. A
follower that crashes and replays, or two followers (two service workers, ``guard follow``)
working at once, apply each change exactly once.

``replay`` is that loop, used by service writes (to close a gap before their own change), by
rebuilds (to bring a staging copy from its snapshot to now) and by the ``Follower``, which
runs it whenever the database reports a new change and compacts the log behind itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from app.db import Database
from app.settings import Settings
from guard import ChangeSourceError, CuckooFilter, FilterNotFoundError

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


class FilterDiverged(NeedsRebuild):
    """The filter recorded a change the database rolled back (an undo that Redis did not
    take): its ``applied`` claims an id the database has since given to another change."""

    def __init__(self, name: str, change_id: int) -> None:
        super().__init__(
            f"filter {name!r} had already applied change {change_id} when a write made it: "
            "a rolled-back change was never undone; rebuild it from the table"
        )
        self.filter, self.change_id = name, change_id


@dataclass
class FeedState:
    """What this process knows about the filter that its bytes cannot tell: set by a write
    that found its own change already applied, cleared by a rebuild."""

    diverged: FilterDiverged | None = None
    # Awaited with the filter's id whenever a replay starts from it, before it mends
    # anything: the watchdog (app/watchdog.py) sees an id that went back (a filter restored
    # from an older copy) that the replay would otherwise repair unnoticed.
    observe: Callable[[int], Awaitable[None]] | None = None


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
    observe: Callable[[int], Awaitable[None]] | None = None,
    after: int | None = None,
) -> int:
    """Apply the log's committed changes after ``cf``'s ``applied``, in batches, up to
    ``upto`` (None: until the log has no more); return the filter's ``applied``.

    Raises FilterMissing, OtherSource, or ReplayImpossible when the log was compacted past
    the filter's id. Another caller applying the same changes meanwhile is harmless: the
    script skips what is done, and a gap (the filter moved, backwards or forwards) makes
    this read the log again from the filter's id. ``after``: where the filter stood a moment
    ago, read from the log without asking the filter first (a wrong guess costs a gap).
    ``observe`` is awaited with the filter's id each time it is read from the filter (at the
    start, or from a gap), before anything is applied after it.
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
                return applied
            # Compacted between the two reads: the next read tells. A log that keeps
            # answering out of order is broken, not racing.
            rereads += 1
            if rereads > 3:
                raise RuntimeError(f"change log answered change {changes[0].id} after {applied}")
            continue
        try:
            result = await cf.apply_changes(changes, source=source)
        except ChangeSourceError as exc:
            raise OtherSource(exc) from None
        except FilterNotFoundError:
            raise FilterMissing(cf.name) from None
        applied = result.applied
        if result.gap and observe is not None:
            await observe(applied)
        if upto is None and not result.gap and len(changes) < limit:
            return applied  # the end of the log as it was read
    return applied


class Follower:
    """Keeps one filter on the change log: ``run()`` applies each change as the database
    reports it (``wait_for_change``), and compacts the log behind the filter.

    ``catch_up()`` is the one-shot form (the watchdog's repair). ``problem`` is the reason
    the last attempt could not follow the log (a NeedsRebuild or any other exception), None
    when it could. ``pinned`` answers the id a running rebuild's snapshot still needs (the
    log is never compacted past it), None when no rebuild runs. ``on_needs_rebuild``, when
    given, is awaited with the reason whenever the filter cannot follow (``guard follow``
    rebuilds there; in the service the watchdog decides).
    """

    def __init__(
        self,
        cf: CuckooFilter,
        db: Database,
        settings: Settings,
        state: FeedState | None = None,
        pinned: Callable[[], Awaitable[int | None]] | None = None,
        on_needs_rebuild: Callable[[NeedsRebuild], Awaitable[None]] | None = None,
    ) -> None:
        self.cf = cf
        self.db = db
        self.batch = settings.feed_batch
        self.retain = settings.feed_retain
        self.compact_every = settings.feed_compact_interval
        self.state = state if state is not None else FeedState()
        self.pinned = pinned
        self.on_needs_rebuild = on_needs_rebuild
        self.problem: Exception | None = None
        self.applied = 0  # the filter's id after the last successful catch-up
        self.compacted = 0  # the log was compacted up to this id (by this follower)
        self._source: int | None = None

    async def source(self) -> int:
        if self._source is None:
            self._source = await self.db.feed_source()
        return self._source

    async def catch_up(self) -> int:
        """Apply every change committed now; return the filter's ``applied``. Raises a
        NeedsRebuild (FilterMissing, ReplayImpossible, OtherSource, FilterDiverged) when the
        filter cannot follow the log."""
        return await self._catch_up(None)

    async def _catch_up(self, after: int | None) -> int:
        if self.state.diverged is not None:
            raise self.state.diverged
        source = await self.source()
        try:
            self.applied = await replay(
                self.cf, self.db, source, batch=self.batch, observe=self.state.observe,
                after=after,
            )  # fmt: skip
        except OtherSource:
            self._source = None  # read again next time: the log may have been re-installed
            raise
        return self.applied

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
        """Follow the log until cancelled; failures are logged once each and retried."""
        last_compaction = 0.0
        woken = False
        while True:
            _stop_if_cancelled()
            try:
                # Woken by a change: read the log from where the filter stood after our last
                # call (one round trip less per change). Otherwise (a timeout, a failure)
                # ask the filter: it may have been restored from an older copy meanwhile.
                applied = await self._catch_up(self.applied if woken else None)
                if time.monotonic() - last_compaction >= self.compact_every:
                    last_compaction = time.monotonic()
                    await self.compact()
                _stop_if_cancelled()
                if self.problem is not None:
                    log.info("filter %s follows the change log again (at %d)", self.cf.name,
                             applied)  # fmt: skip
                    self.problem = None
                woken = await self.db.wait_for_change(applied, IDLE_WAIT_S)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the database or Redis away, the filter unfit: retried
                _stop_if_cancelled()
                woken = False
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
