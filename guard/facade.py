"""The public methods of every filter handle, written once for sync, asyncio and pipelines.

Every public operation is declared here, once: ``Facade``'s are every handle's, ``ChangeFeed``'s
a single filter's. Each builds an operation (guard/ops.py) from the handle's own, as the handle
contract (guard/handle.py: ``_insert_op`` and the rest) declares them and guard/filter.py and
guard/sharded.py write them, and hands it to the object it is called on: a blocking handle runs
it, an asyncio handle returns a coroutine, a pipeline queues it (``self`` is the handle either
way: a pipeline passes its own). The ``operation`` descriptor does the hand-over and types each
flavour's result apart, as redis-py does for its two clients. Adding one: docs/extending.md.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar, overload

from guard import scripts
from guard.bulk import Items, load_op
from guard.changes import ApplyResult, Change
from guard.coalesce import LookupCoalescer
from guard.driver import AsyncRunner, SyncRunner
from guard.handle import ChangeFeedHandle, FilterHandle
from guard.hashing import to_bytes
from guard.ops import OneCommand, Op, lockstep, raise_first
from guard.params import FilterParams

P = ParamSpec("P")
T = TypeVar("T")
InfoT = TypeVar("InfoT")  # what info() and reserve() return: FilterInfo or ShardedFilterInfo


class operation(Generic[P, T]):
    """A public method defined by the operation it builds; see the module docstring."""

    def __init__(self, make: Callable[Concatenate[Any, P], Op[T]]) -> None:
        self.make = make
        self.name = make.__name__
        self.__doc__ = make.__doc__

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> operation[P, T]: ...
    @overload
    def __get__(
        self, obj: AsyncRunner, owner: type | None = None
    ) -> Callable[P, Coroutine[Any, Any, T]]: ...
    @overload
    def __get__(self, obj: SyncRunner, owner: type | None = None) -> Callable[P, T]: ...
    @overload
    def __get__(self, obj: _Queue[Any], owner: type | None = None) -> Callable[P, None]: ...
    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        method = obj._bind(self.make)
        method.__name__, method.__doc__ = self.name, self.__doc__
        # Kept on the object, as functools.cached_property does: a loop of calls binds once.
        obj.__dict__[self.name] = method
        return method

    def __call__(self, obj: Any, *args: P.args, **kwargs: P.kwargs) -> Any:
        """``Class.method(handle, ...)``, as with a plain method."""
        return obj._bind(self.make)(*args, **kwargs)


class Facade(Generic[InfoT]):
    """The methods every handle has, pipelines' too. ``InfoT``: what ``info()`` and
    ``reserve()`` return."""

    name: str

    @operation
    def reserve(
        self: FilterHandle[InfoT],
        capacity: int | FilterParams,
        *,
        applied: int = 0,
        source: int = 0,
        **params: Any,
    ) -> Op[InfoT]:
        """Create the filter: ``reserve(capacity, **params)`` with error_rate |
        fingerprint_bits, bucket_size, max_kicks, expansion (0 = fixed size), seed (see
        guard/params.py), or ``reserve(FilterParams(...))``. A sharded filter's capacity is the
        total; each shard gets its share plus headroom. ``applied`` and ``source``: where a
        filter made from a database snapshot stands in its change log (guard/changes.py;
        not for a sharded filter)."""
        return (yield from self._reserve_op(FilterParams.of(capacity, **params), applied, source))

    @operation
    def bulk_load(
        self: FilterHandle[InfoT],
        items: Items,
        capacity: int | None = None,
        *,
        replace: bool = False,
        promote: bool = True,
        applied: int = 0,
        source: int = 0,
        **params: Any,
    ) -> Op[InfoT]:
        """Make the filter from ``items`` in one build (guard/bulk.py), far faster than
        inserting them: str/bytes items or lists of them, streamed (an asyncio handle also
        reads an async iterable, and builds in a worker thread). ``capacity`` (None: the items
        read), ``applied``, ``source`` and ``params`` as ``reserve()`` takes them. ``replace``:
        swap out an existing filter atomically (else FilterExistsError, raised before the input
        is read and checked again by the swap). ``promote=False``: leave the build in
        ``staging()`` for the caller to change and promote. Returns the written filter's info."""
        return load_op(
            self,
            items,
            capacity,
            params,
            replace=replace,
            promote=promote,
            applied=applied,
            source=source,
        )

    @operation
    def insert(self: FilterHandle[InfoT], item: str | bytes) -> Op[bool]:
        """Add one copy of ``item`` (present or not)."""
        return (yield from self._insert_op([item], False))[0]

    @operation
    def insert_unique(self: FilterHandle[InfoT], item: str | bytes) -> Op[bool]:
        """Add ``item`` unless it (or an item with its fingerprint) seems present."""
        return (yield from self._insert_op([item], True))[0]

    @operation
    def insert_many(
        self: FilterHandle[InfoT], items: Iterable[str | bytes], unique: bool = False
    ) -> Op[list[bool]]:
        """``insert`` (``insert_unique``) of each item; a full fixed-size filter raises
        FilterFullError, whose ``results`` say which items were added."""
        return self._insert_op(items, unique)

    @operation
    def lookup(self: FilterHandle[InfoT], item: str | bytes) -> Op[bool]:
        """Whether ``item`` is probably present (False is certain)."""
        return self._lookup_one_op(item)

    @operation
    def lookup_many(self: FilterHandle[InfoT], items: Iterable[str | bytes]) -> Op[list[bool]]:
        """``lookup`` of each item."""
        return self._lookup_op([to_bytes(x) for x in items])

    @operation
    def count(self: FilterHandle[InfoT], item: str | bytes) -> Op[int]:
        """Copies of ``item``'s fingerprint in its two buckets (an upper bound of its count)."""
        return int((yield from self._batch_op(scripts.COUNT, [item]))[0])

    @operation
    def delete(self: FilterHandle[InfoT], item: str | bytes) -> Op[bool]:
        """Remove one copy of ``item``; only delete what was inserted (deleting an item that
        was not can remove another one's fingerprint: a false negative)."""
        return bool((yield from self._batch_op(scripts.DELETE, [item]))[0])

    @operation
    def delete_many(self: FilterHandle[InfoT], items: Iterable[str | bytes]) -> Op[list[bool]]:
        """``delete`` of each item."""
        return [bool(r) for r in (yield from self._batch_op(scripts.DELETE, items))]

    @operation
    def info(self: FilterHandle[InfoT]) -> Op[InfoT]:
        """Size, load, counters and estimated error rate, read from the stored headers."""
        return self._info_op()

    @operation
    def exists(self: FilterHandle[InfoT]) -> Op[bool]:
        """Whether the filter's first key exists (no check of its bytes)."""
        return self._exists_op()

    @operation
    def drop(self: FilterHandle[InfoT]) -> Op[bool]:
        """Delete the filter; False when there was none."""
        return self._drop_op()

    @operation
    def promote(self: FilterHandle[InfoT], *, unless_behind: bool = False) -> Op[bool]:
        """Atomically replace the live filter by this staging copy (see ``staging()``). With
        ``unless_behind``, raise StagingBehindError instead when the live filter follows the
        same change feed and has applied more of it."""
        return self._promote_op(unless_behind=unless_behind)


