"""Database changes applied to a filter exactly once, with the id of the last one in its bytes.

A filter that follows a database's change log (docs/format.md, "Change feed") stores in
sub-filter 0's header ``applied``, the id of the last change applied, and ``source``, the change
log it belongs to. guard/lua/apply.lua applies a batch and moves ``applied`` in the same script,
skipping what an earlier call applied: a follower that crashes and replays, or two that
overlap, apply each change once. A filter restored from an older copy carries its older id, so
the guard sees it is behind. The operations are a single filter's (guard/facade.py:
``ChangeFeed``, written in guard/filter.py); here are what they take and answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from guard.errors import InvalidParameterError
from guard.hashing import item_hash, to_bytes
from guard.layout import MAX_CHANGE_ID, MAX_SOURCE
from guard.params import Limit


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


CHANGE_SOURCE = Limit(1, MAX_SOURCE)  # a change log's identity (0 is "none": not one)
CHANGE_ID = Limit(1, MAX_CHANGE_ID)
Item = tuple[int, bool, bytes]  # a checked change: id, insert, the item's bytes


def validate_changes(changes: Sequence[Change], source: int) -> tuple[bytes, list[Item]]:
    """``changes`` and ``source`` checked (InvalidParameterError naming the one at fault: ids
    in range and consecutive) and put as the scripts take them: ``source``'s 8 bytes, and
    (id, insert, item bytes) per change."""
    CHANGE_SOURCE.check("source", source)
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
    return source.to_bytes(8, "big"), out


def change_args(part: Sequence[Item], seed: int) -> list[str | int]:
    """The script arguments of checked changes, hashed with ``seed``."""
    args: list[str | int] = []
    for _, insert, data in part:
        h, g = item_hash(data, seed)
        args += ("i" if insert else "d", h, g)
    return args
