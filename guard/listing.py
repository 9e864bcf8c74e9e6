"""Which filters exist under a key prefix: one SCAN, no filter is opened.

A filter's first key is ``PREFIX{NAME}``; shard ``i`` of a sharded filter is ``PREFIX{NAME:i}``
(guard/sharded.py). Sub-filter keys (``…}:n``) and staging copies (``…}:staging``) end after
the brace, so the match pattern skips them without reading a byte of any filter. Other keys
that match (a name that is not valid UTF-8 or not a filter name) are skipped: no filter can
have them. ``read_filters`` (``read_filters_sync``) then reads every filter's info at once,
reporting the damaged ones (a key of another type under a filter's name, bytes that are not a
filter) instead of failing.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from guard.errors import FilterCorruptError, FilterNotFoundError, InvalidParameterError
from guard.facade import AsyncHandle, Facade, SyncHandle
from guard.filter import FilterInfo, SyncCuckooFilter
from guard.names import DEFAULT_PREFIX, NAME_PATTERN
from guard.ops import Op, lockstep
from guard.sharded import SyncShardedCuckooFilter


def _match_pattern(prefix: str) -> str:
    # Escape glob characters a prefix may hold; the braces are literal to Redis's matcher.
    escaped = re.sub(r"([*?\[\]\\])", r"\\\1", prefix)
    return f"{escaped}{{*}}"


def _tag_of(key: bytes | str, prefix: str) -> str | None:
    if isinstance(key, bytes):
        try:
            key = key.decode()
        except UnicodeDecodeError:
            return None  # names are ASCII: no filter has this key
    return key[len(prefix) + 1 : -1]


def _names(tags: Iterable[str | None]) -> list[str]:
    # User names cannot hold ':', so a shard's tag is never taken for a filter's name.
    return sorted({tag for tag in tags if tag is not None and NAME_PATTERN.fullmatch(tag)})


def _shard_counts(tags: Iterable[str | None]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for tag in tags:
        if tag is None:
            continue
        name, colon, index = tag.rpartition(":")
        if colon and NAME_PATTERN.fullmatch(name) and index.isascii() and index.isdigit():
            counts[name] = max(counts.get(name, 0), int(index) + 1)
    return dict(sorted(counts.items()))


async def _tags(redis: Any, prefix: str) -> list[str | None]:
    pattern = _match_pattern(prefix)
    return [_tag_of(k, prefix) async for k in redis.scan_iter(match=pattern, count=1000)]


def _tags_sync(redis: Any, prefix: str) -> list[str | None]:
    pattern = _match_pattern(prefix)
    return [_tag_of(k, prefix) for k in redis.scan_iter(match=pattern, count=1000)]


async def list_filters(redis: Any, prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Names of the (unsharded) filters under ``prefix`` (a SCAN: fine for tens of thousands
    of keys)."""
    return _names(await _tags(redis, prefix))


def list_filters_sync(redis: Any, prefix: str = DEFAULT_PREFIX) -> list[str]:
    return _names(_tags_sync(redis, prefix))


async def list_sharded_filters(redis: Any, prefix: str = DEFAULT_PREFIX) -> dict[str, int]:
    """Sharded filters under ``prefix``: name → shard count, to open each one with
    ``ShardedCuckooFilter(redis, name, prefix, shards=count)``.

    The count is the highest shard index found plus one. A filter that lost its last shard
    shows one shard fewer; opening it then fails with the count its headers record.
    """
    return _shard_counts(await _tags(redis, prefix))


def list_sharded_filters_sync(redis: Any, prefix: str = DEFAULT_PREFIX) -> dict[str, int]:
    return _shard_counts(_tags_sync(redis, prefix))


@dataclass
class FilterReport:
    """What ``read_filters`` found: the filters it could read, and the damaged ones."""

    infos: list[FilterInfo] = field(default_factory=list)
    damaged: list[str] = field(default_factory=list)


def _report_op(handles: Sequence[Facade[Any]]) -> Op[FilterReport]:
    """Every handle's info, read side by side (one round trip for all, not one each); a
    damaged filter named rather than failing the whole report; a filter dropped since the
    SCAN left out. Anything else (Redis unreachable) raises."""
    results = yield from lockstep({k: h._info_op() for k, h in enumerate(handles)})
    report = FilterReport()
    for k, handle in enumerate(handles):
        result = results[k]
        # A sharded filter that lost its last shard lists one shard short, and refuses a
        # handle with that count (InvalidParameterError): damaged too.
        if isinstance(result, FilterCorruptError | InvalidParameterError):
            report.damaged.append(handle.name)
        elif isinstance(result, FilterNotFoundError):
            continue
        elif isinstance(result, Exception):
            raise result
        else:
            report.infos.append(result)
    return report


async def read_filters(
    redis: Any,
    handle: Callable[[str], AsyncHandle[Any]],
    prefix: str = DEFAULT_PREFIX,
    limit: int | None = None,
) -> FilterReport:
    """The info of the first ``limit`` (unsharded) filters under ``prefix``, by name;
    ``handle(name)`` opens one (the service keeps its handles)."""
    handles = [handle(name) for name in (await list_filters(redis, prefix))[:limit]]
    return await handles[0]._run(_report_op(handles)) if handles else FilterReport()


def read_filters_sync(redis: Any, prefix: str = DEFAULT_PREFIX) -> FilterReport:
    """The info of every filter under ``prefix``, plain and sharded, by name."""
    handles: list[SyncHandle[Any]] = [
        SyncCuckooFilter(redis, name, prefix) for name in list_filters_sync(redis, prefix)
    ]
    handles += [
        SyncShardedCuckooFilter(redis, name, prefix, shards=shards)
        for name, shards in list_sharded_filters_sync(redis, prefix).items()
    ]
    handles.sort(key=lambda h: h.name)
    return handles[0]._run(_report_op(handles)) if handles else FilterReport()


__all__ = [
    "FilterReport",
    "list_filters",
    "list_filters_sync",
    "list_sharded_filters",
    "list_sharded_filters_sync",
    "read_filters",
    "read_filters_sync",
]
