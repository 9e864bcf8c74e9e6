"""A lookup never answers "absent" from a filter older than one its handle already read.

A filter can be replaced by an older copy of itself: Redis restarted from an older snapshot,
a failover to a replica that lagged, keys restored from a dump. Items written since are gone
from that copy, and a lookup would call them absent. So every lookup's read carries the
filter's **age** (guard/reads.py: the header fields below, read in the same BITFIELD_RO as
the buckets, no extra round trip), and the handle keeps, per filter identity, the highest age
it has read (docs/consistency.md, "Rollbacks").

* The **age** is the filter's write count: the sum of every sub-filter's ``items`` plus twice
  ``deletes`` (docs/format.md). Every insert raises it by one (an item more), and so does
  every delete that removes an item (an item fewer, a delete more), a change of the feed
  applied or undone likewise; growth leaves it alone, nothing lowers it. A delete that finds
  nothing (``missed_deletes``) leaves it too: it changes no bucket, so a copy that lacks
  only those answers every lookup alike. So an older copy that lacks an insert or a delete
  has a lower write count, and no format change was needed.
* The **identity** is the layout's digest (the tag's middle: geometry and seed, drawn at
  random when the filter is created), so a dropped and re-created filter, or one replaced by
  a rebuild (a new seed), is a new filter, not a rollback. A filter made again with the same
  explicit seed and geometry, or a sharded filter replaced by a bulk load (it keeps its seed
  so that items keep their shard), has the same identity: a lower write count there reads
  as a rollback, and the handle stops blocking for it as below (safe; ``acknowledge_rollback``
  ends it).

A lookup whose read shows a lower age than the highest read for the same identity is a
**rollback**: it answers "maybe present" for every item, the handle counts it once
(``rollbacks``) and calls ``on_rollback``. Until when:

* a filter that follows a change feed (``applied`` above 0): until ``applied`` and the write
  count are back to the highest read. The feed replays every change after the older copy's
  ``applied`` in order, so by then every change the handle had seen is in again.
* a filter written only through the API: until ``acknowledge_rollback()`` (an operator
  re-inserted what was lost, or accepts it) or a new identity. No count tells which items
  the older copy lacks, so no later write makes it whole.

The memory is the handle's own: another process, or a handle made after the rollback, has
not read the newer age and cannot tell (the service's watchdog covers table-backed filters
there).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from guard.layout import APPLIED_AT, DELETES_AT, ITEMS_AT

# The reads a lookup adds after a sub-filter's tag: its items; in sub-filter 0, its deletes
# and applied as well (all 64-bit, as the scripts write them). Each costs the server about
# 0.2 us and the client three arguments to pack: no more than the rule needs.
ITEMS_READ = ("GET", "i64", ITEMS_AT * 8)
AGE_READS = (
    *ITEMS_READ,
    *("GET", "i64", DELETES_AT * 8),
    *("GET", "i64", APPLIED_AT * 8),
)
AGE_VALUES = len(AGE_READS) // 3  # the replies AGE_READS adds
MAX_IDENTITIES = 64  # identities remembered per handle (a filter re-created that often)


def age_of(items: int, deletes: int) -> int:
    """The write count of a filter whose sub-filters hold ``items`` in all."""
    return items + 2 * deletes


class Rollback(NamedTuple):
    """What a lookup met: the filter (``shard``: which, in a sharded one), the write count
    and ``applied`` it read, and the highest of each its handle had read before."""

    filter: str
    shard: int | None
    writes: int
    highest_writes: int
    applied: int
    highest_applied: int


class Ages:
    """One filter's (or shard's) highest age read, per identity; see the module's docstring."""

    __slots__ = ("_current", "_high", "_rolled", "name", "shard", "shared")

    def __init__(self, name: str, shard: int | None, shared: RollbackCounter) -> None:
        self.name, self.shard, self.shared = name, shard, shared
        self._high: dict[bytes, tuple[int, int]] = {}  # identity -> (writes, applied)
        self._rolled: set[bytes] = set()  # identities not trusted to answer "absent"
        self._current = b""  # the identity last read, once one is not trusted

    def fresh(self, identity: bytes, writes: int, applied: int) -> bool:
        """Whether a read of this age may answer "absent"; counts and reports a rollback."""
        high = self._high.get(identity)
        if high is not None and writes == high[0] and applied == high[1] and not self._rolled:
            return True  # the common case: nothing written since the last read
        self._current = identity
        if high is None:
            if len(self._high) >= MAX_IDENTITIES:
                self._high.pop(next(iter(self._high)))
            self._high[identity] = (writes, applied)
            return True
        top_writes, top_applied = high
        if writes < top_writes:
            if identity not in self._rolled:
                self._rolled.add(identity)
                self.shared.met(
                    Rollback(self.name, self.shard, writes, top_writes, applied, top_applied)
                )
            return False
        # Newer than anything read (or an undone change: ``applied`` back by one, a write more).
        self._high[identity] = (writes, max(applied, top_applied))
        if identity in self._rolled:
            if not (top_applied and applied >= top_applied):
                return False  # API-fed: lost items stay lost; or the replay is not done yet
            self._rolled.discard(identity)
        return True

    @property
    def rolled_back(self) -> bool:
        return self._current in self._rolled

    def acknowledge(self) -> None:
        self._high.clear()
        self._rolled.clear()


class RollbackCounter:
    """A handle's rollbacks met (all shards'), and whom to tell."""

    __slots__ = ("count", "on_rollback")

    def __init__(self) -> None:
        self.count = 0
        self.on_rollback: Callable[[Rollback], None] | None = None

    def met(self, rollback: Rollback) -> None:
        self.count += 1
        if self.on_rollback is not None:
            self.on_rollback(rollback)


class Rollbacks:
    """A handle's view of the rollbacks its lookups met (FilterOps, ShardedOps)."""

    _rollbacks: RollbackCounter

    def _age_memories(self) -> list[Ages]:
        raise NotImplementedError

    @property
    def rollbacks(self) -> int:
        """Rollbacks this handle's lookups met: a read of the filter older than one it had
        read (an older copy came back); each is answered "maybe present", never "absent"."""
        return self._rollbacks.count

    @property
    def on_rollback(self) -> Callable[[Rollback], None] | None:
        """Called (synchronously, inside the lookup) with each rollback a lookup meets."""
        return self._rollbacks.on_rollback

    @on_rollback.setter
    def on_rollback(self, callback: Callable[[Rollback], None] | None) -> None:
        self._rollbacks.on_rollback = callback

    @property
    def rolled_back(self) -> bool:
        """Whether lookups answer "maybe present" for every item since a rollback: until a
        filter that follows a change feed applied again what the handle had read; until
        ``acknowledge_rollback()`` or a new filter for one written only through the API."""
        return any(ages.rolled_back for ages in self._age_memories())

    def acknowledge_rollback(self) -> None:
        """Trust the filter as it is now (what the rollback lost was written again, or is
        accepted as lost): forget the ages read, and answer from the filter again."""
        for ages in self._age_memories():
            ages.acknowledge()
