"""ShardedCuckooFilter (asyncio) and SyncShardedCuckooFilter: one filter over N sub-tables.

Shard ``i`` is an ordinary filter under its own hash tag (``PREFIX{NAME:i}``), so Redis Cluster
places the shards in different slots and, as the slots fall, on different nodes; every script
still touches the keys of one slot only. An item's shard is bits 96..127 of its hash
(guard/hashing.py: ``shard_of``), which the bucket and fingerprint bits never use.

Nothing here re-implements the filter: each operation runs the single filter's generators,
one per shard, in lock step. The drivers send one round of every shard at once (asyncio:
``gather``; sync: one pipeline, which a ``RedisCluster`` writes to every node before reading).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from typing import Any

from redis.exceptions import ResponseError

from guard import bulk, scripts
from guard import layout as fmt
from guard.coalesce import LookupCoalescer
from guard.errors import (
    FilterCorruptError,
    FilterExistsError,
    FilterFullError,
    FilterNotFoundError,
    GuardError,
    InvalidParameterError,
)
from guard.filter import (
    DEFAULT_PREFIX,
    MAX_RETRIES,
    STAGING,
    Command,
    CuckooFilter,
    FilterInfo,
    Round,
    SyncCuckooFilter,
    _eval_args,
    _FilterOps,
    _plan,
    _raise_first_error,
    _unloaded,
)
from guard.hashing import shard_of, to_bytes

MAX_SHARDS = fmt.MAX_SHARDS

# One round per shard; each answer is the round's replies or the exception it raised.
ShardOp = Generator[dict[int, Round], dict[int, Any], Any]


@dataclass(frozen=True)
class ShardedFilterInfo(FilterInfo):
    """The shards' counters added up; ``per_shard`` keeps each shard's own."""

    shards: int = 1
    per_shard: tuple[FilterInfo, ...] = ()


class _Rerouted(Exception):
    """A shard's seed changed under this handle: the filter was recreated, routes are stale."""


def shard_capacity(capacity: int, shards: int) -> int:
    """Capacity of one shard: an equal share plus 4 standard deviations of the share's
    spread, so a fixed-size sharded filter still holds ``capacity`` items (items fall into
    shards at random; the fullest of N shards gets more than capacity / N)."""
    if shards == 1:
        return capacity
    share = capacity / shards
    return min(capacity, math.ceil(share + 4 * math.sqrt(share)))


