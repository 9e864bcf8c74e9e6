"""One filter's operations, and its handles: CuckooFilter (asyncio) and SyncCuckooFilter.

Each operation is written once, as a generator of the Redis calls it needs (guard/driver.py
runs it on a blocking or an asyncio client; guard/facade.py gives both handles the same public
methods). The handle caches the filter's layout and sends it with every call; a call that
finds the stored header different answers STALE, and the operation reads the stored filter
again (the probe) and retries. A layout is adopted only once the probe has verified every
sub-filter (guard/layout.py:verify_stored): a damaged filter leaves the handle with none, so
every call checks again and raises FilterCorruptError again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Self

from redis.exceptions import ClusterError, ResponseError, TryAgainError

from guard import hashing, scripts
from guard.ages import Ages, RollbackCounter, Rollbacks
from guard.changes import ApplyResult, Change, change_args, validate_changes
from guard.errors import (
    ChangeSourceError,
    FilterCorruptError,
    FilterFullError,
    FilterNotFoundError,
    GuardError,
    StagingBehindError,
)
from guard.facade import AsyncHandle, ChangeFeed, SyncHandle
from guard.handle import ChangeFeedHandle, Target
from guard.hashing import to_bytes
from guard.layout import (
    APPLIED_AT,
    MAX_CHANGE_ID,
    MAX_SUBFILTERS,
    TAG_BYTES,
    UNKNOWN_LAYOUT,
    Layout,
    Stored,
    pack_header,
    probe_reads,
    unpack_header,
    verify_stored,
)
from guard.names import DEFAULT_PREFIX, STAGING, base_key, check_name
from guard.ops import (
    BATCH_CHUNK,
    MAX_RETRIES,
    Call,
    Command,
    OneCommand,
    Op,
    Round,
    forgets_on_damage,
    insert_chunk,
    run_one,
)
from guard.params import APPLIED, SOURCE_OR_NONE, FilterParams
from guard.reads import ReadPlan, SingleRead, TagMismatch


@dataclass(frozen=True)
class FilterInfo:
    name: str
    capacity: int
    items: int
    buckets: int
    bucket_size: int
    fingerprint_bits: int
    max_kicks: int
    expansion: int
    subfilters: int
    load_factor: float
    memory_bytes: int
    error_rate: float  # estimated now, from each sub-filter's load
    target_error_rate: float | None
    deletes: int
    missed_deletes: int  # deletes that found nothing: each may have removed another key
    applied_change: int = 0  # id of the last database change applied (guard/changes.py)
    change_source: int = 0  # the change log the filter follows (0: none)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class FilterOps(Rollbacks, ChangeFeedHandle[FilterInfo]):
    """One filter's operations, as generators of calls: the handles' (and each shard's)."""

    def __init__(
        self,
        redis: Any,
        name: str,
        prefix: str = DEFAULT_PREFIX,
        *,
        _shard: int | None = None,
        _rollbacks: RollbackCounter | None = None,
    ) -> None:
        self.redis, self.name, self.prefix = redis, check_name(name), prefix
        self._shard = _shard
        self._base = base_key(prefix, name, _shard)
        self._layout = UNKNOWN_LAYOUT
        self._read_command = "BITFIELD_RO"
        self._single: SingleRead | None = None  # the plan of one-item lookups, per layout
        self._read_scripts = True  # EVALSHA_RO for scripts that only read (Redis 7+)
        # A sharded filter's shards count into their parent's.
        self._rollbacks = RollbackCounter() if _rollbacks is None else _rollbacks
        self._ages = Ages(name, _shard, self._rollbacks)  # the highest age read (guard/ages.py)

    def _age_memories(self) -> list[Ages]:
        return [self._ages]

    def key(self, n: int = 0) -> str:
        return self._base if n == 0 else f"{self._base}:{n}"

    def _keys(self, count: int) -> list[str]:
        return [self.key(n) for n in range(max(1, count))]

    def _adopt(self, reply: list[Any]) -> bool:
        """True when the reply was STALE: the handle forgets its layout, to probe again."""
        if reply[0] != scripts.STALE:
            if reply[1] != self._layout.subfilters:  # this very call grew the filter
                self._layout = replace(self._layout, subfilters=int(reply[1]))
            return False
        self._layout = UNKNOWN_LAYOUT
        return True

    def _refused_ro(self, exc: BaseException, used: str) -> bool:
        """Whether ``exc`` is fakeredis refusing BITFIELD_RO: then BITFIELD reads (same GETs)."""
        if isinstance(exc, scripts.UnknownCommandError) and exc.command == used == "BITFIELD_RO":
            self._read_command = "BITFIELD"
            return True
        return False

    def _reads_op(self, reads: list[list[Any]], atomic: bool = False) -> Op[list[Any]]:
        """BITFIELD_RO commands (``reads``: their arguments); BITFIELD once refused them."""
        while True:
            used = self._read_command
            try:
                return (yield Round([Command(used, args) for args in reads], atomic))
            except ResponseError as exc:
                if not self._refused_ro(exc, used):
                    raise

    def _kept_changing(self, during: str) -> GuardError:
        return GuardError(f"{self.name}: layout kept changing {during}", filter=self.name)

    def _probe_round(self, count: int) -> Round:
        """One MULTI of read-only commands: whether sub-filter 0 exists, how many of the
        others' keys do, then each of the first ``count`` sub-filters' header, length and tag
        (guard/layout.py)."""
        keys = self._keys(MAX_SUBFILTERS)
        calls: list[Call | Command] = [Command("EXISTS", keys[:1]), Command("EXISTS", keys[1:])]
        for n in range(count):
            calls += [Command(*read) for read in probe_reads(self.key(n))]
        return Round(calls, atomic=True)

    def _probe_op(self) -> Op[list[Stored]]:
        """Read the stored filter, verify it, adopt its layout: one Stored per sub-filter, as
        many as the handle last knew of (read again when sub-filter 0 counts more)."""
        count = max(1, self._layout.subfilters)
        self._layout = UNKNOWN_LAYOUT  # nothing unverified is kept, even on failure
        for _ in range(MAX_RETRIES):
            replies = yield self._probe_round(count)
            if not replies[0]:
                if replies[1]:  # what is left of a filter is no filter, but never "absent"
                    raise FilterCorruptError(self.name, f"{self.key(0)} is missing")
                raise FilterNotFoundError(f"{self.name}: no such filter", filter=self.name)
            stored = [Stored(self.key(n), *replies[2 + 3 * n : 5 + 3 * n]) for n in range(count)]
            layout = verify_stored(self.name, stored)
            if layout.subfilters <= count:
                self._layout = layout
                return stored[: layout.subfilters]
            count = layout.subfilters
        raise self._kept_changing("while reading it")

    def _known_layout(self) -> Op[Layout]:
        """The handle's layout; the probe's first if it has none."""
        if not self._layout.buckets0:
            yield from self._probe_op()
        return self._layout

    def staging(self) -> Self:
        """A handle on this filter's staging copy (same hash tag), for rebuilds: fill it,
        then ``promote()`` it in place of the live filter."""
        stage = type(self)(self.redis, self.name, self.prefix)
        stage._shard = self._shard  # a shard's, for a sharded filter's (guard/sharded.py)
        stage._base = base_key(self.prefix, self.name, self._shard, STAGING)
        return stage

    # -- operations -------------------------------------------------------------------------

    def _reserve_op(self, params: FilterParams, applied: int, source: int) -> Op[FilterInfo]:
        APPLIED.check("applied", applied)
        SOURCE_OR_NONE.check("source", source)
        layout = params.layout()
        header = pack_header(
            layout, params.capacity, params.error_rate, applied=applied, source=source
        )
        return (yield from self._create_op(layout, header))

    def _bulk_target(self, applied: int, source: int) -> Target:
        """What a bulk build (guard/bulk.py) writes when this is the staging copy: itself."""
        APPLIED.check("applied", applied)
        SOURCE_OR_NONE.check("source", source)
        return Target([self])

    def _create_op(self, layout: Layout, header: bytes) -> Op[FilterInfo]:
        args = [header, layout.string_bytes(0), layout.tag(0)]
        yield Round([Call(scripts.RESERVE, [self.key(0)], args)])
        self._layout = layout
        return (yield from self._info_op())

    def _exists_op(self) -> Op[bool]:
        (found,) = yield Round([Command("EXISTS", [self.key(0)])])
        return bool(found)

    @forgets_on_damage
    def _batch_op(self, script: str, items: Iterable[str | bytes]) -> Op[list[Any]]:
        """count / delete: chunks are independent, so they go in one pipeline."""
        data = [to_bytes(x) for x in items]
        results: list[Any] = [None] * len(data)
        pending = [(a, min(a + BATCH_CHUNK, len(data))) for a in range(0, len(data), BATCH_CHUNK)]
        for _ in range(MAX_RETRIES):
            if not pending:
                return results
            layout = yield from self._known_layout()
            flat = hashing.flat(hashing.hash_batch(data, layout.seed))
            keys = self._keys(layout.subfilters)
            read_only = script == scripts.COUNT and self._read_scripts
            parts = [layout.args() + flat[2 * a : 2 * b] for a, b in pending]
            try:
                replies = yield Round([Call(script, keys, args, read_only) for args in parts])
            except ResponseError as exc:
                # Redis 6.2 and fakeredis have no EVALSHA_RO; EVALSHA of a script that only
                # reads runs on a replica all the same.
                unknown = isinstance(exc, scripts.UnknownCommandError) and exc.command
                if read_only and unknown in ("EVALSHA_RO", "EVAL_RO"):
                    self._read_scripts = False
                    continue
                raise
            retry = []
            for (a, b), reply in zip(pending, replies, strict=True):
                if self._adopt(reply):
                    retry.append((a, b))
                else:
                    results[a:b] = reply[2:]
            pending = retry
        raise self._kept_changing(f"during {script}")

    def _lookup_one_op(self, item: str | bytes) -> Op[bool]:
        """``lookup`` of one item, a web request's: the command and the reading of its reply
        are _QueuedLookup's, the one definition a pipeline's queued lookup runs as well."""
        return run_one(_QueuedLookup(self, item))

    def _queued_lookup(self, item: str | bytes) -> Op[bool] | OneCommand:
        """``lookup`` of one item for a pipeline, with no generator (see _QueuedLookup)."""
        return _QueuedLookup(self, item)

    def _lookup_failed(self, exc: BaseException, used: str, item: bytes) -> Op[bool]:
        """A single lookup whose command (``used``) failed: the general lookup if fakeredis
        refused BITFIELD_RO, else ``exc`` (damage forgets the layout, as forgets_on_damage)."""
        if isinstance(exc, ResponseError) and self._refused_ro(exc, used):
            return self._lookup_rest(item)
        if isinstance(exc, FilterCorruptError):
            self._layout = UNKNOWN_LAYOUT
        raise exc

    def _lookup_rest(self, item: bytes, stale: bool = False) -> Op[bool]:
        """The general lookup of one item, where a single one hands over to it. ``stale``: a
        read just found a tag other than the layout predicts, so the filter is probed first."""
        if stale:
            self._layout = UNKNOWN_LAYOUT
        return (yield from self._lookup_op([item]))[0]

    @forgets_on_damage
    def _lookup_op(self, data: list[bytes]) -> Op[list[bool]]:
        """Script-free: one read command per sub-filter and chunk (guard/reads.py). ``data`` is
        already bytes: the public methods (and a sharded routing) convert each item once."""
        if not data:
            return []
        hashes: hashing.Hashes = []
        seed = None
        checked = None  # the layout the probe last vouched for
        for _ in range(MAX_RETRIES):
            if not self._layout.buckets0:
                yield from self._probe_op()  # learns the layout, or raises
                checked = self._layout
            layout = self._layout
            if seed != layout.seed:
                seed = layout.seed
                hashes = hashing.hash_batch(data, seed)
            plan = ReadPlan(layout, hashes, self.key)
            reads = [c.args for c in plan.commands]
            replies = yield from self._reads_op(reads, atomic=layout.subfilters > 1)
            try:
                found = plan.evaluate(replies)
            except TagMismatch as bad:
                if checked == layout:
                    # The headers hold this very layout, yet a tag disagrees: damaged.
                    raise FilterCorruptError(self.name, f"bad tag in {bad.key}") from None
            else:
                fresh = self._ages.fresh
                if all([fresh(plan.identity, w, a) for w, a in plan.ages(replies)]):
                    return found
                return [True] * len(data)  # older than a filter read before: guard/ages.py
            # Stale, gone or damaged: the probe checks every sub-filter and says which
            # (adopting the stored layout, or raising not found / corrupt).
            yield from self._probe_op()
            checked = self._layout
        raise self._kept_changing("during lookup")

    @forgets_on_damage
    def _insert_op(self, items: Iterable[str | bytes], unique: bool) -> Op[list[bool]]:
        """Chunks run one after another: a full fixed-size filter stops at the first failure."""
        data = [to_bytes(x) for x in items]
        results: list[bool] = []

        def tail(layout: Layout) -> list[Any]:
            # The script bounds its own work (guard/ops.py: KICK_BUDGET) and answers for the
            # items it took; the rest go in the next call.
            part = data[len(results) : len(results) + insert_chunk(layout.max_kicks)]
            return [int(unique), *hashing.flat(hashing.hash_batch(part, layout.seed))]

        send = _Sender(self, scripts.INSERT)
        while len(results) < len(data):
            reply = yield from send.call(tail)
            if reply[0] == scripts.OK and len(reply) == 2:
                # A call always takes its first item: this is not our script (never loop).
                raise GuardError(f"{self.name}: insert made no progress", filter=self.name)
            results.extend(bool(r) for r in reply[2:])
            if reply[0] == scripts.FULL:
                raise FilterFullError(
                    f"filter {self.name!r} is full ({len(results)} of {len(data)} items added)",
                    results + [False] * (len(data) - len(results)),
                    filter=self.name,
                )
        return results

    def _info_op(self) -> Op[FilterInfo]:
        """Script-free (it runs on a read-only replica): the probe reads every header."""
        stored = yield from self._probe_op()
        layout = self._layout
        headers = [unpack_header(s.header) for s in stored]
        first = headers[0]
        b = layout.bucket_size
        buckets = memory = 0
        miss_all = 1.0
        for n, header in enumerate(headers):
            m, f = layout.buckets(n), layout.fp_bits_at(n)
            buckets += m
            memory += layout.string_bytes(n)
            # An absent item is compared with 2b slots, each holding a print with probability
            # `load`, matching with probability 1 / (2^f - 1) (prints are never 0).
            load = header.items / (m * b)
            miss_all *= (1 - load / (2**f - 1)) ** (2 * b)
        items = sum(h.items for h in headers)
        return FilterInfo(
            name=self.name,
            capacity=first.capacity,
            items=items,
            buckets=buckets,
            bucket_size=b,
            fingerprint_bits=layout.fp_bits,
            max_kicks=layout.max_kicks,
            expansion=layout.expansion,
            subfilters=layout.subfilters,
            load_factor=items / (buckets * b),
            memory_bytes=memory,
            error_rate=1 - miss_all,
            target_error_rate=first.error_rate,
            deletes=first.deletes,
            missed_deletes=first.missed_deletes,
            applied_change=first.applied,
            change_source=first.source,
        )

    def _drop_op(self) -> Op[bool]:
        (existed,) = yield Round([Call(scripts.DROP, self._keys(MAX_SUBFILTERS), [])])
        self._layout = UNKNOWN_LAYOUT
        return bool(existed)

    @forgets_on_damage
    def _promote_op(
        self,
        only_if_new: bool = False,
        live: FilterOps | None = None,
        *,
        unless_behind: bool = False,
    ) -> Op[bool]:
        """Promote this staging copy onto ``live`` (default: the filter's live copy); with
        ``only_if_new``, only if no live filter exists (else FilterExistsError, from the
        script); with ``unless_behind``, not over a live filter of the same change feed that
        has applied more of it (StagingBehindError)."""
        if live is None:
            live = FilterOps(self.redis, self.name, self.prefix, _shard=self._shard)
        keys = live._keys(MAX_SUBFILTERS) + self._keys(MAX_SUBFILTERS)
        args = [int(only_if_new), int(unless_behind)]
        for _ in range(MAX_RETRIES):
            layout = yield from self._known_layout()
            (reply,) = yield Round([Call(scripts.PROMOTE, keys, [*layout.args(), *args])])
            self._layout = UNKNOWN_LAYOUT
            if isinstance(reply, list) and reply[:1] == [scripts.GAP]:
                raise StagingBehindError(self.name, int(reply[1]))
            if reply != [scripts.STALE]:
                live._layout = layout
                return True
        raise self._kept_changing("during promote")

    # -- the change feed (guard/changes.py): a single filter's handles have it, not a sharded one

    @forgets_on_damage
    def _apply_changes_op(self, changes: Sequence[Change], source: int) -> Op[ApplyResult]:
        """Apply database changes in order, each exactly once: see guard/changes.py."""
        # In chunks, one call of guard/lua/apply.lua each, sent again from where growth that
        # needed keys stopped it; the script skips what an earlier call applied (a replay).
        src, batch = validate_changes(changes, source)
        results: list[bool] = []
        skipped = 0

        def tail(layout: Layout) -> list[Any]:
            part = batch[len(results) : len(results) + insert_chunk(layout.max_kicks)]
            return [src, part[0][0] if part else 1, *change_args(part, layout.seed)]

        send = _Sender(self, scripts.APPLY, source)
        while True:
            reply = yield from send.call(tail)
            if reply[0] == scripts.OK and len(reply) == 4 and len(results) < len(batch):
                # A call always takes its first change: this is not our script (never loop).
                raise GuardError(f"{self.name}: apply made no progress", filter=self.name)
            applied = int(reply[2])
            skipped += int(reply[3])
            results.extend(bool(r) for r in reply[4:])
            if reply[0] == scripts.FULL:
                raise FilterFullError(
                    f"filter {self.name!r} is full: changes applied up to id {applied}, "
                    f"{len(results)} of {len(batch)} handled",
                    results + [False] * (len(batch) - len(results)),
                )
            gap = reply[0] == scripts.GAP
            if gap or len(results) >= len(batch):
                return ApplyResult(applied, len(results), gap, results, skipped)

    @forgets_on_damage
    def _applied_change_op(self) -> Op[int]:
        """The id of the last database change applied to the filter (0: none)."""
        # Read-only (it runs on a replica): with a layout cached, one read of sub-filter 0's
        # tag beside the id (the tag proves the string is the layout's, as for a lookup);
        # else, or when the tag disagrees, the id from the header the probe verified.
        layout = self._layout
        if layout.buckets0:
            tag_at = (layout.string_bytes(0) - TAG_BYTES) * 8
            read = [self.key(0), "GET", "i64", tag_at, "GET", "i64", APPLIED_AT * 8]
            ((tag, applied),) = yield from self._reads_op([read])
            expected = int.from_bytes(layout.tag(0), "big", signed=True)
            if tag == expected and 0 <= applied <= MAX_CHANGE_ID:
                return int(applied)
        stored = yield from self._probe_op()
        return unpack_header(stored[0].header).applied

    @forgets_on_damage
    def _undo_change_op(self, change: Change, source: int) -> Op[bool]:
        """Take ``change`` back if it is the last one applied; False (nothing done) if not."""
        src, item = validate_changes([change], source)  # guard/lua/undo.lua
        head = [src, change.id]
        send = _Sender(self, scripts.UNDO, source)
        while True:
            reply = yield from send.call(lambda layout: [*head, *change_args(item, layout.seed)])
            if reply[0] == scripts.FULL:
                raise FilterFullError(
                    f"filter {self.name!r} is full: change {change.id} not undone"
                )
            if reply[0] == scripts.OK:
                return bool(reply[2])
            # NEEDKEYS: growth needs a key the call did not carry; the sender adds them again.


class _Sender:
    """Sends the calls of an operation whose scripts may grow the filter (insert, apply, undo):
    with the spare keys growth needs (none during a slot migration), again after a stale
    layout; the retry counts hold for the whole operation."""

    def __init__(self, f: FilterOps, script: str, source: int = 0) -> None:
        self.f, self.script, self.source = f, script, source
        self.stale = self.spare_less = 0
        self.spares = 2

    def call(self, tail: Callable[[Layout], list[Any]]) -> Op[list[Any]]:
        """One call, ``tail(layout)`` its arguments after the layout's: its reply, unless
        STALE (sent again) or WRONG_SOURCE (ChangeSourceError)."""
        f = self.f
        while True:
            layout = yield from f._known_layout()
            # Two spare keys: growth may add sub-filters within one call (a filter that never
            # grows needs none; each key is a cost on every call).
            keys = f._keys(layout.subfilters + (self.spares if layout.expansion else 0))
            try:
                (reply,) = yield Round([Call(self.script, keys, [*layout.args(), *tail(layout)])])
            except (ClusterError, TryAgainError):
                # Redis Cluster, slot being migrated: a script some of whose keys are missing
                # (the spares) gets TRYAGAIN until the migration ends. Without spares it runs;
                # only growth (NEEDKEYS) has to wait for the end of the migration.
                self.spare_less += 1
                if not self.spares or self.spare_less > MAX_RETRIES:
                    raise
                self.spares = 0
                continue
            if reply[0] == scripts.WRONG_SOURCE:
                raise ChangeSourceError(f.name, int.from_bytes(reply[2], "big"), self.source)
            if reply[0] == scripts.NEEDKEYS:
                self.spares = 2
            if f._adopt(reply):
                self.stale += 1
                if self.stale > MAX_RETRIES:
                    raise f._kept_changing(f"during {self.script}")
                continue
            return reply


class _QueuedLookup(OneCommand):
    """``lookup(item)``, a web request's: with a known layout of one sub-filter (nearly
    always), the general lookup's read planned once per layout (guard/reads.py: SingleRead),
    with no loop around it; anything else goes on as the general lookup. The one definition
    of a single lookup: a handle runs it as an operation (ops.run_one, ``_lookup_one_op``),
    a pipeline queues it for lockstep, which runs it with no generator (ops.OneCommand)."""

    __slots__ = ("_data", "_filter", "_fp", "_item", "_single", "_used")

    def __init__(self, filter: FilterOps, item: str | bytes) -> None:
        self._filter = filter
        self._item = item  # converted when the pipeline runs: a bad item fails there

    def start(self) -> list[Any] | Op[bool]:
        f = self._filter
        layout = f._layout
        self._data = data = to_bytes(self._item)  # here: a bad item fails when it runs
        if layout.subfilters != 1 or not layout.buckets0:
            return f._lookup_rest(data)  # the general lookup, from its start
        single = f._single
        if single is None or single.layout is not layout:
            single = f._single = SingleRead(layout)
        self._single = single
        args, self._fp = single.command(f._base, data)
        self._used = used = f._read_command
        args.insert(0, used)
        return args

    def finish(self, reply: Any) -> Any:
        if isinstance(reply, BaseException):
            return self._filter._lookup_failed(reply, self._used, self._data)
        single = self._single
        if reply[0] == single.tag:
            writes, applied = single.age(reply)
            if self._filter._ages.fresh(single.identity, writes, applied):
                return single.holds(reply, self._fp)
            return True  # older than a filter read before: "maybe present" (guard/ages.py)
        # Stale, gone or damaged: the general lookup starts from the probe that says which.
        return self._filter._lookup_rest(self._data, stale=True)


class CuckooFilter(FilterOps, ChangeFeed, AsyncHandle[FilterInfo]):
    """A handle on one filter over ``redis.asyncio.Redis`` (or its ``RedisCluster``);
    creating it does no I/O. Its methods are guard/facade.py's; with ``coalesce`` (the
    default), concurrent lookups on it are sent together (guard/coalesce.py)."""

    def __init__(
        self, redis: Any, name: str, prefix: str = DEFAULT_PREFIX, *, coalesce: bool = True
    ) -> None:
        super().__init__(redis, name, prefix)
        self._start(coalesce)


class SyncCuckooFilter(FilterOps, ChangeFeed, SyncHandle[FilterInfo]):
    """The same filter over a blocking ``redis.Redis`` (or ``RedisCluster``), for scripts."""


__all__ = ["CuckooFilter", "FilterInfo", "SyncCuckooFilter"]
