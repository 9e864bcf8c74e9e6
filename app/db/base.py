"""What the service needs from its database of record: the protocol, the guarded table, errors.

Every implementation keeps a trigger-fed change feed of the guarded table: every committed
insert, delete and key change gets a gapless position, in commit order for changes of one key,
so a filter that stores the position of the last change applied (guard/changes.py) can follow
every write, whoever makes it. docs/postgresql.md says exactly what is created.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol
from urllib.parse import urlsplit, urlunsplit

from guard.changes import Change

SnapshotHook = Callable[[int], Awaitable[None]]

IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")
MAX_SOURCE = 2**53 - 1  # a change log's identity fits a JSON number and a filter's header
INT64 = range(-(2**63), 2**63)


class Stored(NamedTuple):
    """What a put wrote."""

    created: bool  # a new row: its key entered the table (and the change feed)
    record: str  # the row as stored, the JSON text get() answers


class Database(Protocol):
    """A guarded table with a change feed (SQLite, PostgreSQL: app/db/registry.py).

    The feed's positions: `newest_change()` is the newest committed change, `changes_after`
    reads them in order; a filter stores the position it has applied. Writes through `put`
    and `delete` are fed like any other.
    """

    # Statements sent for the records (get/put/delete/count/seed/iter_keys): tests assert a
    # blocked read adds none. The change feed's own statements, which a follower and the
    # audit send in the background, are counted apart in `feed_queries`.
    queries: int
    feed_queries: int

    async def get(self, key: str) -> str | None:
        """The record as JSON text, None if there is no such row."""
        ...

    async def put(self, key: str, value: str) -> Stored:
        """Insert or replace, committed; whether the row is new, and the row as stored. A
        replace changes no key: the feed has nothing of it."""
        ...

    async def delete(self, key: str) -> bool:
        """True only if a row was deleted and that committed."""
        ...

    async def count(self) -> int: ...

    def iter_keys(
        self, batch_size: int, at_snapshot: SnapshotHook | None = None
    ) -> AsyncIterator[list[str]]:
        """Every key of one consistent snapshot.

        `at_snapshot(position)` runs once the snapshot is taken, before the first page; the
        position is the newest change the snapshot contains, and every later change is after
        it.
        """
        ...

    async def present_at(self, keys: list[str]) -> tuple[int, list[str]]:
        """Which of `keys` the table holds, in one snapshot, and the position of the newest
        change that snapshot contains (the audit confirms a miss with it)."""
        ...

    async def feed_source(self) -> int:
        """The change log's identity, 1..2**53-1, made once when the log was installed."""
        ...

    async def newest_change(self) -> int:
        """The newest committed change's position, 0 if none yet."""
        ...

    async def oldest_change(self) -> int:
        """The smallest id still held; newest + 1 when the log is empty.

        Replaying from a filter's `applied` is possible iff applied + 1 >= oldest_change().
        """
        ...

    async def changes_after(self, after: int, limit: int) -> list[Change]:
        """Committed changes with positions > after, ascending and consecutive, at most
        `limit` (fewer does not mean the end: read again from the last one)."""
        ...

    async def wait_for_change(self, after: int, timeout: float) -> int | None:
        """newest_change() as soon as it is past `after`; None after `timeout` seconds."""
        ...

    async def compact(self, upto: int) -> int:
        """Delete the log's entries with id <= upto; returns how many."""
        ...

    async def sample_keys(self, n: int) -> list[str]:
        """Up to `n` random existing keys (the guard's audit looks them up)."""
        ...

    async def seed(self, n: int) -> int:
        """Fill the service's own empty table with `n` demo rows; returns rows added."""
        ...

    async def close(self) -> None: ...


class RecordInputError(ValueError):
    """A key or record the guarded table cannot hold: 422 naming the field (app/errors.py)."""

    def __init__(self, loc: tuple[str | int, ...], msg: str) -> None:
        super().__init__(msg)
        self.loc = loc
        self.msg = msg


class DatabaseSetupError(ValueError):
    """The settings name a table or column the database does not have, or cannot guard."""


def redacted_url(url: str) -> str:
    """A database URL fit to print: its password replaced by ***."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


def identifier(setting: str, name: str) -> str:
    if not IDENTIFIER.fullmatch(name):
        raise DatabaseSetupError(
            f"{setting} must be a plain SQL name (letters, digits, _; 63 at most), got {name!r}"
        )
    return name


def quote(name: str) -> str:
    """A checked identifier, quoted (IDENTIFIER admits no quote character)."""
    return f'"{name}"'


@dataclass(frozen=True)
class TableSpec:
    """The guarded table and what the service reads and writes of it.

    The default is the service's own `records(key, value)` table, created when missing, whose
    record is the JSON text in `value`. Any other table must exist; its record is a JSON
    object of `columns` (all of them when empty), and writes through the service take such an
    object too.
    """

    table: str = "records"
    key_column: str = "key"
    columns: tuple[str, ...] = ()
    prefix: str = "guard"

    def __post_init__(self) -> None:
        identifier("GUARD_RECORDS_TABLE", self.table)
        identifier("GUARD_RECORDS_KEY_COLUMN", self.key_column)
        for c in self.columns:
            identifier("GUARD_RECORDS_COLUMNS", c)
        identifier("GUARD_FEED_PREFIX", self.prefix)

    @property
    def own(self) -> bool:
        """The service's own key-value table (created if missing, seeded with demo rows)."""
        return self.table == "records" and self.key_column == "key" and not self.columns

    @property
    def changes(self) -> str:
        """SQLite's log (and PostgreSQL's before the change feed stopped serialising writers:
        an installed one is upgraded at start-up)."""
        return f"{self.prefix}_changes"

    @property
    def feed(self) -> str:
        return f"{self.prefix}_feed"

    @property
    def events(self) -> str:
        """PostgreSQL: the changes as writers append them, in no order yet."""
        return f"{self.prefix}_events"

    @property
    def events_seq(self) -> str:
        return f"{self.prefix}_events_seq"

    @property
    def ticks(self) -> str:
        """PostgreSQL: the snapshots that cut the events into ordered batches."""
        return f"{self.prefix}_ticks"

    @property
    def tick_function(self) -> str:
        return f"{self.prefix}_tick"

    def trigger(self, what: str) -> str:
        return f"{self.prefix}_{self.table}_{what}"[:63]


def parse_columns(raw: str) -> tuple[str, ...]:
    """GUARD_RECORDS_COLUMNS: a JSON array of names or a comma-separated list ("" = all)."""
    raw = raw.strip()
    names: Any = (
        json.loads(raw) if raw.startswith("[") else [c.strip() for c in raw.split(",") if c.strip()]
    )
    if not isinstance(names, list) or not all(isinstance(c, str) for c in names):
        raise DatabaseSetupError("GUARD_RECORDS_COLUMNS must list column names")
    return tuple(identifier("GUARD_RECORDS_COLUMNS", c) for c in names)


def new_feed_source() -> int:
    """A new change log's identity: random, so a log made again (or another database's)
    is never taken for the one a filter followed."""
    return secrets.randbelow(MAX_SOURCE) + 1


def integer_key(key: str) -> int | None:
    """The integer a key names, for an integer key column; None when no row can have it.

    Only the canonical spelling counts ("7", never "07" or "+7"): keys travel as text and the
    filter holds str(int) of each row's key, so "07" is no key of the table.
    """
    try:
        n = int(key)
    except ValueError:
        return None
    return n if str(n) == key and n in INT64 else None