class _ShardedOps:
    """The sharded operations, as generators of per-shard rounds. Shared by both drivers."""

    def __init__(self, name: str, shards: int, handles: list[_FilterOps]) -> None:
        self.name = name
        self.shards = shards
        self._handles = handles
        self._seed: int | None = None  # the routing seed, learned from the shards' headers

    def key(self, shard: int, n: int = 0) -> str:
        return self._handles[shard].key(n)

    def nodes(self) -> list[str | None]:
        """The cluster node (``host:port``) serving each shard, from the client's slot map;
        None per shard on a plain Redis. No I/O: shows whether the shards spread. (An asyncio
        RedisCluster knows its slot map after its first command.)"""
        locate = getattr(getattr(self, "redis", None), "get_node_from_key", None)
        if locate is None:
            return [None] * self.shards
        return [str(locate(self.key(i)).name) for i in range(self.shards)]

    # -- the lock-step runner ------------------------------------------------------------

    def _fan(self, ops: dict[int, Generator[Round, list[Any], Any]]) -> ShardOp:
        """Run one single-filter operation per shard; returns {shard: result or exception}."""
        results: dict[int, Any] = {}
        pending: dict[int, Round] = {}
        for i, op in ops.items():
            self._step(i, op, None, pending, results)
        while pending:
            answers = yield dict(pending)
            current, pending = pending, {}
            for i in current:
                self._step(i, ops[i], answers[i], pending, results)
        return results

    def _step(
        self,
        i: int,
        op: Generator[Round, list[Any], Any],
        answer: Any,
        pending: dict[int, Round],
        results: dict[int, Any],
    ) -> None:
        """Advance shard ``i``'s operation by one round (None: its first)."""
        try:
            if answer is None:
                rnd = next(op)
            elif isinstance(answer, BaseException):
                rnd = op.throw(answer)
            else:
                rnd = op.send(answer)
        except StopIteration as done:
            results[i] = done.value
            return
        except Exception as exc:
            results[i] = exc
            return
        layout = self._handles[i]._layout
        # A STALE reply wrote nothing; if it carried another seed, the filter was recreated
        # and this shard's items were routed with the old one: stop before anything is sent.
        if self._seed is not None and layout.buckets0 and layout.seed != self._seed:
            op.close()
            results[i] = _Rerouted()
            return
        pending[i] = rnd

    # -- operations ----------------------------------------------------------------------

    def _open_op(self) -> ShardOp:
        """Read every shard's sub-filter 0: all present, verified (guard/layout.py), same
        seed, and made with this shard count. Read-only commands: fine on a replica."""
        answers = yield {
            i: Round(
                [
                    Command("EXISTS", [h.key(0)]),
                    *(Command(*read) for read in fmt.probe_reads(h.key(0))),
                    Command("EXISTS", [h.key(1)]),
                ],
                atomic=True,
            )
            for i, h in enumerate(self._handles)
        }
        for answer in answers.values():
            if isinstance(answer, BaseException):
                raise answer
        present = [i for i in range(self.shards) if answers[i][0]]
        if not present:
            if any(answers[i][4] for i in range(self.shards)):  # sub-filters left: damage
                raise FilterCorruptError(self.name, "every shard's sub-filter 0 is missing")
            raise FilterNotFoundError(f"{self.name}: no such filter")
        seeds, recorded = set(), set()
        for i in present:
            stored = fmt.Stored(self.key(i), *answers[i][1:4])
            seeds.add(fmt.verify_stored(self.name, [stored]).seed)
            recorded.add(fmt.unpack_header(stored.header).shards)
        if len(recorded) > 1:
            raise FilterCorruptError(self.name, f"the shards record shard counts {recorded}")
        if recorded != {self.shards}:
            raise InvalidParameterError(
                f"{self.name}: the filter has {recorded.pop()} shard(s); this handle was opened "
                f"with shards={self.shards}"
            )
        if len(present) < self.shards:
            missing = sorted(set(range(self.shards)) - set(present))
            raise FilterCorruptError(self.name, f"shard(s) {missing} missing")
        if len(seeds) != 1:
            raise FilterCorruptError(self.name, "the shards have different seeds")
        self._seed = seeds.pop()

    def _items_op(
        self,
        items: Iterable[str | bytes],
        make: Callable[[_FilterOps, list[bytes]], Generator[Round, list[Any], Any]],
    ) -> ShardOp:
        """Route items to their shards, run ``make`` per shard, put the answers back in order."""
        data = [to_bytes(x) for x in items]
        out: list[Any] = [None] * len(data)
        todo = list(range(len(data)))
        full: list[FilterFullError] = []
        for _ in range(MAX_RETRIES):
            if not todo:
                break
            if self._seed is None:
                yield from self._open_op()
            seed = self._seed
            assert seed is not None
            groups: dict[int, list[int]] = {}
            for k in todo:
                groups.setdefault(shard_of(data[k], seed, self.shards), []).append(k)
            results = yield from self._fan(
                {i: make(self._handles[i], [data[k] for k in idx]) for i, idx in groups.items()}
            )
            todo, errors = [], []
            for i, idx in groups.items():
                result = results[i]
                if isinstance(result, _Rerouted):
                    todo.extend(idx)
                    continue
                if isinstance(result, FilterFullError):
                    full.append(result)
                    result = result.results
                elif isinstance(result, BaseException):
                    if isinstance(result, FilterNotFoundError):
                        # One shard gone is a damaged filter, all gone a dropped one: the
                        # open check tells which (and raises it).
                        self._seed = None
                        yield from self._open_op()
                    errors.append(result)
                    continue
                for k, r in zip(idx, result, strict=True):
                    out[k] = r
            if errors:
                raise errors[0]
            if todo:
                self._seed = None  # re-read the headers, then route the moved items again
                todo.sort()
        if todo:
            raise GuardError(f"{self.name}: the filter kept being recreated during the call")
        if full:
            added = sum(bool(r) for r in out)
            raise FilterFullError(
                f"filter {self.name!r}: {len(full)} shard(s) full ({added} of {len(data)} "
                "items added)",
                [bool(r) for r in out],
            )
        return out

    def _reserve_op(self, capacity: int, params: dict[str, Any]) -> ShardOp:
        answers = yield {
            i: Round([Command("EXISTS", [h.key(0)])]) for i, h in enumerate(self._handles)
        }
        for answer in answers.values():
            if isinstance(answer, BaseException):
                raise answer
        if any(answer[0] for answer in answers.values()):
            raise FilterExistsError(f"{self.name}: filter exists")
        params = dict(params)
        if params.get("seed") is None:
            params["seed"] = yield from self._seed_to_keep()
        per_shard = shard_capacity(capacity, self.shards)
        layout = _plan(per_shard, **params)  # validates everything before any write
        self._seed = layout.seed
        results = yield from self._fan(
            {
                i: h._reserve_op(layout, per_shard, params.get("error_rate"), self.shards)
                for i, h in enumerate(self._handles)
            }
        )
        return self._combine(results)

    def _seed_to_keep(self) -> Generator[dict[int, Round], dict[int, Any], int | None]:
        return None
        yield {}  # a generator; a staging copy overrides it

    def _info_op(self) -> ShardOp:
        yield from self._open_op()  # info is not hot: re-check the shard count every time
        results = yield from self._fan({i: h._info_op() for i, h in enumerate(self._handles)})
        return self._combine(results)

    def _combine(self, results: dict[int, Any]) -> ShardedFilterInfo:
        for i in range(self.shards):
            if isinstance(results[i], _Rerouted):
                self._seed = None
                raise GuardError(f"{self.name}: the filter was recreated during info")
            if isinstance(results[i], BaseException):
                raise results[i]
        infos: list[FilterInfo] = [results[i] for i in range(self.shards)]
        first = infos[0]
        items = sum(x.items for x in infos)
        buckets = sum(x.buckets for x in infos)
        return ShardedFilterInfo(
            name=self.name,
            capacity=sum(x.capacity for x in infos),
            items=items,
            buckets=buckets,
            bucket_size=first.bucket_size,
            fingerprint_bits=first.fingerprint_bits,
            max_kicks=first.max_kicks,
            expansion=first.expansion,
            subfilters=max(x.subfilters for x in infos),
            load_factor=items / (buckets * first.bucket_size),
            memory_bytes=sum(x.memory_bytes for x in infos),
            # An absent item is checked against its one shard: the mean of the shards' rates.
            error_rate=sum(x.error_rate for x in infos) / self.shards,
            target_error_rate=first.target_error_rate,
            deletes=sum(x.deletes for x in infos),
            missed_deletes=sum(x.missed_deletes for x in infos),
            shards=self.shards,
            per_shard=tuple(infos),
        )

    def _drop_op(self) -> ShardOp:
        results = yield from self._fan({i: h._drop_op() for i, h in enumerate(self._handles)})
        self._seed = None
        for r in results.values():
            if isinstance(r, BaseException):
                raise r
        return any(results.values())

    def _promote_op(self, live: _ShardedOps) -> ShardOp:
        # Each shard is replaced atomically; the staging copy keeps the live seed (see
        # _seed_to_keep), so an item routes to the same shard in the old and the new copy and
        # a lookup between two shards' promotes still finds it.
        yield from self._open_op()
        results = yield from self._fan(
            {i: h._promote_op(live._handles[i]) for i, h in enumerate(self._handles)}
        )
        for r in results.values():
            if isinstance(r, BaseException):
                raise r
        live._seed, self._seed = self._seed, None
        return True


