"""The Lua scripts: loaded once from guard/lua, each prefixed by the shared prelude.

Calls go through redis-py's Script objects, which send EVALSHA and reload on NOSCRIPT (and
load scripts before a pipeline runs), so a SCRIPT FLUSH or a restarted server is invisible.
"""

from __future__ import annotations

import re
from functools import cache
from importlib.resources import files
from typing import Any

from redis.exceptions import ResponseError

from guard import ops
from guard.errors import (
    FilterCorruptError,
    FilterExistsError,
    FilterNotFoundError,
    GuardError,
    InvalidParameterError,
)

# Each script is its operation's file after the shared pieces it uses: a script defines only
# the functions it calls, since defining them is part of every call's cost.
PIECES = {
    "reserve": ("_common",),
    "count": ("_common", "_store"),
    "insert": ("_common", "_store", "_add"),
    "delete": ("_common", "_store", "_remove"),
    "apply": ("_common", "_store", "_add", "_remove", "_changes"),
    "undo": ("_common", "_store", "_add", "_remove", "_changes"),
    "drop": ("_common",),
    "promote": ("_common",),
}

# Reply status codes, as in _common.lua.
OK, STALE, FULL, NEEDKEYS, GAP, SOURCE = 0, 1, 2, 3, 4, 5

_CODES: dict[str, type[GuardError]] = {
    "NOTFOUND": FilterNotFoundError,
    "EXISTS": FilterExistsError,
    "BADARG": InvalidParameterError,
}
_GUARD_REPLY = re.compile(r"GUARD_([A-Z]+) ?([^\n]*?)(?: script: .*)?$", re.S)


# The limits a script enforces itself, from guard/ops.py (one place for both languages).
LIMITS = (
    f"local KICK_BUDGET, RESERVE_MAX, ITEM_WORK = {ops.KICK_BUDGET}, {ops.RESERVE_MAX}, "
    f"{ops.ITEM_WORK}"
)


@cache
def source(name: str) -> str:
    lua = files("guard") / "lua"
    parts = [*PIECES[name], name]
    return "\n".join([LIMITS, *((lua / f"{part}.lua").read_text() for part in parts)])


def register(client: Any) -> dict[str, Any]:
    """One Script object per operation, bound to ``client`` (sync or asyncio redis-py)."""
    return {name: client.register_script(source(name)) for name in PIECES}


def map_error(exc: ResponseError, filter: str) -> Exception:
    """The library's exception for a script's error reply (else the reply as it is): the one
    reader of "GUARD_<CODE> <reason>" (guard/lua/_common.lua: guard_error)."""
    text = str(exc)
    if match := _GUARD_REPLY.search(text):
        code, reason = match.group(1), match.group(2).strip()
        if code == "CORRUPT":
            return FilterCorruptError(filter, reason)
        return _CODES.get(code, GuardError)(f"{filter}: {reason}", filter=filter)
    if "WRONGTYPE" in text:  # Redis 7 puts it first; 6.2 after "Error running script ..."
        return FilterCorruptError(filter, "a key of the filter holds another type")
    return exc
