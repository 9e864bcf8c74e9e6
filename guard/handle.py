"""The handle contract: the operations a filter is made of, for everything built on them.

A filter's operations are generators of calls (guard/ops.py) written twice, for one filter
(guard/filter.py: ``FilterOps``) and for one over shards (guard/sharded.py: ``ShardedOps``).
The handles' public methods (guard/facade.py), a bulk build (guard/bulk.py), an export or an
import (guard/dump.py) and a listing (guard/listing.py) use nothing else of theirs than
``FilterHandle`` says; both implementations subclass it, so mypy holds them to it.
``ChangeFeedHandle`` adds the change feed's operations (guard/changes.py), which a single
filter has and a sharded one does not. Adding an operation: docs/extending.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any, NamedTuple, Protocol, Self, TypeVar

from guard.changes import ApplyResult, Change
from guard.ops import OneCommand, Op
from guard.params import FilterParams

InfoT_co = TypeVar("InfoT_co", covariant=True)  # what info() answers: FilterInfo or a sharded one


class Target(NamedTuple):
    """What a build writes, as the staging copy's handle says (``_bulk_target``): the filters
    that hold the items and what their headers record."""

    parts: list[Any]  # each a single filter's FilterOps (a shard, or the filter itself)
    shards: int = 0  # as the headers record it: 0 for a plain filter
    share: Callable[[int], int] | None = None  # one part's capacity, from the total
    keep_seed: Callable[[], Op[int | None]] | None = None  # the live filter's, if it has one

    def params(self, made: FilterParams, total: int, seed: int | None) -> FilterParams:
        return replace(made, capacity=self.share(total) if self.share else total, seed=seed)


class FilterHandle(Protocol[InfoT_co]):
    """What every filter, sharded or not, provides: each operation as a generator of calls,
    run by whoever holds it (a blocking or asyncio handle, a pipeline, another operation)."""

    redis: Any
    name: str
    prefix: str
    key: Callable[..., str]  # a key of the filter: key(n) of sub-filter n; key(shard, n)

    def staging(self) -> Self:
        """The same filter's staging copy (same hash tags), for ``promote`` to swap in."""
        ...

    def _reserve_op(self, params: FilterParams, applied: int, source: int) -> Op[InfoT_co]: ...
    def _insert_op(self, items: Iterable[str | bytes], unique: bool) -> Op[list[bool]]: ...
    def _lookup_op(self, data: list[bytes]) -> Op[list[bool]]: ...
    def _lookup_one_op(self, item: str | bytes) -> Op[bool]: ...
    def _queued_lookup(self, item: str | bytes) -> Op[bool] | OneCommand: ...
    def _batch_op(self, script: str, items: Iterable[str | bytes]) -> Op[list[Any]]:
        """A script of guard/scripts.py (COUNT, DELETE) per item: each item's answer."""
        ...

    def _info_op(self) -> Op[InfoT_co]: ...
    def _exists_op(self) -> Op[bool]: ...
    def _drop_op(self) -> Op[bool]: ...
    def _promote_op(self, only_if_new: bool = False, *, unless_behind: bool = False) -> Op[bool]:
        """Swap this staging copy in for the live filter (guard/lua/promote.lua)."""
        ...

    def _bulk_target(self, applied: int, source: int) -> Target:
        """What a bulk build writes when this is the staging copy (guard/bulk.py)."""
        ...


class ChangeFeedHandle(FilterHandle[InfoT_co], Protocol[InfoT_co]):
    """A filter that follows a database's change log (guard/changes.py): a single filter."""

    def _apply_changes_op(self, changes: Sequence[Change], source: int) -> Op[ApplyResult]: ...
    def _applied_change_op(self) -> Op[int]: ...
    def _undo_change_op(self, change: Change, source: int) -> Op[bool]: ...


__all__ = ["ChangeFeedHandle", "FilterHandle", "Target"]
