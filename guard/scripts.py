"""The Lua scripts: loaded once from guard/lua, each prefixed by the shared prelude; and the
one table that says what each Redis error reply means.

Calls go through redis-py's Script objects, which send EVALSHA and reload on NOSCRIPT (and
load scripts before a pipeline runs), so a SCRIPT FLUSH or a restarted server is invisible.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from contextlib import suppress
from functools import cache
from importlib.resources import files
from typing import Any

from redis.exceptions import ResponseError

from guard import layout, ops
from guard.errors import (
    FilterCorruptError,
    FilterExistsError,
    GuardError,
    InvalidParameterError,
)

# Each script is its operation's file after the shared pieces it uses: a script defines only
# the functions it calls, since defining them is part of every call's cost. ``define`` adds one
# (below, the library's); its calls name it by the constant it returns.
PIECES: dict[str, tuple[str, ...]] = {}
_TEXTS: dict[str, str] = {}  # the text of a script kept outside guard/lua, by name


def define(name: str, *pieces: str, text: str | None = None) -> str:
    """The script ``name``: guard/lua/<name>.lua (or ``text``, for one kept outside the
    package), after the shared ``pieces`` it uses, in order. Returns ``name``, for the constant
    that calls name it by (``Call(scripts.INSERT, ...)``); a name is defined once."""
    if name in PIECES:
        raise ValueError(f"script {name!r} is already defined")
    PIECES[name] = pieces
    if text is not None:
        _TEXTS[name] = text
    return name


RESERVE = define("reserve", "_common")
COUNT = define("count", "_common", "_store")
INSERT = define("insert", "_common", "_store", "_add")
DELETE = define("delete", "_common", "_store", "_remove")
APPLY = define("apply", "_common", "_store", "_add", "_remove", "_changes")
UNDO = define("undo", "_common", "_store", "_add", "_remove", "_changes")
DROP = define("drop", "_common")
PROMOTE = define("promote", "_common")

# Reply status codes, as in _common.lua (where WRONG_SOURCE is SOURCE: the filter follows
# another change log than the call's).
OK, STALE, FULL, NEEDKEYS, GAP, WRONG_SOURCE = 0, 1, 2, 3, 4, 5


# -- the numbers both languages use ----------------------------------------------------------


def _lua_ranges() -> str:
    """layout.FIELD_RANGES as a Lua table: {name, byte offset, size, lowest, highest} each."""
    rows = (
        f"{{'{name}', {layout.FIELD_AT[name]}, {layout.FIELD_SIZE[name]}, {low}, {high}}}"
        for name, low, high in layout.FIELD_RANGES
    )
    return "{" + ", ".join(rows) + "}"


def _constants() -> dict[str, str]:
    """Each name the .lua files use for a number of Python's, and the Lua text it stands for."""
    names = {
        # Every header field's byte offset (docs/format.md, "Header"): ITEMS_AT and the rest.
        **{f"{field.upper()}_AT": at for field, at in layout.FIELD_AT.items()},
        # Each range's ends: MIN_CAPACITY, MAX_ERROR_RATE, MAX_APPLIED, ...
        **{f"MIN_{field.upper()}": low for field, low, _ in layout.FIELD_RANGES},
        **{f"MAX_{field.upper()}": high for field, _, high in layout.FIELD_RANGES},
    }
    for name in ("MAGIC", "VERSION", "HEADER_BYTES", "COMMON_BYTES", "RESERVED_AT", "TAG_BYTES",
                 "DIGEST_BYTES", "TRAILER", "TAG_INDEX_FLAG", "MAX_FP_BITS", "MIN_FP_BITS",
                 "MAX_SUBFILTERS", "MAX_EXPANSION", "MAX_SHARDS", "MAX_CAPACITY",
                 "MAX_STRING_BYTES"):  # fmt: skip
        value = getattr(layout, name)
        if names.setdefault(name, value) != value:  # a range's end named as a constant is one
            raise AssertionError(f"{name}: {names[name]} in layout.FIELD_RANGES, else {value}")
    names["BUCKET_SIZE_BITS"] = sum(1 << size for size in layout.BUCKET_SIZES)
    # The limits a script enforces itself, from guard/ops.py.
    names |= {"KICK_BUDGET": ops.KICK_BUDGET, "RESERVE_MAX": ops.RESERVE_MAX,
              "ITEM_WORK": ops.ITEM_WORK}  # fmt: skip
    zeros = "'" + "\\0" * (layout.HEADER_BYTES - layout.RESERVED_AT) + "'"  # as a Lua string
    lua = {"HEADER_RANGES": _lua_ranges(), "RESERVED_ZEROS": zeros}
    return {name: str(value) for name, value in names.items()} | lua


