"""The records filter's watchdog: knows when the filter is behind the table, and repairs it.

The filter holds the position of the last database change it applied (`applied`, in its own
bytes: guard/changes.py); the database's change feed gives the position of its newest committed
change. Comparing the
two every GUARD_WATCHDOG_INTERVAL seconds shows a filter that lost changes: restored from an
older snapshot, failed over to a lagging replica, replaced by an older copy (each brings its
own older id), deleted, or built from another database. Damage that leaves the id alone (the
buckets zeroed in place) is found by the audit: existing keys sampled from the table and
looked up. While the filter is stale the guard does not block (the middleware asks `stale`);
the watchdog repairs it (replay of the change log from the filter's id when the log still
holds it, else a rebuild from the table) and trusts it again once it caught up. See
docs/consistency.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from app.feed import NeedsRebuild
from guard import Change, CuckooFilter
from guard.errors import (
    FilterCorruptError,
    FilterFullError,
    FilterNotFoundError,
    RedisUnreachable,
)

log = logging.getLogger(__name__)

# Why the filter is stale (the `reason` label of the metrics, /health and the log).
STARTUP = "startup"  # behind the newest change seen at start-up
BEHIND = "behind"  # a change committed more than GUARD_WATCHDOG_MAX_LAG ago is not applied
ROLLED_BACK = "rolled_back"  # its id moved backwards (older snapshot, replica, older copy)
MISSING = "missing"  # the key is gone (Redis back empty, deleted)
OTHER_SOURCE = "other_source"  # built from another change log (another database)
DAMAGED = "damaged"  # its header fails the checks
AUDIT_MISS = "audit_miss"  # a key the table holds, and the filter applied, reads absent
AHEAD = "ahead"  # past the database's newest change: the database lost commits
FULL = "full"  # a fixed-size filter had no room for a change of the feed
# These leave the filter's contents unknown: only a rebuild from the table repairs them.
NEEDS_REBUILD = frozenset({MISSING, OTHER_SOURCE, DAMAGED, AUDIT_MISS, AHEAD, FULL})

CLEAN, MISS, INCONCLUSIVE = "clean", "miss", "inconclusive"
MAX_BACKOFF_S = 5.0  # between failed repairs
HISTORY = 100  # ended incidents kept (tests and the bench read them)
# An audit miss is confirmed once the follower applied every change committed when the keys
# were read again: it is given this long (a follower that keeps up takes one poll, ~10-20 ms).
CONFIRM_POLLS, CONFIRM_POLL_S = 20, 0.01
# ... and the changes applied after that read are looked through for the missed keys, up to
# this many (more: inconclusive, the next audit tries again).
CONFIRM_CHANGES = 10_000


class WatchedDatabase(Protocol):
    """What the watchdog uses of app.db's Database."""

    async def get(self, key: str) -> str | None: ...
    async def newest_change(self) -> int: ...
    async def oldest_change(self) -> int: ...
    async def feed_source(self) -> int: ...
    async def sample_keys(self, n: int) -> list[str]: ...
    async def present_at(self, keys: list[str]) -> tuple[int, list[str]]: ...
    async def changes_after(self, after: int, limit: int) -> list[Change]: ...


class WatchdogMetrics(Protocol):
    def filter_stale(self, name: str, reason: str | None) -> None: ...
    def filter_repair(self, name: str, how: str, outcome: str) -> None: ...
    def audit(self, name: str, keys: int, missed: int, result: str) -> None: ...


@dataclass
class Incident:
    """One stretch of time during which the filter is not trusted."""

    reason: str
    since: float  # monotonic
    # The filter is trusted again once it applied this change (the newest committed one
    # when the incident began, or when the last repair began).
    target: int
    rebuild: bool  # only a rebuild can repair it
    rebuilt: bool = False  # a rebuild finished since it began
    repairs: int = 0
    until: float | None = None  # monotonic, once trusted again
    how: str = ""  # the repair that worked: catch_up or rebuild ("" if none was needed)


