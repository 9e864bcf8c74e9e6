"""Damaged stored bytes, every library operation: FilterCorruptError or a right answer.

A property over real filters (grown ones with several sub-filters, fixed ones, sharded ones):
damage arbitrary bytes of a header or a tag, truncate or extend a string, retype or delete a
key, then run every operation through sync, async and sharded handles, fresh ones and ones
that had cached the layout before the damage. Each call either raises FilterCorruptError or
answers right: every inserted item is still found (never a false negative), and a write that
went through leaves a filter in which every item inserted so far is still found.
"""

from __future__ import annotations

import asyncio
import io
import itertools
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import fakeredis
import pytest
import redis
import redis.asyncio as aioredis
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from devkit.keys import delete_prefixed
from guard import (
    Change,
    ChangeSourceError,
    CuckooFilter,
    FilterCorruptError,
    FilterNotFoundError,
    ShardedCuckooFilter,
    SyncCuckooFilter,
    SyncShardedCuckooFilter,
    layout,
)
from guard.dump import export_filter

# name: (reserve parameters, items inserted, shards or 0)
GEOMETRIES: dict[str, tuple[dict[str, Any], int, int]] = {
    "grown": ({"capacity": 40, "fingerprint_bits": 8, "bucket_size": 2}, 120, 0),
    "grown-by-error-rate": ({"capacity": 60, "error_rate": 0.01}, 200, 0),
    "fixed": ({"capacity": 150, "expansion": 0, "bucket_size": 8}, 100, 0),
    "sharded": ({"capacity": 60, "fingerprint_bits": 12}, 150, 2),
}

DAMAGE_KINDS = ["header", "tag", "truncate", "extend", "retype", "delete"]
# (kind, which key, byte offset, byte value); the numbers are reduced to the filter at hand.
DAMAGE = st.tuples(
    st.sampled_from(DAMAGE_KINDS),
    st.integers(0, 63),
    st.integers(0, layout.HEADER_BYTES - 1),
    st.integers(0, 255),
)

_names = itertools.count()
SOURCE = 0x5EED  # the change log apply_changes says it follows
MAX_EXAMPLES = 60  # per backend: about 5 s each here


@dataclass
class Case:
    """One damaged filter and what it must still answer."""

    items: list[str]
    extra: list[str] = field(default_factory=list)  # inserted by the operations themselves
    corrupt: int = 0  # calls that raised FilterCorruptError
    gone: bool = False  # the damage deleted every key: "not found" is then the right answer
    calls: int = 0


def _keys(r: redis.Redis, handle: Any) -> list[str]:
    """Every key of the filter: each shard's sub-filters, or the filter's."""
    shards = getattr(handle, "_handles", [handle])
    return [h.key(n) for h in shards for n in range(layout.MAX_SUBFILTERS) if r.exists(h.key(n))]


def _damage(r: redis.Redis, keys: list[str], damage: tuple[str, int, int, int]) -> None:
    kind, which, offset, value = damage
    key = keys[which % len(keys)]
    if r.type(key) != b"string":
        return  # retyped by an earlier damage
    data = r.get(key)
    assert data is not None
    if kind == "header":
        r.setrange(key, offset, bytes([value]))
    elif kind == "tag":
        r.setrange(key, len(data) - layout.TAG_BYTES + offset % layout.TAG_BYTES, bytes([value]))
    elif kind == "truncate":
        r.set(key, data[: -(1 + offset)])
    elif kind == "extend":
        r.append(key, bytes([value]) * (1 + offset))
    elif kind == "retype":
        r.delete(key)
        r.hset(key, "a", value)
    else:
        r.delete(key)


def _forgot(handle: Any) -> None:
    """A handle that reported damage keeps no layout: its next call verifies again."""
    if not hasattr(handle, "_handles"):  # a sharded handle: only the damaged shard's forgets
        assert handle._layout == layout.UNKNOWN_LAYOUT, "kept a layout after reporting damage"


class _Outcome:
    answered = False


