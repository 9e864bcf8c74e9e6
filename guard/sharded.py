"""ShardedCuckooFilter (asyncio) and SyncShardedCuckooFilter: one filter over N sub-tables.

Shard ``i`` is an ordinary filter under its own hash tag (``PREFIX{NAME:i}``), so Redis Cluster
spreads the shards over slots and nodes while every script touches one slot's keys. An item's
shard is bits 96..127 of its hash (guard/hashing.py: ``shard_of``), which the bucket and
fingerprint bits never use. Each operation runs the single filter's, one per shard, in lock step
(guard/ops.py: ``lockstep``), under the same public methods (guard/facade.py): every round of
every shard goes out at once, the plain ones in one pipeline, which a ``RedisCluster`` writes to
every node before reading any reply.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Self

from guard.ages import Ages, RollbackCounter, Rollbacks
from guard.errors import (
    FilterCorruptError,
    FilterExistsError,
    FilterFullError,
    FilterNotFoundError,
    GuardError,
    InvalidParameterError,
)
from guard.facade import AsyncHandle, SyncHandle
from guard.filter import FilterInfo, FilterOps
from guard.handle import FilterHandle, Target
from guard.hashing import shard_of, to_bytes
from guard.layout import MAX_SHARDS, Stored, pack_header, unpack_header, verify_stored
from guard.names import DEFAULT_PREFIX
from guard.ops import MAX_RETRIES, Op, lockstep, raise_first
from guard.params import FilterParams, Limit


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


SHARDS = Limit(1, MAX_SHARDS)
_SUMMED = ("capacity", "items", "buckets", "memory_bytes", "deletes", "missed_deletes")


class ShardedOps(Rollbacks, FilterHandle[ShardedFilterInfo]):
    """The sharded operations; each shard's are a single filter's (guard/filter.py)."""

    def __init__(self, redis: Any, name: str, prefix: str = DEFAULT_PREFIX, *, shards: int) -> None:
        SHARDS.check("shards", shards)
        self.redis, self.name, self.prefix, self.shards = redis, name, prefix, shards
        self._rollbacks = RollbackCounter()  # every shard's rollbacks (guard/ages.py)
        self._handles = [
            FilterOps(redis, name, prefix, _shard=i, _rollbacks=self._rollbacks)
            for i in range(shards)
        ]
        self._seed: int | None = None  # the routing seed, learned from the shards' headers
        self._live: ShardedOps | None = None  # what a staging copy replaces when promoted

    def _age_memories(self) -> list[Ages]:
        return [h._ages for h in self._handles]

    def key(self, shard: int, n: int = 0) -> str:
        return self._handles[shard].key(n)

    def nodes(self) -> list[str | None]:
        """The cluster node (``host:port``) serving each shard, from the client's slot map (an
        asyncio RedisCluster's is known after its first command); None each on a plain Redis."""
        locate = getattr(self.redis, "get_node_from_key", None)
        if locate is None:
            return [None] * self.shards
        return [str(locate(self.key(i)).name) for i in range(self.shards)]

    def staging(self) -> Self:
        """A handle on the staging copy: same shard count, same routing seed (taken from the
        live filter when it is reserved), so ``promote()`` moves no item to another shard."""
        stage = type(self)(self.redis, self.name, self.prefix, shards=self.shards)
        stage._handles = [h.staging() for h in self._handles]
        stage._live = self
        return stage

    def _fan(self, ops: Iterable[Op[Any]]) -> Op[list[Any]]:
        """Run one single-filter operation per shard, in shard order, for an operation that
        fails as a whole: their results, or the first one's exception."""
        results = yield from lockstep(dict(enumerate(ops)), self._rerouted)
        out = [results[i] for i in range(len(results))]
        if any(isinstance(r, _Rerouted) for r in out):
            self._seed = None
            raise GuardError(
                f"{self.name}: the filter was recreated during the call", filter=self.name
            )
        raise_first(out)
        return out

    def _rerouted(self, shard: int) -> BaseException | None:
        # A STALE reply wrote nothing; if it carried another seed, the filter was recreated
        # and this shard's items were routed with the old one: stop before anything is sent.
        layout = self._handles[shard]._layout
        if self._seed is not None and layout.buckets0 and layout.seed != self._seed:
            return _Rerouted()
        return None

    # -- operations ----------------------------------------------------------------------

    def _open_op(self) -> Op[int]:
        """Read every shard's sub-filter 0 as the probe does (guard/filter.py): all present,
        verified, same seed, and made with this shard count. Read-only: fine on a replica."""
        answers = yield {i: h._probe_round(1) for i, h in enumerate(self._handles)}
        raise_first(answers.values())
        present = [i for i in range(self.shards) if answers[i][0]]
        if not present:
            if any(answers[i][1] for i in range(self.shards)):  # sub-filters left: damage
                raise FilterCorruptError(self.name, "every shard's sub-filter 0 is missing")
            raise FilterNotFoundError(f"{self.name}: no such filter", filter=self.name)
        stored = [Stored(self.key(i), *answers[i][2:5]) for i in present]
        seeds = {verify_stored(self.name, [s]).seed for s in stored}
        recorded = {unpack_header(s.header).shards for s in stored}
        if len(recorded) > 1:
            raise FilterCorruptError(self.name, f"the shards record shard counts {recorded}")
        (count,) = recorded
        if count != self.shards:
            raise InvalidParameterError(
                f"{self.name}: the filter has {count} shard(s); this handle was opened "
                f"with shards={self.shards}",
                param="shards",
                limit=str(count),
                value=self.shards,
                filter=self.name,
            )
        if len(present) < self.shards:
            missing = [i for i in range(self.shards) if i not in present]
            raise FilterCorruptError(self.name, f"shard(s) {missing} missing")
        if len(seeds) != 1:
            raise FilterCorruptError(self.name, "the shards have different seeds")
        self._seed = seed = seeds.pop()
        return seed

    def _items_op(
        self,
        items: Iterable[str | bytes],
        make: Callable[[FilterOps, list[bytes]], Op[list[Any]]],
    ) -> Op[list[Any]]:
        """Route items to their shards, run ``make`` per shard, put the answers back in order."""
        data = [to_bytes(x) for x in items]
        out: list[Any] = [None] * len(data)
        todo = list(range(len(data)))
        full = 0  # shards found full
        for _ in range(MAX_RETRIES):
            if not todo:
                break
            seed = self._seed
            if seed is None:
                seed = yield from self._open_op()
            groups: dict[int, list[int]] = {}
            for k in todo:
                groups.setdefault(shard_of(data[k], seed, self.shards), []).append(k)
            results = yield from lockstep(
                {i: make(self._handles[i], [data[k] for k in idx]) for i, idx in groups.items()},
                self._rerouted,
            )
            if any(isinstance(r, FilterNotFoundError) for r in results.values()):
                # One shard gone is damage, all gone a dropped filter: the open check raises which.
                self._seed = None
                yield from self._open_op()
            todo = []
            for i, idx in groups.items():
                result = results[i]
                if isinstance(result, _Rerouted):
                    todo.extend(idx)
                    continue
                if isinstance(result, FilterFullError):
                    full += 1
                    result = result.results
                elif isinstance(result, BaseException):  # the first shard's failure
                    raise result
                for k, r in zip(idx, result, strict=True):
                    out[k] = r
            if todo:
                self._seed = None  # re-read the headers, then route the moved items again
                todo.sort()
        if todo:
            raise GuardError(
                f"{self.name}: the filter kept being recreated during the call", filter=self.name
            )
        if full:
            added = sum(bool(r) for r in out)
            raise FilterFullError(
                f"filter {self.name!r}: {full} shard(s) full ({added} of {len(data)} items added)",
                [bool(r) for r in out],
                filter=self.name,
            )
        return out

    def _insert_op(self, items: Iterable[str | bytes], unique: bool) -> Op[list[bool]]:
        return self._items_op(items, lambda h, d: h._insert_op(d, unique))

    def _lookup_op(self, data: list[bytes]) -> Op[list[bool]]:
        return self._items_op(data, lambda h, d: h._lookup_op(d))

    def _lookup_one_op(self, item: str | bytes) -> Op[bool]:
        return (yield from self._items_op([item], _lookup_one))[0]

    _queued_lookup = _lookup_one_op  # a pipeline queues the same

    def _batch_op(self, script: str, items: Iterable[str | bytes]) -> Op[list[Any]]:
        return self._items_op(items, lambda h, d: h._batch_op(script, d))

    def _exists_op(self) -> Op[bool]:
        return self._handles[0]._exists_op()

    def _no_change_log(self, applied: int, source: int) -> None:
        if applied or source:
            raise InvalidParameterError(
                "a sharded filter follows no change log: it takes no applied or source",
                param="applied" if applied else "source",
                filter=self.name,
            )

    def _refuse_existing_op(self) -> Op[None]:
        """FilterExistsError when any shard exists."""
        exists = yield from lockstep(dict(enumerate(h._exists_op() for h in self._handles)))
        raise_first(exists.values())
        if any(exists.values()):
            raise FilterExistsError(f"{self.name}: filter exists", filter=self.name)

    def _bulk_target(self, applied: int, source: int) -> Target:
        """What a bulk build (guard/bulk.py) writes when this is the staging copy: each shard,
        with its share of the capacity and the live filter's seed (see ``_seed_to_keep``)."""
        self._no_change_log(applied, source)
        share = partial(shard_capacity, shards=self.shards)
        return Target(list(self._handles), self.shards, share, self._seed_to_keep)

    def _reserve_op(self, params: FilterParams, applied: int, source: int) -> Op[ShardedFilterInfo]:
        self._no_change_log(applied, source)
        yield from self._refuse_existing_op()
        seed = params.seed
        if seed is None:
            seed = yield from self._seed_to_keep()
        per_shard = replace(params, capacity=shard_capacity(params.capacity, self.shards))
        layout = replace(per_shard, seed=seed).layout()  # one seed (and layout) for all shards
        self._seed = layout.seed
        header = pack_header(layout, per_shard.capacity, params.error_rate, self.shards)
        infos = yield from self._fan(h._create_op(layout, header) for h in self._handles)
        return self._combine(infos)

    def _seed_to_keep(self) -> Op[int | None]:
        """A staging copy takes the live filter's seed, when there is a live filter."""
        if self._live is None:
            return None
        try:
            return (yield from self._live._open_op())
        except FilterNotFoundError:
            return None

    def _info_op(self) -> Op[ShardedFilterInfo]:
        yield from self._open_op()  # info is not hot: re-check the shard count every time
        return self._combine((yield from self._fan(h._info_op() for h in self._handles)))

    def _combine(self, infos: list[FilterInfo]) -> ShardedFilterInfo:
        """The first shard's info (geometry and targets are the same in all), counters summed."""
        sums = {field: sum(getattr(x, field) for x in infos) for field in _SUMMED}
        return replace(
            ShardedFilterInfo(**vars(infos[0])),
            **sums,
            subfilters=max(x.subfilters for x in infos),
            load_factor=sums["items"] / (sums["buckets"] * infos[0].bucket_size),
            # An absent item is checked against its one shard: the mean of the shards' rates.
            error_rate=sum(x.error_rate for x in infos) / self.shards,
            shards=self.shards,
            per_shard=tuple(infos),
        )

    def _drop_op(self) -> Op[bool]:
        self._seed = None  # dropping routes nothing
        return any((yield from self._fan(h._drop_op() for h in self._handles)))

    def _promote_op(self, only_if_new: bool = False, *, unless_behind: bool = False) -> Op[bool]:
        live = self._live
        if live is None:
            raise InvalidParameterError(
                "promote() is for a staging copy (see staging())", filter=self.name
            )
        # Each shard is replaced atomically; with the live seed kept (_seed_to_keep), an item
        # routes to the same shard in both copies, so a lookup between two promotes finds it.
        yield from self._open_op()
        if only_if_new:  # no shard swapped in while any exists (each one checks again)
            yield from live._refuse_existing_op()
        pairs = zip(self._handles, live._handles, strict=True)
        yield from self._fan(
            h._promote_op(only_if_new, onto, unless_behind=unless_behind) for h, onto in pairs
        )
        live._seed, self._seed = self._seed, None
        return True


def _lookup_one(shard: FilterOps, data: list[bytes]) -> Op[list[bool]]:
    """One item's lookup in its shard: the shard's single lookup (guard/filter.py)."""
    return [(yield from shard._lookup_one_op(data[0]))]


class ShardedCuckooFilter(ShardedOps, AsyncHandle[ShardedFilterInfo]):
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
    ) -> None:
        super().__init__(redis, name, prefix, shards=shards)
        self._start(coalesce)


class SyncShardedCuckooFilter(ShardedOps, SyncHandle[ShardedFilterInfo]):
    """The sharded filter over a blocking ``redis.Redis`` or ``redis.cluster.RedisCluster``."""


__all__ = ["ShardedCuckooFilter", "ShardedFilterInfo", "SyncShardedCuckooFilter", "shard_capacity"]