class ChangeFeed:
    """The change feed's methods (guard/changes.py): a single filter's handles have them
    (guard/filter.py), a sharded filter's and the pipelines do not."""

    @operation
    def apply_changes(
        self: ChangeFeedHandle[Any], changes: Sequence[Change], *, source: int
    ) -> Op[ApplyResult]:
        """Apply database changes in order, each exactly once: see guard/changes.py."""
        return self._apply_changes_op(changes, source)

    @operation
    def applied_change(self: ChangeFeedHandle[Any]) -> Op[int]:
        """The id of the last database change applied to the filter (0: none)."""
        return self._applied_change_op()

    @operation
    def undo_change(self: ChangeFeedHandle[Any], change: Change, *, source: int) -> Op[bool]:
        """Take ``change`` back if it is the last one applied; False (nothing done) if not."""
        return self._undo_change_op(change, source)


class SyncHandle(SyncRunner, Facade[InfoT], FilterHandle[InfoT]):
    """A handle over a blocking client: each method runs its operation and returns."""

    def _bind(self, make: Callable[..., Op[Any]]) -> Callable[..., Any]:
        return lambda *args, **kwargs: self._run(make(self, *args, **kwargs))

    def pipeline(self) -> Pipeline[InfoT]:
        """Operations queued now and sent together by ``execute()`` (see ``Pipeline``)."""
        return Pipeline(self)