@contextmanager
def _raises_or_answers(case: Case, handle: Any) -> Iterator[_Outcome]:
    """One operation: FilterCorruptError (or not found, once every key is gone), or an
    answer the block checks (``answered`` tells which)."""
    case.calls += 1
    outcome = _Outcome()
    try:
        yield outcome
    except FilterCorruptError as exc:
        assert exc.filter and exc.reason, exc  # names the filter and what is wrong
        case.corrupt += 1
        _forgot(handle)
        return
    except FilterNotFoundError:
        assert case.gone
        return
    outcome.answered = True


def _check(case: Case, handle: Any, call: Callable[[], Any], verify: Callable[[Any], None]) -> bool:
    with _raises_or_answers(case, handle) as outcome:
        verify(call())
    return outcome.answered


async def _acheck(
    case: Case, handle: Any, call: Callable[[], Awaitable[Any]], verify: Callable[[Any], None]
) -> bool:
    with _raises_or_answers(case, handle) as outcome:
        verify(await call())
    return outcome.answered


def _found(found: list[bool] | bool) -> None:
    found = found if isinstance(found, list) else [found]
    assert all(found), f"{found.count(False)} inserted items read absent"


def _any(answer: Any) -> None:
    """Operations whose answer says nothing about the items (info, dump, insert_unique)."""


def run_sync(case: Case, cf: Any, fresh: Callable[[], Any]) -> None:
    """Every operation on a sync handle; after a write, a fresh handle re-checks everything."""

    def everything() -> list[str]:
        return case.items + case.extra

    def still_found() -> None:
        new_handle = fresh()
        _check(case, new_handle, lambda: new_handle.lookup_many(everything()), _found)

    _check(case, cf, lambda: cf.lookup(case.items[0]), _found)
    _check(case, cf, lambda: cf.lookup_many(case.items[:5]), _found)  # the scalar plan
    _check(case, cf, lambda: cf.lookup_many(everything()), _found)  # the numpy plan
    _check(case, cf, lambda: cf.count(case.items[1]), lambda n: _found(n >= 1))
    _check(case, cf, cf.info, _any)
    _check(case, cf, lambda: export_filter(cf, io.BytesIO()), _any)
    batch = [f"new{next(_names)}" for _ in range(3)]
    if _check(case, cf, lambda: cf.insert(batch[0]), _found):
        case.extra.append(batch[0])
        still_found()
    if _check(case, cf, lambda: cf.insert_many(batch), _found):
        case.extra += batch
        still_found()
    unique = f"new{next(_names)}"
    if _check(case, cf, lambda: cf.insert_unique(unique), _any):
        case.extra.append(unique)  # present now, whether added or found already there
        still_found()
    # Delete only what was inserted by insert (never after insert_unique: the trap of
    # docs/format.md), one copy per call.
    for delete in (lambda: cf.delete(batch[0]), lambda: cf.delete_many(batch[:1])):
        if batch[0] in case.extra and _check(case, cf, delete, _found):
            case.extra.remove(batch[0])
            still_found()
    if hasattr(cf, "apply_changes"):  # the change feed follows unsharded filters
        run_changes(case, cf, still_found)
    _check(case, cf, lambda: cf.lookup_many(everything()), _found)


def run_changes(case: Case, cf: SyncCuckooFilter, still_found: Callable[[], None]) -> None:
    """apply_changes, then undo_change of what it applied. Damage to the stored source reads
    as a filter following another change log: ChangeSourceError (rebuild), also right."""
    applied: list[int] = []
    if not _check(case, cf, cf.applied_change, applied.append):
        return
    item = f"new{next(_names)}"
    change = Change(applied[0] + 1, True, item)
    answers: list[Any] = []

    def call(op: Callable[[], Any]) -> Callable[[], Any]:
        def guarded() -> Any:
            try:
                answers.append(op())
            except ChangeSourceError:
                answers.append(None)
            return answers[-1]

        return guarded

    def apply() -> Any:
        return cf.apply_changes([change], source=SOURCE)

    applied_ok = _check(case, cf, call(apply), lambda r: r is None or _found(r.results))
    if not applied_ok or answers[-1] is None:
        return
    case.extra.append(item)
    still_found()
    undone = _check(case, cf, call(lambda: cf.undo_change(change, source=SOURCE)), _any)
    if undone and answers[-1] is True:
        case.extra.remove(item)
        still_found()