@dataclass(frozen=True)
class WatchdogSettings:
    interval: float = 0.5  # seconds between checks of the watermark
    max_lag: float = 1.0  # a change seen committed this long ago must be applied
    audit_interval: float = 1.0  # seconds between audits (0: none)
    audit_sample: int = 32  # keys per audit


class Watchdog:
    """Watches one filter that follows `db`'s change log; `stale` says whether to trust it.

    `catch_up()` applies every change committed so far to the filter (the follower's; it
    raises NeedsRebuild when the log cannot repair it) and `rebuild()` builds it anew from the
    table (the record store's); without `catch_up` every repair is a rebuild.
    """

    def __init__(
        self,
        cf: CuckooFilter,
        db: WatchedDatabase,
        *,
        rebuild: Callable[[], Awaitable[Any]],
        catch_up: Callable[[], Awaitable[int]] | None = None,
        settings: WatchdogSettings = WatchdogSettings(),
        metrics: WatchdogMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cf = cf
        self.db = db
        self.rebuild = rebuild
        self.catch_up = catch_up
        self.settings = settings
        self.metrics = metrics
        self.clock = clock
        self.incident: Incident | None = None
        self.history: deque[Incident] = deque(maxlen=HISTORY)  # the latest, ended ones
        self.opened = 0  # incidents begun since start
        self._source: int | None = None
        self._highest = 0  # the highest `applied` read while trusted
        # (first seen, id): newest ids seen committed that the filter had not applied yet.
        self._pending: deque[tuple[float, int]] = deque()
        self._seen = 0
        self._next_audit = 0.0
        self._next_repair = 0.0
        self._backoff = settings.interval
        self._starting = True  # until the first check that reached both sides

    @property
    def stale(self) -> bool:
        return self.incident is not None

    # ---- the loop ----------------------------------------------------------------------

    async def start(self) -> None:
        """Before the first request: a filter left from an earlier run may be behind the
        table, so the first check wants every change committed by then applied."""
        try:
            self._source = await self.db.feed_source()
        except Exception as exc:
            log.warning("watchdog: database not readable at start-up (%r)", exc)
        await self.check()
        self._next_audit = self.clock() + self.settings.audit_interval

    async def run(self) -> None:
        """Check, audit and repair until cancelled."""
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # a watchdog that dies guards nothing: log and go on
                log.exception("watchdog: check failed")
            await asyncio.sleep(self.settings.interval)

    async def tick(self) -> None:
        await self.check()
        now = self.clock()
        audit = self.settings.audit_interval
        if self.incident is None and audit and now >= self._next_audit:
            self._next_audit = now + audit
            await self._audit_trusted()
        if self.incident is not None and now >= self._next_repair:
            await self.repair()
            await self.check()

    # ---- the watermark -----------------------------------------------------------------

    async def check(self) -> None:
        """Compare the filter's `applied` with the database's newest change."""
        # `applied` first: changes reach the filter only from the feed, so read before
        # `newest` it cannot pass it unless the database lost commits.
        missing: Exception | None = None
        try:
            applied = await self.cf.applied_change()
        except (FilterNotFoundError, FilterCorruptError) as exc:
            missing, applied = exc, 0
        except RedisUnreachable:
            return  # an outage: the middleware's breaker deals with it
        try:
            newest = await self.db.newest_change()
        except Exception as exc:  # the database is away: no verdict either way
            log.debug("watchdog: newest change not readable: %r", exc)
            return
        if isinstance(missing, FilterNotFoundError):
            self._open(MISSING, newest, "the filter's key does not exist")
            return
        if missing is not None:
            self._open(DAMAGED, newest, str(missing))
            return
        await self._judge(newest, applied)

    async def observe(self, applied: int) -> None:
        """The filter's id as a replay (the follower's) read it before applying anything: an
        id below the highest seen may be a filter rolled back, which the replay is about to
        mend; judged now so the incident is counted and logged all the same.
        Costs nothing in the normal case (no query)."""
        if self.incident is None and applied < self._highest:
            try:
                newest = await self.db.newest_change()
            except Exception:
                return
            await self._judge(newest, applied)

    def rollback_met(self, applied: int, highest: int) -> None:
        """A lookup read the filter older than one it had read before (guard/ages.py: its
        write count went back; ``applied`` and the ``highest`` the handle read): rolled back,
        stale at once, repaired by a replay up to at least ``highest``."""
        self._open(
            ROLLED_BACK,
            max(self._seen, highest),
            f"a lookup read applied {applied} after {highest} (an older copy)",
        )

    async def _judge(self, newest: int, applied: int) -> None:
        now = self.clock()
        if applied > newest:
            # A database restored from a backup or failed over to a replica that lost commits
            # hands those ids out again: a replay would skip them as applied.
            self._open(AHEAD, newest, f"applied {applied} is past the newest change {newest}")
            return
        if newest > self._seen:
            self._pending.append((now, newest))
            self._seen = newest
        while self._pending and self._pending[0][1] <= applied:
            self._pending.popleft()
        incident = self.incident
        if incident is not None:
            if not incident.rebuild and applied >= incident.target:
                self._close(applied)
            elif incident.rebuilt and applied >= incident.target:
                # A rebuilt filter is trusted once it also passes an audit.
                if await self.audit() != MISS:
                    self._close(applied)
                else:
                    incident.rebuilt = False
            return
        if self._starting:
            self._starting = False
            if applied < newest:
                self._open(STARTUP, newest, f"applied {applied}, newest change {newest}")
                return
        if applied >= newest:
            # It holds every committed change: current.
            self._highest = max(self._highest, applied)
            return
        if applied < self._highest:
            self._open(ROLLED_BACK, newest, f"applied went back from {self._highest} to {applied}")
        elif self._pending and now - self._pending[0][0] >= self.settings.max_lag:
            first = self._pending[0][1]
            self._open(
                BEHIND,
                newest,
                f"change {first} committed over {self.settings.max_lag:g} s ago, "
                f"applied is {applied}",
            )
        else:
            self._highest = max(self._highest, applied)

    async def follower_failed(self, exc: Exception) -> None:
        """A round of the follower failed: a change it could not apply for want of room is
        one the filter lacks from now on, so it is not trusted from this moment (the
        watermark check would see it only after max_lag)."""
        if isinstance(exc, FilterFullError):
            try:
                newest = await self.db.newest_change()
            except Exception:
                newest = self._seen
            self._open(FULL, newest, str(exc))

    # ---- the audit ---------------------------------------------------------------------

    async def _audit_trusted(self) -> None:
        try:
            if await self._other_source():
                return
            result = await self.audit()
        except RedisUnreachable:
            return
        except (FilterNotFoundError, FilterCorruptError):
            return  # the next check names it
        if result == MISS:
            self._open(AUDIT_MISS, await self.db.newest_change(), "a sampled row read absent")

    async def _other_source(self) -> bool:
        info = await self.cf.info()
        if self._source is None:
            self._source = await self.db.feed_source()
        if info.change_source not in (0, self._source):
            self._open(
                OTHER_SOURCE,
                await self.db.newest_change(),
                f"it follows change log {info.change_source:#x}, not {self._source:#x}",
            )
            return True
        return False

    async def audit(self) -> str:
        """Look up existing keys sampled from the table: CLEAN, MISS (a key that exists and
        whose insert the filter applied reads absent), or INCONCLUSIVE."""
        keys = await self.db.sample_keys(self.settings.audit_sample)
        if not keys:
            return CLEAN
        found = await self.cf.lookup_many(keys)
        missed = [k for k, hit in zip(keys, found, strict=True) if not hit]
        result = await self._confirm(missed) if missed else CLEAN
        if self.metrics is not None:
            self.metrics.audit(self.cf.name, len(keys), len(missed), result)
        return result

    async def _confirm(self, keys: list[str]) -> str:
        """A sampled key may read absent rightly: deleted since it was sampled, inserted
        after the filter's last change (the follower's window), or written by a transaction
        still in flight. So the keys are read again from the table in a snapshot whose feed
        position is known; once the follower has applied that far, a key the snapshot holds
        that reads absent, and that no change applied since touched, is a miss. The watchdog
        does not apply the feed itself here: a follower that stopped must show as BEHIND."""
        position, present = await self.db.present_at(keys)
        if not present:
            return CLEAN
        applied = await self.cf.applied_change()
        if self.incident is None:
            # An id that went back is a rolled-back filter, not a window (`applied` read
            # first, as check() does).
            await self._judge(await self.db.newest_change(), applied)
            if self.incident is not None:
                return INCONCLUSIVE
        for _ in range(CONFIRM_POLLS):
            if applied >= position:
                break
            await asyncio.sleep(CONFIRM_POLL_S)
            applied = await self.cf.applied_change()
        if applied < position:
            return INCONCLUSIVE  # the watermark check judges a filter left behind
        found = await self.cf.lookup_many(present)
        missed = {k for k, hit in zip(present, found, strict=True) if not hit}
        if not missed:
            return CLEAN
        # The lookups read the filter at or after `position`, and at or before what it has
        # applied now: a change of a missed key in between may be why.
        upto = await self.cf.applied_change()
        if upto < position or upto - position > CONFIRM_CHANGES:
            return INCONCLUSIVE
        touched: set[str | bytes] = set()
        after = position
        while after < upto:
            changes = await self.db.changes_after(after, upto - after)
            if not changes:
                return INCONCLUSIVE  # compacted meanwhile
            touched.update(c.item for c in changes)
            after = changes[-1].id
        return MISS if missed - touched else INCONCLUSIVE

    # ---- repair ------------------------------------------------------------------------

    async def repair(self) -> None:
        """One repair attempt: replay the change log from the filter's id, or rebuild when
        the log no longer holds it (or the damage is of a kind a replay cannot mend); a
        failure waits a growing while before the next attempt."""
        incident = self.incident
        if incident is None:
            return
        incident.repairs += 1
        how = "catch_up"
        try:
            target = await self.db.newest_change()
            if not incident.rebuild and self.catch_up is not None:
                try:
                    await self.catch_up()
                except NeedsRebuild as exc:
                    log.warning("watchdog: %s", exc)
                    incident.rebuild = True
            if incident.rebuild or self.catch_up is None:
                how = "rebuild"
                incident.rebuild = True
                await self.rebuild()
                incident.rebuilt = True
            incident.how = how
            incident.target = max(incident.target, target)
        except Exception as exc:
            self._next_repair = self.clock() + self._backoff
            self._backoff = min(MAX_BACKOFF_S, self._backoff * 2)
            log.warning("watchdog: %s of %s failed (%r)", how, self.cf.name, exc)
            if self.metrics is not None:
                self.metrics.filter_repair(self.cf.name, how, "failed")
            return
        self._backoff = self.settings.interval
        log.info("watchdog: %s of %s done (attempt %d)", how, self.cf.name, incident.repairs)
        if self.metrics is not None:
            self.metrics.filter_repair(self.cf.name, how, "done")

    # ---- incidents ---------------------------------------------------------------------

    def _open(self, reason: str, newest: int, detail: str) -> None:
        self._starting = False  # an incident's end requires what start-up would
        incident = self.incident
        if incident is not None:
            if reason in NEEDS_REBUILD and not incident.rebuild:
                incident.rebuild = True  # escalated: a replay cannot repair this
                incident.rebuilt = False
                log.warning("watchdog: %s is also %s (%s)", self.cf.name, reason, detail)
            return
        self.incident = Incident(reason, self.clock(), newest, reason in NEEDS_REBUILD)
        self.opened += 1
        self._next_repair = 0.0
        self._backoff = self.settings.interval
        log.warning(
            "filter %s is stale (%s: %s): the guard does not block until it is repaired",
            self.cf.name,
            reason,
            detail,
        )
        if self.metrics is not None:
            self.metrics.filter_stale(self.cf.name, reason)

    def _close(self, applied: int) -> None:
        incident = self.incident
        assert incident is not None
        self.incident = None
        incident.until = self.clock()
        self.history.append(incident)
        self._highest = applied
        log.warning(
            "filter %s trusted again after %.2f s (%s, %d repair(s))",
            self.cf.name,
            incident.until - incident.since,
            incident.reason,
            incident.repairs,
        )
        if self.metrics is not None:
            self.metrics.filter_stale(self.cf.name, None)
