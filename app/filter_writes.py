"""Service writes of records: the filter applies the write's own logged change inside its
database transaction, so a write acknowledged to its caller is in the filter already."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from contextlib import suppress

from app.db import ChangeHook, Database
from app.feed import FeedState, FilterDiverged, NeedsRebuild, replay
from app.settings import Settings
from guard import ChangeSourceError, CuckooFilter, FilterNotFoundError
from guard.changes import Change

log = logging.getLogger(__name__)

# A database write that runs the hook with its logged change (app/db: put, delete); True if
# it changed a row.
Write = Callable[[ChangeHook], Awaitable[bool]]


class FilterWrites:
    """Runs database writes whose hook applies the change to the filter.

    The hook runs inside the write transaction, after the row and its log entry are written
    and before the commit. Writers of the table are serialised from their first change to
    their commit, so every earlier id is committed: when the filter has not reached them yet
    (rows written behind the service's back, the follower not done), the hook first applies
    them from the log, then its own change. Holding the write lock there is also what lets a
    rebuild promote its copy with no writer half-way: its barrier waits for us. If the
    transaction then fails, the change is undone: ``undo_change`` takes it back only when it
    is still the last change applied, so an undo of a change that never reached the filter
    does nothing.
    """

    def __init__(self, cf: CuckooFilter, db: Database, settings: Settings, state: FeedState):
        self.cf = cf
        self.db = db
        self.batch = settings.feed_batch
        self.state = state
        self._source: int | None = None

    async def run(self, write: Write) -> bool:
        """``write(hook)``; its result. Redis down → raises before the row is written."""
        if self._source is None:  # read outside the write transaction, once
            self._source = await self.db.feed_source()
        source = self._source
        sent: Change | None = None  # our change, once a script that applies it was sent

        async def hook(change: Change) -> None:
            nonlocal sent
            sent = change
            await self._apply(change, source)

        try:
            return await write(hook)
        except BaseException:
            if sent is not None:
                await self._undo(sent, source)
            raise

    async def _apply(self, change: Change, source: int) -> None:
        """Apply the write's own change, after any earlier ones the filter lacks.

        A filter that cannot follow the log (missing, another source, the log compacted past
        it) is left to a rebuild (or the follower): the write goes on. FilterFullError and
        RedisUnreachable fail the write, which rolls back; a change whose answer was lost
        may still have been applied, and the undo takes it back if so (a delete applied and
        then rolled back would leave a row without its fingerprint: a false negative).
        """
        try:
            result = await self.cf.apply_changes([change], source=source)
            if result.gap:
                await replay(
                    self.cf,
                    self.db,
                    source,
                    batch=self.batch,
                    upto=change.id - 1,
                    observe=self.state.observe,
                )
                result = await self.cf.apply_changes([change], source=source)
        except FilterNotFoundError:
            return  # no live filter yet (first build running) or dropped: blocks nothing
        except ChangeSourceError as exc:
            log.warning("change %d of %r not applied: %s", change.id, change.item, exc)
            self._source = None  # read again next time: the log may have been re-installed
            await self._keep_findable(change)
            return
        except NeedsRebuild as exc:
            log.warning("change %d of %r not applied: %s", change.id, change.item, exc)
            await self._keep_findable(change)
            return
        if result.gap:
            # The filter moved back between the catch-up and our call (restored from an
            # older copy this very moment): the follower and the watchdog repair that.
            log.warning("change %d of %r not applied: the filter moved", change.id, change.item)
            await self._keep_findable(change)
        elif result.skipped:
            # Our change is not committed, so no one else can have applied it: the filter's
            # id is one a rolled-back write left behind (its undo lost with Redis).
            self.state.diverged = FilterDiverged(self.cf.name, change.id)
            log.error("%s", self.state.diverged)
            await self._keep_findable(change)

    async def _keep_findable(self, change: Change) -> None:
        """A new row's key goes into a filter that cannot take the change in order: a plain
        insert (an extra fingerprint costs a false positive at most; the rebuild that the
        filter needs anyway drops it). A delete is not applied: its fingerprint stays."""
        if change.insert:
            with suppress(FilterNotFoundError):
                await self.cf.insert(change.item)

    async def _undo(self, change: Change, source: int) -> None:
        try:
            await self.cf.undo_change(change, source=source)
        except FilterNotFoundError:
            pass
        except Exception as exc:
            # The filter may keep a change the database rolled back, under an id the next
            # write gets again: that write sees its change "already applied" (see _apply).
            log.error("could not undo change %d of %r (%r); rebuild to repair", change.id,
                      change.item, exc)  # fmt: skip