# The numbers the scripts share with Python, by the names the .lua files use: written into each
# script's source as literals, not as Lua locals, which every function using one would capture
# as an upvalue on every call (measured: 20 upvalues add 0.5 us to a call).
CONSTANTS = _constants()
_NAMES = re.compile(r"\b(" + "|".join(CONSTANTS) + r")\b")


def _with_constants(text: str) -> str:
    return _NAMES.sub(lambda match: CONSTANTS[match[1]], text)


@cache
def _piece(part: str) -> str:
    """guard/lua/<part>.lua with the constants written in (once per file: most scripts share
    most pieces)."""
    return _with_constants((files("guard") / "lua" / f"{part}.lua").read_text())


@cache
def source(name: str) -> str:
    own = _with_constants(_TEXTS[name]) if name in _TEXTS else _piece(name)
    return "\n".join([*(_piece(part) for part in PIECES[name]), own])


class BoundScripts(dict[str, Any]):
    """Script name -> its Script object bound to ``client`` (sync or asyncio redis-py), made
    when first asked for: a script defined after a handle was made is found all the same."""

    def __init__(self, client: Any) -> None:
        super().__init__()
        self.client = client

    def __missing__(self, name: str) -> Any:
        bound = self[name] = self.client.register_script(source(name))
        return bound


# -- what Redis's error replies mean ---------------------------------------------------------


class UnknownCommandError(ResponseError):
    """The server has no such command: ``command`` (upper case). Fakeredis has no BITFIELD_RO,
    EVALSHA_RO or EVAL_RO; Redis 6.2 has no EVALSHA_RO or EVAL_RO."""

    def __init__(self, message: str, command: str) -> None:
        super().__init__(message)
        self.command = command


def _unknown_command(exc: ResponseError, rest: str) -> Exception:
    # "command `NAME`, with args beginning with: ..." (fakeredis quotes it as 'name')
    quoted = re.match(r"command [`'](\S+?)[`']", rest)
    return UnknownCommandError(str(exc), quoted[1].upper()) if quoted else exc


# Every error reply the library tells apart, by its code (the first word) and in one place, as
# redis-py's parser classifies its own (redis/_parsers/base.py: EXCEPTION_CLASSES): nothing else
# in guard/ or app/ reads an error's text. GUARD_<CODE> replies are the scripts' own
# (_common.lua: guard_error); redis-py passes an ERR reply on without its code, so an unknown
# command reads "unknown command ...". Each entry: (filter, error, text after the code).
_REPLIES: dict[str, Callable[[str, ResponseError, str], Exception]] = {
    "GUARD_CORRUPT": lambda filter, _, reason: FilterCorruptError(filter, reason),
    "GUARD_EXISTS": lambda f, _, reason: FilterExistsError(f"{f}: {reason}", filter=f),
    "GUARD_BADARG": lambda f, _, reason: InvalidParameterError(f"{f}: {reason}", filter=f),
    "WRONGTYPE": lambda f, *_: FilterCorruptError(f, "a key of the filter holds another type"),
    "unknown": lambda _, exc, rest: _unknown_command(exc, rest),
}
# What redis-py puts before an error a pipeline's command met: "Command # <n> (<command>) of
# pipeline caused error: " and the error's text (its args tuple, in the asyncio client).
_PIPELINE = re.compile(r"Command # \d+ \(.*?\) of pipeline caused error: (.*)", re.S)
# What Redis wraps around an error in a script: Redis 6.2's "Error running script (call to
# f_<sha>): @user_script:<line>: " before one a script's command raised, Redis 7's " script:
# <sha>, on @user_script:<line>." after any.
_SCRIPT = re.compile(r"(?:Error running script \(.*?\): @\w+:\d+: )?(.*?)(?: script: .*)?", re.S)


def _server_text(exc: ResponseError) -> str:
    """The error text the server sent (less its code, for ERR), out of what is around it."""
    text = str(exc)
    if pipelined := _PIPELINE.fullmatch(text):
        text = pipelined[1]
        if text.startswith("("):
            with suppress(ValueError, SyntaxError):
                args = ast.literal_eval(text)
                text = args[0] if isinstance(args, tuple) and args else text
    return _SCRIPT.fullmatch(str(text))[1]  # type: ignore[index]


def map_error(exc: ResponseError, filter: str) -> Exception:
    """The library's exception for Redis's error reply ``exc`` (else ``exc`` as it is), by the
    table above; ``filter``: the name of the filter the command was for."""
    code, _, rest = _server_text(exc).partition(" ")
    known = _REPLIES.get(code)
    if known is not None:
        return known(filter, exc, rest.strip())
    if code.startswith("GUARD_"):  # a script's code this library does not know
        return GuardError(f"{filter}: {rest.strip()}", filter=filter)
    return exc