async def run_async(case: Case, cf: Any, fresh: Callable[[], Any]) -> None:
    """The same on an async handle; lookups gathered at once take the coalescing path."""

    async def still_found() -> None:
        new_handle = fresh()
        everything = case.items + case.extra
        await _acheck(case, new_handle, lambda: new_handle.lookup_many(everything), _found)

    async def coalesced() -> list[bool]:
        return list(await asyncio.gather(*(cf.lookup(x) for x in case.items[:20])))

    await _acheck(case, cf, lambda: cf.lookup(case.items[0]), _found)
    await _acheck(case, cf, coalesced, _found)
    await _acheck(case, cf, lambda: cf.lookup_many(case.items[:5]), _found)
    await _acheck(case, cf, lambda: cf.lookup_many(case.items), _found)
    await _acheck(case, cf, lambda: cf.count(case.items[1]), lambda n: _found(n >= 1))
    await _acheck(case, cf, cf.info, _any)
    await _acheck(case, cf, lambda: export_filter(cf, io.BytesIO()), _any)
    batch = [f"new{next(_names)}" for _ in range(3)]
    if await _acheck(case, cf, lambda: cf.insert(batch[0]), _found):
        case.extra.append(batch[0])
        await still_found()
    if await _acheck(case, cf, lambda: cf.insert_many(batch), _found):
        case.extra += batch
        await still_found()
    unique = f"new{next(_names)}"
    if await _acheck(case, cf, lambda: cf.insert_unique(unique), _any):
        case.extra.append(unique)
        await still_found()
    for delete in (lambda: cf.delete(batch[0]), lambda: cf.delete_many(batch[:1])):
        if batch[0] in case.extra and await _acheck(case, cf, delete, _found):
            case.extra.remove(batch[0])
            await still_found()


class _Handles:
    """Handles on one filter of one backend: sync and async, plain or sharded."""

    def __init__(self, r: redis.Redis, url: str | None, prefix: str, shards: int) -> None:
        self.r, self.url, self.prefix, self.shards = r, url, prefix, shards
        self.name = f"d{next(_names)}"

    def sync(self) -> Any:
        if self.shards:
            return SyncShardedCuckooFilter(self.r, self.name, self.prefix, shards=self.shards)
        return SyncCuckooFilter(self.r, self.name, self.prefix)

    def async_client(self) -> aioredis.Redis:
        if self.url is None:  # fakeredis: the sync client's server
            server = self.r.connection_pool.connection_kwargs["server"]
            return fakeredis.FakeAsyncRedis(server=server)
        return aioredis.Redis.from_url(self.url)

    def make_async(self, client: aioredis.Redis) -> Any:
        if self.shards:
            return ShardedCuckooFilter(client, self.name, self.prefix, shards=self.shards)
        return CuckooFilter(client, self.name, self.prefix)


def _backend_url(request: pytest.FixtureRequest, r: redis.Redis) -> str | None:
    if isinstance(r, fakeredis.FakeRedis):
        return None
    return str(request.getfixturevalue("real_redis_url"))


