"""Database changes applied to a filter exactly once, with the id of the last one in its bytes.

A filter that follows a database's change log (docs/format.md, "Change feed") stores, in
sub-filter 0's header, ``applied``: the id of the last change applied, and ``source``: which
change log that id belongs to. guard/lua/apply.lua applies a batch of changes and moves
``applied`` in the same script, skipping what an earlier call already applied: a follower that
crashes and replays, or two that overlap, apply each change once. A filter rolled back or
restored from an older copy carries its own older id, so the guard sees it is behind.

Each operation is a generator of script calls, as in guard/filter.py; the filter handles run
them (``apply_changes``, ``applied_change``, ``undo_change``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from redis.exceptions import ClusterError, ResponseError, TryAgainError

from guard import scripts
from guard.errors import ChangeSourceError, FilterFullError, GuardError, InvalidParameterError
from guard.hashing import item_hash, to_bytes
from guard.layout import (
    APPLIED_AT,
    MAX_CHANGE_ID,
    MAX_SOURCE,
    TAG_BYTES,
    Layout,
    Stored,
    unpack_header,
)
from guard.ops import (
    MAX_RETRIES,
    Call,
    Command,
    Op,
    Round,
    forgets_on_damage,
    insert_chunk,
)
from guard.params import Limit


class FilterOps(Protocol):
    """What these operations use of a filter's (guard/filter.py: FilterOps, whose handles
    have them as methods, so it imports this module and not the other way round)."""

    name: str
    _layout: Layout
    _read_command: str

    def key(self, n: int = 0) -> str: ...
    def _keys(self, count: int) -> list[str]: ...
    def _adopt(self, reply: list[Any]) -> bool: ...
    def _probe_op(self) -> Op[list[Stored]]: ...


class Change(NamedTuple):
    """One change of the database: ``item`` inserted (``insert``) or deleted, with its id."""

    id: int
    insert: bool
    item: str | bytes


@dataclass(frozen=True)
class ApplyResult:
    applied: int  # the filter's stored id after the call
    handled: int  # changes handled from the start of the batch, skipped ones included
    gap: bool  # the batch starts after applied + 1: nothing more handled; re-read the log
    results: list[bool] = field(default_factory=list)  # per handled change (see apply_changes)
    skipped: int = 0  # of the handled ones, those an earlier call had applied


SOURCE = Limit(1, MAX_SOURCE)  # 0 is "none": a change log has an identity
CHANGE_ID = Limit(1, MAX_CHANGE_ID)


def _check_source(source: object) -> bytes:
    SOURCE.check("source", source)
    assert isinstance(source, int)
    return source.to_bytes(8, "big")


Item = tuple[int, bool, bytes]  # a checked change: id, insert, the item's bytes


def _checked(changes: Sequence[Change]) -> list[Item]:
    """(id, insert, item bytes) per change, once the ids are known to be gapless."""
    out: list[Item] = []
    for k, change in enumerate(changes):
        if not isinstance(change, Change):
            raise InvalidParameterError(f"changes[{k}] must be a Change, got {change!r}")
        CHANGE_ID.check(f"changes[{k}].id", change.id)
        if out and change.id != out[0][0] + k:
            raise InvalidParameterError(
                f"changes[{k}].id must be {out[0][0] + k}: ids are consecutive, got {change.id}"
            )
        out.append((change.id, bool(change.insert), to_bytes(change.item)))
    return out


def _change_args(part: Sequence[Item], seed: int) -> list[str | int]:
    args: list[str | int] = []
    for _, insert, data in part:
        h, g = item_hash(data, seed)
        args += ("i" if insert else "d", h, g)
    return args


class _Sender:
    """Sends the calls of one operation whose scripts may grow the filter, as insert does:
    with the spare keys growth needs (without them during a slot migration), again after a
    stale layout; the retry counts hold for the whole operation."""

    def __init__(self, f: FilterOps, script: str, source: int) -> None:
        self.f, self.script, self.source = f, script, source
        self.stale = self.spare_less = 0
        self.spares = 2

    def call(self, tail: Callable[[Layout], list[Any]]) -> Op:
        """One call; ``tail(layout)`` gives the arguments after the layout's. Returns the
        reply (any status but STALE and SOURCE)."""
        f = self.f
        while True:
            if not f._layout.buckets0:
                yield from f._probe_op()
            layout = f._layout
            # Spare keys for growth; a filter that never grows needs none.
            keys = f._keys(layout.subfilters + (self.spares if layout.expansion else 0))
            try:
                (reply,) = yield Round([Call(self.script, keys, [*layout.args(), *tail(layout)])])
            except (ClusterError, TryAgainError):
                # A script some of whose keys are missing gets TRYAGAIN during a slot
                # migration; without the spares it runs (only growth waits for the end).
                self.spare_less += 1
                if not self.spares or self.spare_less > MAX_RETRIES:
                    raise
                self.spares = 0
                continue
            if reply[0] == scripts.SOURCE:
                raise ChangeSourceError(f.name, int.from_bytes(reply[2], "big"), self.source)
            if reply[0] == scripts.NEEDKEYS:
                self.spares = 2
            if f._adopt(reply):
                self.stale += 1
                if self.stale > MAX_RETRIES:
                    raise GuardError(f"{f.name}: layout kept changing during {self.script}")
                continue
            return reply


@forgets_on_damage
def apply_op(f: FilterOps, changes: Sequence[Change], source: int) -> Op:
    """Apply ``changes`` in order, each exactly once (guard/lua/apply.lua).

    Long batches go in chunks, one script call each; a call stopped by growth that needs
    keys is sent again from where it stopped. Whatever an earlier call applied (a replay, a
    chunk sent twice) the script skips by itself.
    """
    src = _check_source(source)
    batch = _checked(changes)
    results: list[bool] = []
    skipped = 0
    sender = _Sender(f, "apply", source)
    while True:
        if not f._layout.buckets0:
            yield from f._probe_op()
        part = batch[len(results) : len(results) + insert_chunk(f._layout.max_kicks)]
        first = part[0][0] if part else 1

        def tail(layout: Layout, part: list[Item] = part, first: int = first) -> list[Any]:
            return [src, first, *_change_args(part, layout.seed)]

        reply = yield from sender.call(tail)
        if reply[0] == scripts.OK and len(reply) == 4 and part:
            # A call always takes its first change: this is not our script (never loop).
            raise GuardError(f"{f.name}: apply made no progress", filter=f.name)
        applied = int(reply[2])
        skipped += int(reply[3])
        results.extend(bool(r) for r in reply[4:])
        if reply[0] == scripts.GAP:
            return ApplyResult(applied, len(results), True, results, skipped)
        if reply[0] == scripts.FULL:
            raise FilterFullError(
                f"filter {f.name!r} is full: changes applied up to id {applied}, "
                f"{len(results)} of {len(batch)} handled",
                results + [False] * (len(batch) - len(results)),
            )
        if len(results) >= len(batch):
            return ApplyResult(applied, len(results), False, results, skipped)


@forgets_on_damage
def undo_op(f: FilterOps, change: Change, source: int) -> Op:
    """Take ``change`` back if it is the last change applied (guard/lua/undo.lua)."""
    src = _check_source(source)
    item = _checked([change])

    def tail(layout: Layout) -> list[Any]:
        return [src, change.id, *_change_args(item, layout.seed)]

    sender = _Sender(f, "undo", source)
    while True:
        reply = yield from sender.call(tail)
        if reply[0] == scripts.FULL:
            raise FilterFullError(f"filter {f.name!r} is full: change {change.id} not undone")
        if reply[0] == scripts.OK:
            return bool(reply[2])
        # NEEDKEYS: growth needs a key the call did not carry; the sender adds them again.


@forgets_on_damage
def applied_op(f: FilterOps) -> Op:
    """The stored ``applied`` id, read-only (it runs on a replica).

    With a layout cached, one BITFIELD_RO reads sub-filter 0's tag beside the id: the tag
    proves the string is the one the layout describes, as for a lookup. Otherwise, or when
    the tag disagrees, the probe verifies every sub-filter and the id comes from its header.
    """
    for _ in range(MAX_RETRIES):
        layout = f._layout
        if not layout.buckets0:
            break
        tag_at = (layout.string_bytes(0) - TAG_BYTES) * 8
        used = f._read_command
        read = Command(used, [f.key(0), "GET", "i64", tag_at, "GET", "i64", APPLIED_AT * 8])
        try:
            ((tag, applied),) = yield Round([read])
        except ResponseError as exc:
            # fakeredis has no BITFIELD_RO; BITFIELD with only GETs reads the same.
            if used == "BITFIELD_RO" and "bitfield_ro" in str(exc).lower():
                f._read_command = "BITFIELD"
                continue
            raise
        expected = int.from_bytes(layout.tag(0), "big", signed=True)
        if tag == expected and 0 <= applied <= MAX_CHANGE_ID:
            return int(applied)
        break
    stored = yield from f._probe_op()
    return unpack_header(stored[0].header).applied
