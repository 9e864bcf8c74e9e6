"""Filter names and the Redis keys they live under: the one rule every layer uses.

A filter's first key is ``PREFIX{NAME}``; sub-filter ``n`` adds ``:n``; the staging copy of a
rebuild adds ``:staging`` after the brace; shard ``i`` of a sharded filter is ``PREFIX{NAME:i}``.
The braces are a Redis Cluster hash tag: every key of one filter (or shard) is in one slot.
"""

from __future__ import annotations

import re

from guard.errors import InvalidParameterError

# No ':' (shard tags use it), no braces (the hash tag), nothing a SCAN pattern would read.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")
NAME_RULE = "1-64 of A-Z a-z 0-9 _ . -, not starting with . or -"  # the pattern, in words
DEFAULT_PREFIX = "guard:"
STAGING = ":staging"


def check_name(name: object) -> str:
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise InvalidParameterError(
            f"filter name must match {NAME_PATTERN.pattern} ({NAME_RULE}), got {name!r}",
            param="name",
            limit=NAME_PATTERN.pattern,
            value=name,
        )
    return name


def base_key(prefix: str, name: str, shard: int | None = None, variant: str = "") -> str:
    """The key of sub-filter 0 of ``name`` (of its shard ``shard``; of its staging copy)."""
    tag = name if shard is None else f"{name}:{shard}"
    return f"{prefix}{{{tag}}}{variant}"


__all__ = ["DEFAULT_PREFIX", "NAME_PATTERN", "NAME_RULE", "STAGING", "base_key", "check_name"]
