"""Which filters exist under a key prefix: one SCAN, no filter is opened.

A filter's first key is ``PREFIX{NAME}``; shard ``i`` of a sharded filter is ``PREFIX{NAME:i}``
(guard/sharded.py). Sub-filter keys (``…}:n``) and staging copies (``…}:staging``) end after
the brace, so the match pattern skips them; a match that is no filter name is skipped too.
``read_unsharded_filters`` (the service's: plain filters, through its own handles) and
``read_all_filters_sync`` (the CLI's: plain and sharded) then read the filters' info at once,
reporting the damaged ones (a key of another type, bytes that are not a filter) instead of
failing.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from guard.driver import AsyncRunner, Scan, SyncRunner, Transport, transport
from guard.errors import FilterCorruptError, FilterNotFoundError, InvalidParameterError
from guard.facade import AsyncHandle, SyncHandle
from guard.filter import FilterInfo, SyncCuckooFilter
from guard.handle import FilterHandle
from guard.names import DEFAULT_PREFIX, NAME_PATTERN
from guard.ops import lockstep
from guard.sharded import SyncShardedCuckooFilter


def _tags(prefix: str) -> Transport[list[str]]:
    """What is inside the braces of each key the SCAN found."""
    # Escape glob characters a prefix may hold; the braces are literal to Redis's matcher.
    keys = yield Scan(re.sub(r"([*?\[\]\\])", r"\\\1", prefix) + "{*}")
    # A key that is not valid UTF-8 keeps a U+FFFD, which no name has (names are ASCII).
    texts = [key.decode(errors="replace") if isinstance(key, bytes) else key for key in keys]
    return [text[len(prefix) + 1 : -1] for text in texts]


def _names(tags: list[str]) -> list[str]:
    # User names cannot hold ':', so a shard's tag is never taken for a filter's name.
    return sorted({tag for tag in tags if NAME_PATTERN.fullmatch(tag)})


def _shard_counts(tags: list[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for tag in tags:
        name, colon, index = tag.rpartition(":")
        if colon and NAME_PATTERN.fullmatch(name) and index.isascii() and index.isdigit():
            counts[name] = max(counts.get(name, 0), int(index) + 1)
    return dict(sorted(counts.items()))


async def list_filters(redis: Any, prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Names of the (unsharded) filters under ``prefix`` (a SCAN: fine for tens of thousands
    of keys)."""
    return _names(await AsyncRunner.on(redis)._drive(_tags(prefix)))


def list_filters_sync(redis: Any, prefix: str = DEFAULT_PREFIX) -> list[str]:
    return _names(SyncRunner.on(redis)._drive(_tags(prefix)))


async def list_sharded_filters(redis: Any, prefix: str = DEFAULT_PREFIX) -> dict[str, int]:
    """Sharded filters under ``prefix``: name → shard count (the highest shard index found
    plus one), to open each with ``ShardedCuckooFilter(redis, name, prefix, shards=count)``.
    A filter that lost its last shard shows one fewer; opening it fails, naming the true one."""
    return _shard_counts(await AsyncRunner.on(redis)._drive(_tags(prefix)))


def list_sharded_filters_sync(redis: Any, prefix: str = DEFAULT_PREFIX) -> dict[str, int]:
    return _shard_counts(SyncRunner.on(redis)._drive(_tags(prefix)))


@dataclass
class FilterReport:
    """What a read of filters found: the filters it could read, and the damaged ones."""

    infos: list[FilterInfo] = field(default_factory=list)
    damaged: list[str] = field(default_factory=list)


def _report(
    prefix: str, opened: Callable[[list[str]], Sequence[FilterHandle[Any]]]
) -> Transport[FilterReport]:
    """The info of the filters ``opened`` makes handles for from the SCAN's tags, read side by
    side; a filter dropped since the SCAN left out. Any error but damage raises."""
    handles = opened((yield from _tags(prefix)))
    report = FilterReport()
    if not handles:
        return report
    infos = lockstep({k: h._info_op() for k, h in enumerate(handles)})
    results = yield from transport(infos, handles[0].name)
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


async def read_unsharded_filters(
    redis: Any,
    handle: Callable[[str], AsyncHandle[Any]],
    prefix: str = DEFAULT_PREFIX,
    limit: int | None = None,
) -> FilterReport:
    """The info of the first ``limit`` (unsharded) filters under ``prefix``, by name;
    ``handle(name)`` opens one (the service keeps its handles)."""
    io = _report(prefix, lambda tags: [handle(name) for name in _names(tags)[:limit]])
    return await AsyncRunner.on(redis)._drive(io)


def read_all_filters_sync(redis: Any, prefix: str = DEFAULT_PREFIX) -> FilterReport:
    """The info of every filter under ``prefix``, plain and sharded, by name."""

    def handles(tags: list[str]) -> list[SyncHandle[Any]]:
        found: list[SyncHandle[Any]] = [SyncCuckooFilter(redis, n, prefix) for n in _names(tags)]
        found += [
            SyncShardedCuckooFilter(redis, name, prefix, shards=shards)
            for name, shards in _shard_counts(tags).items()
        ]
        return sorted(found, key=lambda h: h.name)

    return SyncRunner.on(redis)._drive(_report(prefix, handles))


__all__ = [
    "FilterReport",
    "list_filters",
    "list_filters_sync",
    "list_sharded_filters",
    "list_sharded_filters_sync",
    "read_all_filters_sync",
    "read_unsharded_filters",
]