class _StagingMixin(_ShardedOps):
    _live: _ShardedOps

    def _seed_to_keep(self) -> Generator[dict[int, Round], dict[int, Any], int | None]:
        try:
            yield from self._live._open_op()
        except FilterNotFoundError:
            return None
        return self._live._seed


def _check_shards(shards: object) -> int:
    if isinstance(shards, bool) or not isinstance(shards, int) or not 1 <= shards <= MAX_SHARDS:
        raise InvalidParameterError(
            f"shards must be an integer from 1 to {MAX_SHARDS}, got {shards!r}"
        )
    return shards


class ShardedCuckooFilter(_ShardedOps):
    """A filter spread over ``shards`` hash tags, over ``redis.asyncio`` (Redis or
    RedisCluster); creating the handle does no I/O. Same methods as ``CuckooFilter``."""

    def __init__(
        self,
        redis: Any,
        name: str,
        prefix: str = DEFAULT_PREFIX,
        *,
        shards: int,
        coalesce: bool = True,
        _variant: str = "",
    ) -> None:
        shards = _check_shards(shards)
        handles: list[_FilterOps] = [
            CuckooFilter(redis, name, prefix, coalesce=False, _variant=_variant, _shard=i)
            for i in range(shards)
        ]
        super().__init__(name, shards, handles)
        self.redis = redis
        self.prefix = prefix
        self._coalescer = LookupCoalescer(self._lookup_now) if coalesce else None

    async def _run(self, op: ShardOp) -> Any:
        try:
            rounds = next(op)
            while True:
                order = list(rounds)
                answers = await asyncio.gather(*(self._execute(i, rounds[i]) for i in order))
                rounds = op.send(dict(zip(order, answers, strict=True)))
        except StopIteration as done:
            return done.value

    async def _execute(self, shard: int, rnd: Round) -> Any:
        handle = self._handles[shard]
        assert isinstance(handle, CuckooFilter)
        try:
            return await handle._execute(rnd)
        except Exception as exc:  # goes back into the shard's operation
            return exc

    async def _lookup_now(self, data: list[bytes]) -> list[bool]:
        result: list[bool] = await self._run(self._items_op(data, lambda h, d: h._lookup_op(d)))
        return result

    def staging(self) -> ShardedCuckooFilter:
        stage = _AsyncStaging(
            self.redis,
            self.name,
            self.prefix,
            shards=self.shards,
            coalesce=False,
            _variant=STAGING,
        )
        stage._live = self
        return stage

    async def reserve(self, capacity: int, **params: Any) -> ShardedFilterInfo:
        """Create the filter: ``capacity`` in total, the other parameters as
        ``CuckooFilter.reserve``; each shard gets capacity / shards plus headroom."""
        return await self._run(self._reserve_op(capacity, params))

    async def bulk_load(
        self, items: Any, capacity: int | None = None, **options: Any
    ) -> ShardedFilterInfo:
        """Make the filter from ``items`` in one build, shard by shard: see
        guard/bulk.py:bulk_load (``capacity`` is the total, as for reserve)."""
        return await bulk.abulk_load(
            self, items, capacity, plan=_plan, share=shard_capacity, **options
        )

    async def insert(self, item: str | bytes) -> bool:
        return (await self.insert_many([item]))[0]

    async def insert_unique(self, item: str | bytes) -> bool:
        return (await self.insert_many([item], unique=True))[0]

    async def insert_many(self, items: Iterable[str | bytes], unique: bool = False) -> list[bool]:
        op = self._items_op(items, lambda h, d: h._insert_op(d, unique))
        return [bool(r) for r in await self._run(op)]

    async def lookup(self, item: str | bytes) -> bool:
        return (await self.lookup_many([item]))[0]

    async def lookup_many(self, items: Iterable[str | bytes]) -> list[bool]:
        data = [to_bytes(x) for x in items]
        if self._coalescer is None:
            return await self._lookup_now(data)
        return await self._coalescer.lookup_many(data)

    async def count(self, item: str | bytes) -> int:
        op = self._items_op([item], lambda h, d: h._batch_op("count", d))
        return int((await self._run(op))[0])

    async def delete(self, item: str | bytes) -> bool:
        return (await self.delete_many([item]))[0]

    async def delete_many(self, items: Iterable[str | bytes]) -> list[bool]:
        op = self._items_op(items, lambda h, d: h._batch_op("delete", d))
        return [bool(r) for r in await self._run(op)]

    async def info(self) -> ShardedFilterInfo:
        return await self._run(self._info_op())

    async def exists(self) -> bool:
        return bool(await self.redis.exists(self.key(0)))

    async def drop(self) -> bool:
        return await self._run(self._drop_op())

    async def promote(self) -> bool:
        """Replace the live filter by this staging copy, shard by shard (each atomically)."""
        live = getattr(self, "_live", None)
        if live is None:
            raise InvalidParameterError("promote() is for a staging copy (see staging())")
        return await self._run(self._promote_op(live))