@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    geometry=st.sampled_from(sorted(GEOMETRIES)),
    damages=st.lists(DAMAGE, min_size=1, max_size=2),
)
def test_damaged_filter_raises_or_answers_right(
    request: pytest.FixtureRequest,
    sync_redis: redis.Redis,
    prefix: str,
    geometry: str,
    damages: list[tuple[str, int, int, int]],
) -> None:
    """Every operation, every kind of handle, cached before the damage or fresh after it."""
    params, count, shards = GEOMETRIES[geometry]
    handles = _Handles(sync_redis, _backend_url(request, sync_redis), prefix, shards)
    case = Case([f"item{k}" for k in range(count)])
    cached = handles.sync()
    cached.reserve(**params, seed=7)
    assert all(cached.insert_many(case.items))
    assert all(cached.lookup_many(case.items))
    loop = asyncio.new_event_loop()
    client = handles.async_client()
    try:
        async_cached = handles.make_async(client)
        assert all(loop.run_until_complete(async_cached.lookup_many(case.items)))
        for damage in damages:
            keys = _keys(sync_redis, cached)
            if keys:
                _damage(sync_redis, keys, damage)
        case.gone = not _keys(sync_redis, cached)
        run_sync(case, cached, handles.sync)
        run_sync(case, handles.sync(), handles.sync)
        fresh = lambda: handles.make_async(client)  # noqa: E731
        loop.run_until_complete(run_async(case, async_cached, fresh))
        loop.run_until_complete(run_async(case, fresh(), fresh))
        event("damage reported" if case.corrupt else "damage harmless to every answer")
    finally:
        loop.run_until_complete(client.aclose())
        loop.close()
        delete_prefixed(sync_redis, prefix)


# The instances of project issue #13: (byte offset, bytes written over sub-filter 0's header).
ISSUE_13 = {
    "subfilters-0": (9, b"\x00"),
    "buckets0-0": (12, b"\x00\x00\x00\x00"),
    "buckets0-2^31-1": (12, b"\x7f\xff\xff\xff"),
    "fp_bits-40": (6, b"\x28"),
    "subfilters-64": (9, b"\x40"),
}


@pytest.mark.parametrize("damage", sorted(ISSUE_13))
def test_issue_13_header_damage(sync_redis: redis.Redis, prefix: str, damage: str) -> None:
    """Each write, info and probe raises FilterCorruptError naming the field; lookups on the
    cached handle keep finding all 400 items (the tag still holds), a fresh one raises."""
    cf = SyncCuckooFilter(sync_redis, "f", prefix)
    cf.reserve(100, fingerprint_bits=8, bucket_size=2, seed=3)
    items = [f"k{i}" for i in range(400)]
    assert all(cf.insert_many(items))
    offset, value = ISSUE_13[damage]
    sync_redis.setrange(cf.key(0), offset, value)
    field = damage.split("-")[0]
    assert all(cf.lookup_many(items))  # the cached layout, proven by the intact tag
    for _ in range(2):  # the handle keeps no layout: the second call checks again
        for op in (lambda: cf.insert("new"), lambda: cf.delete("k1"), cf.info):
            with pytest.raises(FilterCorruptError, match=field) as raised:
                op()
            assert raised.value.filter == "f"
        fresh = SyncCuckooFilter(sync_redis, "f", prefix)
        with pytest.raises(FilterCorruptError, match=field):
            fresh.lookup_many(items)
        with pytest.raises(FilterCorruptError, match=field):
            fresh.lookup("k1")


@pytest.mark.parametrize("damage", DAMAGE_KINDS)
def test_promote_refuses_a_damaged_staging_copy(
    sync_redis: redis.Redis, prefix: str, damage: str
) -> None:
    """promote checks the staging copy as every script checks a filter: a damaged one raises
    FilterCorruptError and the live filter stays as it was."""
    live = SyncCuckooFilter(sync_redis, "f", prefix)
    live.reserve(40, fingerprint_bits=8, bucket_size=2, seed=5)
    assert all(live.insert_many(["old"]))
    stage = live.staging()
    stage.reserve(40, fingerprint_bits=8, bucket_size=2, seed=5)
    items = [f"s{i}" for i in range(300)]
    assert all(stage.insert_many(items))
    keys = _keys(sync_redis, stage)
    assert len(keys) > 2
    _damage(sync_redis, keys, (damage, 1, 9, 0))  # sub-filter 1: a middle one
    with pytest.raises(FilterCorruptError, match=r"\{f\}:staging:1"):
        stage.promote()
    assert live.lookup("old") and live.info().items == 1