class AsyncHandle(AsyncRunner, Facade[InfoT], FilterHandle[InfoT]):
    """A handle over an asyncio client: each method returns a coroutine."""

    def _start(self, coalesce: bool) -> None:
        """With ``coalesce``, concurrent lookups on the handle go together (guard/coalesce.py)."""
        self._coalescer = LookupCoalescer(self._lookup_now) if coalesce else None

    def _bind(self, make: Callable[..., Op[Any]]) -> Callable[..., Any]:
        async def method(*args: Any, **kwargs: Any) -> Any:
            return await self._run(make(self, *args, **kwargs))

        return method

    async def _lookup_now(self, data: list[bytes]) -> list[bool]:
        if len(data) == 1:  # a lone request's lookup: the single-item operation
            return [await self._run(self._lookup_one_op(data[0]))]
        return await self._run(self._lookup_op(data))

    async def lookup(self, item: str | bytes) -> bool:  # type: ignore[override]
        """Whether ``item`` is probably present (False is certain)."""
        if self._coalescer is None:  # else the lookup goes through the coalescer
            return await self._run(self._lookup_one_op(item))
        return (await self._coalescer.lookup_many([to_bytes(item)]))[0]

    async def lookup_many(self, items: Iterable[str | bytes]) -> list[bool]:  # type: ignore[override]
        """``lookup`` of each item."""
        data = [to_bytes(x) for x in items]  # a bad item fails its own caller, not the batch
        if self._coalescer is None:
            return await self._lookup_now(data)
        return await self._coalescer.lookup_many(data)

    def pipeline(self) -> AsyncPipeline[InfoT]:
        """Operations queued now and sent together by ``await execute()``."""
        return AsyncPipeline(self)


class _Queue(Facade[InfoT]):
    """A pipeline: the handle's methods queue their operations, ``execute()`` runs them side
    by side (guard/ops.py: ``lockstep``), in the round trips of the longest one; results come
    back in the order of the calls. Each operation keeps its own retries, growth and errors;
    nothing is atomic or ordered across them (one that needs a second round runs it after the
    others' first), so queue operations that do not depend on each other: an insert and a
    lookup of the same item may run in either order.
    """

    def __init__(self, handle: FilterHandle[InfoT]) -> None:
        self._handle = handle
        self._ops: list[Op[Any] | OneCommand] = []

    def __len__(self) -> int:
        return len(self._ops)

    def _bind(self, make: Callable[..., Op[Any]]) -> Callable[..., Any]:
        return lambda *args, **kwargs: self._ops.append(make(self._handle, *args, **kwargs))

    # A loop queues single lookups by the hundred: each in a form lockstep runs without a
    # generator (guard/ops.py: OneCommand).
    def lookup(self, item: str | bytes) -> None:  # type: ignore[override]
        """Whether ``item`` is probably present (False is certain)."""
        self._ops.append(self._handle._queued_lookup(item))

    def _all(self, raise_on_error: bool) -> Op[list[Any]]:
        ops, self._ops = self._ops, []
        results = yield from lockstep(dict(enumerate(ops)))
        out = [results[k] for k in range(len(ops))]
        if raise_on_error:
            raise_first(out)
        return out


class Pipeline(_Queue[InfoT]):
    """Blocking: ``cf.pipeline()``; queue with the handle's methods, then ``execute()``."""

    _handle: SyncHandle[InfoT]

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        """Run the queued operations; their results in order. With ``raise_on_error`` the
        first failure is raised once all have run, else each failure stands in its place."""
        return self._handle._run(self._all(raise_on_error))


class AsyncPipeline(_Queue[InfoT]):
    """Asyncio: ``cf.pipeline()``; queue with the handle's methods, then ``await execute()``."""

    _handle: AsyncHandle[InfoT]

    async def execute(self, raise_on_error: bool = True) -> list[Any]:
        """Run the queued operations; see ``Pipeline.execute``."""
        return await self._handle._run(self._all(raise_on_error))