class _AsyncStaging(_StagingMixin, ShardedCuckooFilter):
    pass


class SyncShardedCuckooFilter(_ShardedOps):
    """The sharded filter over a blocking ``redis.Redis`` or ``redis.cluster.RedisCluster``."""

    def __init__(
        self,
        redis: Any,
        name: str,
        prefix: str = DEFAULT_PREFIX,
        *,
        shards: int,
        _variant: str = "",
    ) -> None:
        shards = _check_shards(shards)
        handles: list[_FilterOps] = [
            SyncCuckooFilter(redis, name, prefix, _variant=_variant, _shard=i)
            for i in range(shards)
        ]
        super().__init__(name, shards, handles)
        self.redis = redis
        self.prefix = prefix

    def _run(self, op: ShardOp) -> Any:
        try:
            rounds = next(op)
            while True:
                rounds = op.send(self._execute_all(rounds))
        except StopIteration as done:
            return done.value

    def _execute_all(self, rounds: dict[int, Round]) -> dict[int, Any]:
        """Every shard's round; the plain ones share one pipeline (on a cluster, redis-py
        writes each node's share before reading any reply, so the nodes work in parallel)."""
        answers: dict[int, Any] = {}
        shared = [i for i, r in rounds.items() if not r.atomic]
        alone = [i for i in rounds if i not in shared or len(shared) == 1]
        if len(shared) > 1:
            answers.update(self._pipelined({i: rounds[i] for i in shared}))
        for i in alone:
            handle = self._handles[i]
            assert isinstance(handle, SyncCuckooFilter)
            try:
                answers[i] = handle._execute(rounds[i])
            except Exception as exc:
                answers[i] = exc
        return answers

    def _pipelined(self, rounds: dict[int, Round]) -> dict[int, Any]:
        calls = [(i, c) for i, r in rounds.items() for c in r.calls]
        try:
            pipe = self.redis.pipeline(transaction=False)
            for i, c in calls:
                handle = self._handles[i]
                assert isinstance(handle, SyncCuckooFilter)
                handle._send(c, pipe)
            replies = pipe.execute(raise_on_error=False)
            # NOSCRIPT (a cluster pipeline does not preload scripts, or a SCRIPT FLUSH raced
            # the preload): those calls did nothing, so they alone are sent again as EVAL.
            for k in _unloaded(replies):
                replies[k] = self.redis.execute_command(*_eval_args(calls[k][1]))
        except ResponseError as exc:
            error = scripts.map_error(exc, self.name)
            return {i: error for i in rounds}
        except Exception as exc:
            return {i: exc for i in rounds}
        answers: dict[int, Any] = {}
        start = 0
        for i, r in rounds.items():
            part = replies[start : start + len(r.calls)]
            start += len(r.calls)
            try:
                answers[i] = _raise_first_error(part, self.name)
            except Exception as exc:
                answers[i] = exc
        return answers

    def staging(self) -> SyncShardedCuckooFilter:
        stage = _SyncStaging(
            self.redis, self.name, self.prefix, shards=self.shards, _variant=STAGING
        )
        stage._live = self
        return stage

    def reserve(self, capacity: int, **params: Any) -> ShardedFilterInfo:
        return self._run(self._reserve_op(capacity, params))

    def bulk_load(
        self, items: Any, capacity: int | None = None, **options: Any
    ) -> ShardedFilterInfo:
        """Make the filter from ``items`` in one build: see guard/bulk.py:bulk_load."""
        return bulk.bulk_load(self, items, capacity, plan=_plan, share=shard_capacity, **options)

    def insert(self, item: str | bytes) -> bool:
        return self.insert_many([item])[0]

    def insert_unique(self, item: str | bytes) -> bool:
        return self.insert_many([item], unique=True)[0]

    def insert_many(self, items: Iterable[str | bytes], unique: bool = False) -> list[bool]:
        op = self._items_op(items, lambda h, d: h._insert_op(d, unique))
        return [bool(r) for r in self._run(op)]

    def lookup(self, item: str | bytes) -> bool:
        return self.lookup_many([item])[0]

    def lookup_many(self, items: Iterable[str | bytes]) -> list[bool]:
        return [bool(r) for r in self._run(self._items_op(items, lambda h, d: h._lookup_op(d)))]

    def count(self, item: str | bytes) -> int:
        return int(self._run(self._items_op([item], lambda h, d: h._batch_op("count", d)))[0])

    def delete(self, item: str | bytes) -> bool:
        return self.delete_many([item])[0]

    def delete_many(self, items: Iterable[str | bytes]) -> list[bool]:
        op = self._items_op(items, lambda h, d: h._batch_op("delete", d))
        return [bool(r) for r in self._run(op)]

    def info(self) -> ShardedFilterInfo:
        return self._run(self._info_op())

    def exists(self) -> bool:
        return bool(self.redis.exists(self.key(0)))

    def drop(self) -> bool:
        return self._run(self._drop_op())

    def promote(self) -> bool:
        live = getattr(self, "_live", None)
        if live is None:
            raise InvalidParameterError("promote() is for a staging copy (see staging())")
        return self._run(self._promote_op(live))


class _SyncStaging(_StagingMixin, SyncShardedCuckooFilter):
    pass


__all__ = ["ShardedCuckooFilter", "ShardedFilterInfo", "SyncShardedCuckooFilter", "shard_capacity"]
