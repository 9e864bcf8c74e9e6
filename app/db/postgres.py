"""PostgreSQL as the database of record (asyncpg, with pools), and its change feed.

What the change feed adds to the database (docs/postgresql.md lists it, and how to remove it):
the sequence `<p>_events_seq`, the tables `<p>_events`, `<p>_ticks` and `<p>_feed`, the function
`<p>_tick()`, four trigger functions and four triggers on the guarded table. Nothing else of the
user's table changes.

**Writers take no lock of ours.** A statement that changes the key set appends its rows to
`<p>_events` (one set-based INSERT per statement, from statement-level triggers with transition
tables; a row-level trigger for key-changing UPDATEs only), each with a number from the sequence
and its transaction's id. Nothing is locked, counted or notified: writers of the table commit
side by side, group commit included, as they would unguarded.

**Order comes from snapshots, afterwards** (the design of Skytools PgQ). A *tick* records a
transaction snapshot: the events visible in tick n's snapshot and not in tick n-1's are batch n.
Every committed event lands in exactly one batch, rolled-back ones in none, and batches follow
commit order: a transaction that committed before another one's change of the same key was even
made (the key's unique index makes it wait) is visible in every snapshot that shows the later
one. Within a batch, events go by sequence number: for changes of one key, that is their commit
order too (the later one drew its number after the earlier one committed). Each tick stores the
running count of events up to its batch, so every event has a gapless **position**: the
change id a filter stores as its `applied` (guard/changes.py). A transaction held open does
not hold back the others: its events join the batch of the first tick after its commit.

Ticks are taken by the guard's own connections (the follower, the watchdog, a service write
waiting for its change), one at a time on the `<p>_feed` row, which the application's
writers never touch.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from typing import Any

import asyncpg

from app.db.base import (
    DatabaseSetupError,
    RecordInputError,
    SnapshotHook,
    TableSpec,
    new_feed_source,
    quote,
    redacted_url,
)
from app.db.common import BaseDatabase, Holds, Key, RowWrite
from guard.changes import Change

log = logging.getLogger(__name__)

INTEGER_TYPES = {"smallint", "integer", "bigint"}
TEXT_TYPES = {"text", "character varying", "character", "name"}
SMALL_TABLE_PAGES = 64  # sample_keys reads such a table whole
# Keys per event row: a statement's keys go in rows of this many (an array stays far below
# PostgreSQL's 1 GB per value, whatever the statement's size).
EVENT_KEYS = 65_536
# A batch larger than this is read through a server-side cursor, in order, a piece per
# changes_after call; smaller ones by one query each (which sorts the whole batch).
BIG_BATCH = 20_000


def _batch(events: str, columns: str, prev: str, cur: str, xip: str | None = None) -> str:
    """SQL: the `columns` of the events in the batch between snapshots `prev` and `cur` —
    visible in `cur`, not in `prev`: begun after it, or in progress in it (`xip`: those
    transactions, an array; default: from `prev`). Two arms, each an index range or list of
    the txid index, so no plan can turn the check of an idle poll into a scan."""
    xip = xip or f"ARRAY(SELECT pg_snapshot_xip({prev}))"
    return (
        f"SELECT {columns} FROM {events} e WHERE e.txid >= pg_snapshot_xmax({prev}) "
        f"AND e.txid < pg_snapshot_xmax({cur}) AND pg_visible_in_snapshot(e.txid, {cur}) "
        f"UNION ALL SELECT {columns} FROM {events} e WHERE e.txid = ANY ({xip}) "
        f"AND pg_visible_in_snapshot(e.txid, {cur})"
    )


@dataclass(frozen=True)
class _Names:
    """The feed's objects, schema-qualified where a writer's session resolves them."""

    table: str
    key: str
    events: str
    seq: str
    ticks: str
    feed: str
    tick: str
    events_index: str  # unqualified: an index lives in its table's schema
    trigger: dict[str, str]  # unqualified: a trigger's function is named with the schema


def _names(spec: TableSpec, schema: str, table_schema: str) -> _Names:
    def q(name: str) -> str:
        return f"{quote(schema)}.{quote(name)}"

    return _Names(
        table=f"{quote(table_schema)}.{quote(spec.table)}",
        key=quote(spec.key_column),
        events=q(spec.events),
        seq=q(spec.events_seq),
        ticks=q(spec.ticks),
        feed=q(spec.feed),
        tick=q(spec.tick_function),
        events_index=quote(f"{spec.events}_txid"),
        trigger={w: quote(spec.trigger(w)) for w in ("insert", "delete", "update", "truncate")},
    )


def _install_sql(n: _Names, schema: str) -> list[str]:
    """The feed's sequence, tables, tick function, trigger functions and triggers (`n`: their
    names, in `schema`); each statement idempotent. The base tick is written by the
    installer (connect)."""
    k = n.key

    def function(name: str, body: str) -> str:
        # SECURITY DEFINER: the application's writers need no privilege on the feed's
        # objects (a missing grant would fail their writes). Every name in the bodies is
        # schema-qualified, pg_catalog's included, so no writer's search_path can make them
        # mean anything else (a SET search_path clause would cost every statement a
        # configuration save and restore).
        return (
            f"CREATE OR REPLACE FUNCTION {quote(schema)}.{name}() RETURNS trigger "
            f"LANGUAGE plpgsql SECURITY DEFINER AS $guard${body}$guard$"
        )

    def append(op: str, rows: str) -> str:
        # A statement of one row (most of an application's) logs an array of one key: no
        # window and no grouping, which cost it a tenth of its throughput (measured, pgbench
        # one-row INSERTs, 0.91x of the floor against 0.96x). A bigger one logs one event
        # row per EVENT_KEYS keys: a COPY of 100,000 rows writes two rows of keys, not
        # 100,000. The keys of one statement are distinct and of one kind, so their order
        # among themselves does not matter.
        return (
            f"BEGIN IF NOT EXISTS (SELECT FROM {rows} OFFSET 1) THEN "
            f"INSERT INTO {n.events} (op, keys) SELECT '{op}', ARRAY[{k}::pg_catalog.text] "
            f"FROM {rows} WHERE {k} IS NOT NULL; "
            f"ELSE INSERT INTO {n.events} (op, keys) SELECT '{op}', pg_catalog.array_agg(r.k) "
            f"FROM (SELECT {k}::pg_catalog.text AS k, "
            f"pg_catalog.row_number() OVER () / {EVENT_KEYS} AS part FROM {rows} "
            f"WHERE {k} IS NOT NULL) r GROUP BY r.part; END IF; RETURN NULL; END"
        )

    update = (
        f"BEGIN INSERT INTO {n.events} (op, keys) SELECT v.op, ARRAY[v.k] FROM (VALUES "
        f"('d', OLD.{k}::pg_catalog.text), ('i', NEW.{k}::pg_catalog.text)) v(op, k) "
        "WHERE v.k IS NOT NULL; RETURN NULL; END"
    )
    tick = f"""
DECLARE last {n.ticks}; cur pg_snapshot; xips xid8[]; added bigint;
BEGIN
  IF taken IS NULL THEN
    -- Nothing committed since the last tick (the common answer of a poll): no lock, no
    -- transaction id, nothing written.
    SELECT * INTO last FROM {n.ticks} ORDER BY tick DESC LIMIT 1;
    SELECT pg_current_snapshot() INTO cur;
    xips := ARRAY(SELECT pg_snapshot_xip(last.snapshot));
    IF NOT EXISTS ({_batch(n.events, "1", "last.snapshot", "cur", "xips")}) THEN
      RETURN last.position;
    END IF;
  END IF;
  -- Tickers take turns on the feed's one row (the application's writers never touch it), and
  -- take their snapshot once it is theirs: so each tick's snapshot is at least as new as the
  -- one before, and every event falls in exactly one batch.
  PERFORM 1 FROM {n.feed} FOR UPDATE;
  SELECT * INTO last FROM {n.ticks} ORDER BY tick DESC LIMIT 1;
  IF taken IS NULL THEN
    SELECT pg_current_snapshot() INTO cur;
  ELSE
    cur := taken;
    IF pg_snapshot_xmax(cur) < pg_snapshot_xmax(last.snapshot)
       OR pg_snapshot_xmin(cur) < pg_snapshot_xmin(last.snapshot) THEN
      RAISE EXCEPTION 'snapshot % is older than tick % (%)', cur, last.tick, last.snapshot;
    END IF;
  END IF;
  xips := ARRAY(SELECT pg_snapshot_xip(last.snapshot));
  SELECT coalesce(sum(b.n), 0) INTO added
    FROM ({_batch(n.events, "cardinality(e.keys) AS n", "last.snapshot", "cur", "xips")}) b;
  IF added > 0 THEN
    INSERT INTO {n.ticks} (tick, snapshot, position)
      VALUES (last.tick + 1, cur, last.position + added);
  END IF;
  RETURN last.position + added;
END"""
    events, ticks, seq = n.events, n.ticks, n.seq
    return [
        # CACHE 1: numbers drawn in the order the draws happen, whichever session draws
        # (a session's cache of numbers would break the order of same-key changes).
        f"CREATE SEQUENCE IF NOT EXISTS {seq} CACHE 1",
        f"CREATE TABLE IF NOT EXISTS {events} ("
        f"seq bigint NOT NULL DEFAULT nextval('{seq}'), "
        "txid xid8 NOT NULL DEFAULT pg_current_xact_id(), "
        'op "char" NOT NULL, keys text[] NOT NULL)',
        # Stored out of line uncompressed: compressing a COPY's keys cost it more than
        # writing them (measured: 0.69x of the same COPY unguarded, against 0.80x).
        f"ALTER TABLE {events} ALTER COLUMN keys SET STORAGE EXTERNAL",
        f"CREATE INDEX IF NOT EXISTS {n.events_index} ON {events} (txid)",
        f"CREATE TABLE IF NOT EXISTS {ticks} (tick bigint PRIMARY KEY, "
        "snapshot pg_snapshot NOT NULL, position bigint NOT NULL UNIQUE)",
        f"CREATE TABLE IF NOT EXISTS {n.feed} (source bigint NOT NULL)",
        # enable_seqscan off: its queries are index probes whatever the planner guesses of a
        # queue table whose statistics lag behind it (a scan of it costs every poll); jit off:
        # the costs that setting adds would have each tiny query compiled (tens of ms).
        f"CREATE OR REPLACE FUNCTION {n.tick}(taken pg_snapshot DEFAULT NULL) RETURNS bigint "
        f"LANGUAGE plpgsql SET enable_seqscan = off SET jit = off AS $guard${tick}$guard$",
        function(n.trigger["insert"], append("i", "new_rows")),
        function(n.trigger["delete"], append("d", "old_rows")),
        function(n.trigger["update"], update),
        function(n.trigger["truncate"], append("d", n.table)),
        f"CREATE OR REPLACE TRIGGER {n.trigger['insert']} AFTER INSERT ON {n.table} "
        "REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT "
        f"EXECUTE FUNCTION {quote(schema)}.{n.trigger['insert']}()",
        f"CREATE OR REPLACE TRIGGER {n.trigger['delete']} AFTER DELETE ON {n.table} "
        "REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT "
        f"EXECUTE FUNCTION {quote(schema)}.{n.trigger['delete']}()",
        # Row level: a statement-level trigger with transition tables can have no column
        # list, and would compare every updated row; this one runs only for a key change.
        f"CREATE OR REPLACE TRIGGER {n.trigger['update']} AFTER UPDATE OF {k} ON {n.table} "
        f"FOR EACH ROW WHEN (OLD.{k} IS DISTINCT FROM NEW.{k}) "
        f"EXECUTE FUNCTION {quote(schema)}.{n.trigger['update']}()",
        # BEFORE: the rows are still there to be logged (TRUNCATE holds an exclusive lock).
        f"CREATE OR REPLACE TRIGGER {n.trigger['truncate']} BEFORE TRUNCATE ON {n.table} "
        f"FOR EACH STATEMENT EXECUTE FUNCTION {quote(schema)}.{n.trigger['truncate']}()",
    ]


def _functions(statements: list[str]) -> dict[str, tuple[str, str]]:
    """Function name -> (its CREATE statement, its body as pg_proc.prosrc holds it), of the
    CREATE FUNCTION statements among `statements`."""
    found = {}
    for statement in statements:
        if statement.startswith("CREATE OR REPLACE FUNCTION"):
            head, body, _ = statement.split("$guard$")
            name = head.split("(", 1)[0].rsplit(".", 1)[1].strip('"')
            found[name] = (statement, body)
    return found


def uninstall_sql(spec: TableSpec) -> list[str]:
    """What removes the change feed again (docs/postgresql.md shows it): pasteable
    statements, each ending in `;`."""
    t = quote(spec.table)
    out = [f"DROP TRIGGER IF EXISTS {quote(spec.trigger(w))} ON {t};" for w in _WHATS]
    functions = ", ".join(f"{quote(spec.trigger(w))}()" for w in _WHATS)
    out.append(f"DROP FUNCTION IF EXISTS {functions}, {quote(spec.tick_function)}(pg_snapshot);")
    tables = ", ".join(quote(x) for x in (spec.events, spec.ticks, spec.feed, spec.changes))
    out.append(f"DROP TABLE IF EXISTS {tables};")
    out.append(f"DROP SEQUENCE IF EXISTS {quote(spec.events_seq)};")
    return out


_WHATS = ("insert", "delete", "update", "truncate")


async def _session_kept(conn: asyncpg.Connection) -> None:
    """A pool's reset of a connection given back: nothing beyond asyncpg's own rollback of a
    transaction left open. The guard's connections keep no session state (no SET, LISTEN,
    session lock or cursor outside a transaction), and asyncpg's default reset (RESET ALL,
    CLOSE ALL, UNLISTEN *, advisory unlock) would cost every pooled query a second round
    trip: measured, a third of the follower's round trips at load."""


class _BatchCursor:
    """A big batch read in order through a server-side cursor, on a connection of its own:
    one sort for the whole batch instead of one per piece."""

    def __init__(self, conn: asyncpg.pool.PoolConnectionProxy, tick: int, position: int,
                 last: int, tx: Any) -> None:  # fmt: skip
        self.conn, self.tick, self.position, self.last, self.tx = conn, tick, position, last, tx

    async def fetch(self, limit: int) -> list[Change]:
        rows = await self.conn.fetch(f"FETCH {int(limit)} FROM guard_batch")
        first = self.position + 1
        self.position += len(rows)
        return [Change(first + i, r[0], str(r[1])) for i, r in enumerate(rows)]


class PostgresDatabase(BaseDatabase):
    """PostgreSQL through asyncpg: a pool for the records, and a small one for the change
    feed and the audit (a follower never waits for a connection a records reader holds)."""

    # wait_for_change asks for a tick this often (with nothing committed since the last one,
    # a tick is an index probe that locks and writes nothing).
    POLL_S = 0.01

    def __init__(
        self,
        url: str,
        latency_ms: float = 0.0,
        table: TableSpec | None = None,
        pool_size: int = 10,
        feed_pool_size: int = 4,
    ) -> None:
        super().__init__(url, latency_ms, table)
        self.ticks_taken = 0  # ticks this process asked for (tests and the bench read it)
        self.key_type = "text"
        self._pool_size = max(3, pool_size)  # iter_keys holds two at once
        self._feed_pool_size = max(2, feed_pool_size)  # a big batch's cursor holds one
        self._pool: asyncpg.Pool | None = None
        self._feed_pool: asyncpg.Pool | None = None
        self._n: _Names | None = None
        self._select = ""
        self._key_sql = "$1"
        self._match = ""
        self._cursor: _BatchCursor | None = None
        self._cursor_lock = asyncio.Lock()

    # ---- setup -------------------------------------------------------------------------

    async def connect(self) -> None:
        try:
            self._pool = await asyncpg.create_pool(
                self.url, min_size=1, max_size=self._pool_size, reset=_session_kept
            )
            # As in the tick function: the feed's reads are index probes of a queue table whose
            # statistics lag behind it, and no tiny query is compiled.
            self._feed_pool = await asyncpg.create_pool(
                self.url,
                min_size=1,
                max_size=self._feed_pool_size,
                server_settings={"enable_seqscan": "off", "jit": "off"},
                reset=_session_kept,
            )
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            raise DatabaseSetupError(
                f"GUARD_DATABASE_URL: cannot connect to {redacted_url(self.url)}: {exc}"
            ) from exc
        async with self._pool.acquire() as conn, conn.transaction():
            # Two services starting at once install the feed once.
            await conn.execute("SELECT pg_advisory_xact_lock(hashtext($1))", self.spec.feed)
            # Only when missing: even IF NOT EXISTS needs CREATE on the schema.
            if self.spec.own and await conn.fetchval("SELECT to_regclass('records') IS NULL"):
                await conn.execute(
                    "CREATE TABLE IF NOT EXISTS records (key text PRIMARY KEY, value text NOT NULL)"
                )
            await self._describe_table(conn)
            schema_of = (
                "SELECT n.nspname FROM pg_class c JOIN pg_namespace n "
                "ON n.oid = c.relnamespace WHERE c.oid = to_regclass($1)"
            )
            # The feed lives where it was installed, else in the first schema of the
            # search_path; the table is wherever the search_path finds it.
            schema = await conn.fetchval(schema_of, self.spec.feed) or await conn.fetchval(
                "SELECT current_schema()"
            )
            self._n = _names(self.spec, schema, await conn.fetchval(schema_of, self._t))
            if not await self._installed(conn):
                await self._install(conn, schema)
            elif outdated := await self._outdated_functions(conn, schema):
                await self._upgrade_functions(conn, outdated)

    async def _install(self, conn: asyncpg.Connection, schema: str) -> None:
        """Install the feed, or upgrade the serialising log an older version installed."""
        n = self._n
        assert n is not None
        old = quote(self.spec.changes)
        upgrading = bool(
            await conn.fetchval(
                "SELECT to_regclass($1) IS NOT NULL AND to_regclass($2) IS NULL",
                self.spec.changes,
                self.spec.events,
            )
        )
        base = 0
        if upgrading:
            # The old triggers took a lock every writer waited for; while the new ones go in,
            # writers of the table wait once, briefly, here.
            await conn.execute(f"LOCK TABLE {self._t} IN SHARE ROW EXCLUSIVE MODE")
            last_id = int(await conn.fetchval(f"SELECT last_id FROM {n.feed}"))
            base = int(await conn.fetchval(f"SELECT COALESCE(min(id) - 1, $1) FROM {old}", last_id))
        for statement in _install_sql(n, schema):
            await conn.execute(statement)
        if upgrading:
            # Changes the old log still holds become the first batch, at the ids they had:
            # filters that stood at one of them go on from there.
            await conn.execute(f"SELECT setval('{n.seq}', GREATEST($1, 1))", last_id)
            await conn.execute(
                f"INSERT INTO {n.events} (seq, op, keys) "
                f'SELECT id, op::text::"char", ARRAY[key] FROM {old} ORDER BY id'
            )
            await conn.execute(f"ALTER TABLE {n.feed} DROP COLUMN IF EXISTS last_id")
            await conn.execute(f"DROP TABLE {old}")
            log.info("upgraded the change log of %s (at change %d) to the change feed",
                     self.spec.table, last_id)  # fmt: skip
        await conn.execute(
            f"INSERT INTO {n.feed} (source) SELECT $1 WHERE NOT EXISTS (SELECT 1 FROM {n.feed})",
            new_feed_source(),
        )
        # The base tick: this transaction's snapshot with this transaction counted as still
        # in progress (a snapshot's xmax is past the last transaction that ended, so it may
        # count us already), so what it wrote (an upgrade's old changes) is the next batch.
        await conn.execute(
            f"INSERT INTO {n.ticks} (tick, snapshot, position) "
            "SELECT 0, (least(pg_snapshot_xmin(s), x) || ':' || pg_snapshot_xmax(s) || ':' || "
            "  array_to_string(ARRAY(SELECT v FROM (SELECT pg_snapshot_xip(s) AS v "
            "  UNION SELECT x WHERE x < pg_snapshot_xmax(s)) u ORDER BY v), ','))::pg_snapshot, $1 "
            "FROM (SELECT pg_current_snapshot() AS s, pg_current_xact_id() AS x) c "
            f"WHERE NOT EXISTS (SELECT 1 FROM {n.ticks})",
            base,
        )

    async def _outdated_functions(self, conn: asyncpg.Connection, schema: str) -> dict[str, str]:
        """The feed's functions whose body differs from this version's (installed by an older
        one): name -> the statement that replaces it."""
        wanted = _functions(_install_sql(self._names, schema))
        rows = await conn.fetch(
            "SELECT p.proname, p.prosrc FROM pg_proc p JOIN pg_namespace s "
            "ON s.oid = p.pronamespace WHERE s.nspname = $1 AND p.proname = ANY($2::text[])",
            schema,
            list(wanted),
        )
        found = {str(r["proname"]): str(r["prosrc"]) for r in rows}
        return {
            name: statement for name, (statement, body) in wanted.items() if found.get(name) != body
        }

    async def _upgrade_functions(self, conn: asyncpg.Connection, outdated: dict[str, str]) -> None:
        """Replace the feed's functions an older version installed (their events mean the
        same: only how they are written changed). Without the right to, the old ones stay:
        they work, at their old cost."""
        names = ", ".join(outdated)
        try:
            async with conn.transaction():  # a savepoint: a refusal leaves the start going on
                for statement in outdated.values():
                    await conn.execute(statement)
        except asyncpg.InsufficientPrivilegeError as exc:
            log.warning("the change feed's functions %s are an older version's and could not "
                        "be replaced (%s): they work, at their old cost", names, exc)  # fmt: skip
        else:
            log.info("replaced the change feed's functions %s with this version's", names)

    async def _describe_table(self, conn: asyncpg.Connection) -> None:
        spec = self.spec
        rows = await conn.fetch(
            "SELECT a.attname, format_type(a.atttypid, a.atttypmod) AS type "
            "FROM pg_attribute a WHERE a.attrelid = to_regclass($1) "
            "AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum",
            self._t,
        )
        types = {str(r["attname"]): str(r["type"]) for r in rows}
        self._check_table(types)
        # Immediate: the order of same-key changes relies on a second writer of a key
        # waiting for the first one's commit; a deferred check lets both go on.
        unique = await conn.fetchval(
            "SELECT EXISTS (SELECT 1 FROM pg_index i JOIN pg_attribute a "
            "ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0] "
            "WHERE i.indrelid = to_regclass($1) AND i.indisunique AND i.indimmediate "
            "AND i.indnkeyatts = 1 AND i.indpred IS NULL AND a.attname = $2)",
            self._t,
            spec.key_column,
        )
        if not unique:
            raise DatabaseSetupError(
                f"GUARD_RECORDS_KEY_COLUMN: {spec.table}.{spec.key_column} must be the primary "
                "key or have a unique index of its own, not deferrable (a key names one row)"
            )
        self.key_type = types[spec.key_column]
        self.integer_keys = self.key_type in INTEGER_TYPES
        if self.integer_keys:
            self._key_sql = "$1::bigint"
        elif self.key_type in TEXT_TYPES or self.key_type.startswith(("character", "varchar")):
            self._key_sql = "$1::text"
        else:
            # uuid, date, ...: compared in the column's type (its index serves), and only
            # the spelling the database prints counts, as for the filter's items.
            self._key_sql = f"$1::text::{self.key_type}"
        match = f"{self._k} = {self._key_sql}"
        if self._key_sql.startswith("$1::text::"):
            match += f" AND {self._k}::text = $1"
        self._match = match
        if spec.own:
            self._select = f"SELECT value FROM records WHERE {match}"
        else:
            cols = ", ".join(quote(c) for c in self.columns)
            self._select = (
                f"SELECT row_to_json(r)::text FROM (SELECT {cols} FROM {self._t} WHERE {match}) r"
            )

    async def _installed(self, conn: asyncpg.Connection) -> bool:
        """Whether the feed's objects and the four triggers are there: then a start needs
        no DDL, so the service's user needs no more than reads and writes of the tables."""
        n = self._n
        assert n is not None
        return bool(
            await conn.fetchval(
                "SELECT to_regclass($1) IS NOT NULL AND to_regclass($2) IS NOT NULL "
                "AND to_regclass($3) IS NOT NULL "
                "AND (SELECT count(*) FROM pg_trigger WHERE tgrelid = to_regclass($4) "
                "AND tgname = ANY($5::text[])) = 4",
                n.events,
                n.ticks,
                n.feed,
                self._t,
                [self.spec.trigger(w) for w in _WHATS],
            )
        )

    async def close(self) -> None:
        await self._close_cursor()
        for pool in (self._pool, self._feed_pool):
            if pool is not None:
                await pool.close()
        self._pool = self._feed_pool = None

    # ---- helpers -----------------------------------------------------------------------

    def _records(self) -> asyncpg.Pool:
        return self._connected(self._pool)

    def _feed(self) -> asyncpg.Pool:
        return self._connected(self._feed_pool)

    @property
    def _names(self) -> _Names:
        return self._connected(self._n)

    @property
    def _key_rule(self) -> str:
        return f"a {self.key_type} as the database prints it"

    async def _printed_key(self, conn: asyncpg.Connection, key: Key) -> Key:
        """A key of a type of its own (uuid, date, ...) only in its canonical spelling."""
        if not self._key_sql.startswith("$1::text::"):
            return key
        try:
            printed = await conn.fetchval(f"SELECT ({self._key_sql})::text", key)
        except asyncpg.DataError:
            printed = None
        if printed != key:
            raise self._key_refused()
        return key

    # ---- records -----------------------------------------------------------------------

    async def _read(self, key: Key) -> str | None:
        await self._query()
        try:
            raw = await self._records().fetchval(self._select, key)
        except asyncpg.DataError:  # not a value of the key's type: no such row
            return None
        return None if raw is None else str(raw)

    def _write_sql(
        self, value: str, record: dict[str, Any] | None
    ) -> tuple[str | None, str, list[Any]]:
        """(UPDATE or None when there is nothing to set, INSERT ... RETURNING 1, parameters
        after the key) for a put."""
        t, k, key_sql = self._t, self._k, self._key_sql
        if record is None:
            return (
                f"UPDATE records SET value = $2 WHERE key = {key_sql}",
                f"INSERT INTO records (key, value) VALUES ({key_sql}, $2) "
                "ON CONFLICT (key) DO NOTHING RETURNING 1",
                [value],
            )
        # json_populate_record converts each value to its column's type, as INSERT would.
        src = f"json_populate_record(NULL::{t}, $2::json) AS r"
        names = [quote(c) for c in record]
        update = None
        if names:
            sets = ", ".join(f"{n} = r.{n}" for n in names)
            update = f"UPDATE {t} SET {sets} FROM {src} WHERE {t}.{k} = {key_sql}"
        insert = (
            f"INSERT INTO {t} ({', '.join([k, *names])}) "
            f"SELECT {', '.join([key_sql, *(f'r.{n}' for n in names)])} FROM {src} "
            f"ON CONFLICT ({k}) DO NOTHING RETURNING 1"
        )
        return update, insert, [json.dumps(record)]

    @asynccontextmanager
    async def _row_write(
        self, key: Key, value: str, record: dict[str, Any] | None
    ) -> AsyncIterator[RowWrite]:
        update, insert, params = self._write_sql(value, record)
        exists = f"SELECT 1 FROM {self._t} WHERE {self._k} = {self._key_sql}"
        async with self._records().acquire() as conn, conn.transaction():
            key = await self._printed_key(conn, key)

            async def updated() -> bool:
                await self._query()
                if update is None:
                    return await conn.fetchval(exists, key) is not None
                return await conn.execute(update, key, *params) != "UPDATE 0"

            async def inserted() -> bool:
                await self._query()
                return await conn.fetchval(insert, key, *params) is not None

            async def stored() -> str:
                await self._query()
                return str(await conn.fetchval(self._select, key))

            try:
                yield RowWrite(updated, inserted, stored)
            except (asyncpg.DataError, asyncpg.IntegrityConstraintViolationError) as exc:
                column = getattr(exc, "column_name", None)
                loc = ("body", "value", column) if column else ("body", "value")
                raise RecordInputError(loc, exc.args[0] if exc.args else str(exc)) from exc

    async def _delete(self, key: Key) -> bool:
        await self._query()
        try:
            status = await self._records().execute(
                f"DELETE FROM {self._t} WHERE {self._match}", key
            )
        except asyncpg.DataError:
            return False
        return status != "DELETE 0"

    async def count(self) -> int:
        await self._query()
        return int(await self._records().fetchval(f"SELECT count(*) FROM {self._t}"))

    async def _seed_rows(self, n: int) -> None:
        await self._query()
        await self._records().execute(
            "INSERT INTO records (key, value) "
            "SELECT 'user-' || g, '\"value-' || g || '\"' FROM generate_series(1, $1) g "
            "ON CONFLICT (key) DO NOTHING",
            n,
        )

    # ---- snapshots ---------------------------------------------------------------------

    async def _snapshot_tick(self, snap: asyncpg.Connection) -> tuple[int, Any]:
        """Start a REPEATABLE READ READ ONLY transaction on `snap` whose snapshot is a tick:
        returns that tick's position (the newest change the snapshot contains) and the
        transaction, for the caller to end.

        The tick function holds the feed row from before the snapshot is taken until the tick
        is written, so no other tick falls between (the lock is on another connection: the
        snapshot must not see the tick's own write)."""
        n = self._names
        tx = snap.transaction(isolation="repeatable_read", readonly=True)
        await tx.start()
        try:
            async with self._feed().acquire() as lock, lock.transaction():
                await lock.execute(f"SELECT 1 FROM {n.feed} FOR UPDATE")
                # The transaction's first statement: its snapshot is taken now.
                at = await snap.fetchval("SELECT pg_current_snapshot()::text")
                self.ticks_taken += 1
                position = int(await lock.fetchval(f"SELECT {n.tick}($1::text::pg_snapshot)", at))
        except BaseException:
            await tx.rollback()
            raise
        return position, tx

    async def iter_keys(
        self, batch_size: int, at_snapshot: SnapshotHook | None = None
    ) -> AsyncIterator[list[str]]:
        """One REPEATABLE READ snapshot, which is also a tick: it has every change up to that
        tick's position and none after it. Writers never wait for it."""
        async with self._records().acquire() as snap:
            position, tx = await self._snapshot_tick(snap)
            try:
                if at_snapshot is not None:
                    await at_snapshot(position)
                await self._query()
                # A page per fetch: iterating the cursor row by row cost a rebuild of 1M rows
                # 1.3 s of Python, against 0.4 s.
                cursor = await snap.cursor(f"SELECT {self._k}::text FROM {self._t}")
                while page := await cursor.fetch(batch_size):
                    yield [record[0] for record in page]
            finally:
                await tx.rollback()

    @asynccontextmanager
    async def _snapshot(self) -> AsyncIterator[Holds]:
        async with self._feed().acquire() as snap:
            position, tx = await self._snapshot_tick(snap)
            try:

                async def holds(key: Key) -> bool:
                    self.feed_queries += 1
                    with suppress(asyncpg.DataError):
                        sql = f"SELECT 1 FROM {self._t} WHERE {self._match}"
                        return bool(await snap.fetchval(sql, key))
                    return False

                yield Holds(position, holds)
            finally:
                await tx.rollback()

    # ---- change feed -------------------------------------------------------------------

    async def _feed_val(self, sql: str, *args: Any) -> Any:
        self.feed_queries += 1
        return await self._feed().fetchval(sql, *args)

    async def feed_source(self) -> int:
        return int(await self._feed_val(f"SELECT source FROM {self._names.feed}"))

    async def newest_change(self) -> int:
        """Tick: cut what was committed since the last tick into a batch; its position."""
        self.ticks_taken += 1
        return int(await self._feed_val(f"SELECT {self._names.tick}()"))

    async def oldest_change(self) -> int:
        return int(
            await self._feed_val(
                f"SELECT position + 1 FROM {self._names.ticks} ORDER BY tick LIMIT 1"
            )
        )

    async def changes_after(self, after: int, limit: int) -> list[Change]:
        """Committed changes with positions after `after`, at most `limit`: from the ticks
        taken, and when they are all read, from a new tick."""
        changes = await self._read_after(after, limit)
        if not changes and await self.newest_change() > after:
            changes = await self._read_after(after, limit)
        return changes

    async def _read_after(self, after: int, limit: int) -> list[Change]:
        # Most batches are small: read them at once, and look the batch of `after + 1` up only
        # when that read does not start there (a big batch, the end, or compacted). One
        # round trip a read, not two; a big batch's next piece goes to its cursor directly.
        cursor = self._cursor
        if cursor is None or cursor.position != after:
            changes = await self._read_small(after, limit)
            if changes:
                return changes
        n = self._names
        self.feed_queries += 1
        found = await self._feed().fetchrow(
            f"SELECT t.tick, p.position AS base, t.position AS last FROM {n.ticks} t "
            f"JOIN {n.ticks} p ON p.tick = t.tick - 1 WHERE t.position > $1 "
            "ORDER BY t.position LIMIT 1",
            after,
        )
        if found is None or found["base"] > after:
            return []  # at the end, or compacted past `after` (oldest_change tells)
        tick, base, last = int(found["tick"]), int(found["base"]), int(found["last"])
        if last - base > BIG_BATCH:
            return await self._read_big(tick, after, last, limit)
        return await self._read_small(after, limit)

    async def _read_small(self, after: int, limit: int) -> list[Change]:
        """The changes from `after + 1` on, at most `limit`, of batches of at most BIG_BATCH
        changes; [] when `after + 1` is in none of them."""
        n = self._names
        # Every batch that holds a position in (after, after + limit], each event numbered
        # from its batch's base, in one statement (one snapshot: a compaction is all or none).
        self.feed_queries += 1
        rows = await self._feed().fetch(
            f"""SELECT pos, op = 'i', key FROM (
                  SELECT p.position + row_number() OVER (
                           PARTITION BY t.position ORDER BY e.seq, u.ord) AS pos,
                         e.op, u.key
                  FROM {n.ticks} t JOIN {n.ticks} p ON p.tick = t.tick - 1
                  CROSS JOIN LATERAL ({
                _batch(n.events, "e.seq, e.op, e.keys", "p.snapshot", "t.snapshot")
            }) e
                  CROSS JOIN LATERAL unnest(e.keys) WITH ORDINALITY u(key, ord)
                  WHERE t.position > $1 AND p.position < $1 + $2 AND t.position - p.position <= $3
                ) b WHERE pos > $1 AND pos <= $1 + $2 ORDER BY pos""",
            after,
            limit,
            BIG_BATCH,
        )
        changes = [Change(int(r[0]), r[1], str(r[2])) for r in rows]
        # Stop before a gap (a big batch later in the range is read by its own call).
        for i, change in enumerate(changes):
            if change.id != after + 1 + i:
                return changes[:i]
        return changes

    async def _read_big(self, tick: int, after: int, last: int, limit: int) -> list[Change]:
        async with self._cursor_lock:
            cursor = self._cursor
            if cursor is None or cursor.tick != tick or cursor.position != after:
                await self._close_cursor()
                cursor = self._cursor = await self._open_cursor(tick, after, last)
            changes = await cursor.fetch(min(limit, last - after))
            if cursor.position >= last or not changes:
                await self._close_cursor()
            return changes

    async def _open_cursor(self, tick: int, after: int, last: int) -> _BatchCursor:
        n = self._names
        conn = await self._feed().acquire()
        try:
            tx = conn.transaction(isolation="repeatable_read", readonly=True)
            await tx.start()
            self.feed_queries += 2
            base = await conn.fetchval(f"SELECT position FROM {n.ticks} WHERE tick = $1", tick - 1)
            if base is None or base > after:
                raise RuntimeError(f"tick {tick} was compacted while it was read")
            await conn.execute(
                f"DECLARE guard_batch NO SCROLL CURSOR FOR SELECT b.op = 'i', u.key "
                f"FROM {n.ticks} t JOIN {n.ticks} p ON p.tick = t.tick - 1 CROSS JOIN LATERAL "
                f"({_batch(n.events, 'e.seq, e.op, e.keys', 'p.snapshot', 't.snapshot')}) b "
                "CROSS JOIN LATERAL unnest(b.keys) WITH ORDINALITY u(key, ord) "
                f"WHERE t.tick = {int(tick)} ORDER BY b.seq, u.ord"
            )
            if after > base:
                await conn.execute(f"MOVE FORWARD {int(after - base)} IN guard_batch")
        except BaseException:
            await self._feed().release(conn)
            raise
        return _BatchCursor(conn, tick, after, last, tx)

    async def _close_cursor(self) -> None:
        cursor, self._cursor = self._cursor, None
        if cursor is not None and self._feed_pool is not None:
            try:
                with suppress(asyncpg.PostgresError, asyncpg.InterfaceError, OSError):
                    await cursor.tx.rollback()
            finally:
                await self._feed_pool.release(cursor.conn)

    async def compact(self, upto: int) -> int:
        """Delete the events of every batch at or below `upto`, and the ticks before the one
        that ends them (it stays: the base of the next batch), in one transaction; the number
        of changes deleted."""
        n = self._names
        async with self._feed().acquire() as conn, conn.transaction():
            self.feed_queries += 3
            cut = await conn.fetchrow(
                f"SELECT tick, snapshot::text FROM {n.ticks} WHERE position <= $1 "
                "ORDER BY tick DESC LIMIT 1",
                upto,
            )
            if cut is None:
                return 0
            deleted = await conn.fetchval(
                f"WITH d AS (DELETE FROM {n.events} e "
                "WHERE e.txid < pg_snapshot_xmax($1::text::pg_snapshot) "
                "AND pg_visible_in_snapshot(e.txid, $1::text::pg_snapshot) "
                "RETURNING cardinality(e.keys) AS n) SELECT coalesce(sum(n), 0) FROM d",
                cut["snapshot"],
            )
            await conn.execute(f"DELETE FROM {n.ticks} WHERE tick < $1", cut["tick"])
        return int(deleted)

    async def _sample_keys(self, n: int) -> list[str]:
        """Random keys: a small table is read whole; a big one samples pages (TABLESAMPLE
        SYSTEM), so an audit costs about what it returns."""
        pages, tuples = await self._feed().fetchrow(
            "SELECT pg_relation_size(to_regclass($1)) / current_setting('block_size')::int, "
            "reltuples FROM pg_class WHERE oid = to_regclass($1)",
            self._t,
        )
        self.feed_queries += 1
        sql = f"SELECT {self._k}::text FROM {{}} ORDER BY random() LIMIT $1"
        if pages <= SMALL_TABLE_PAGES:
            return await self._sample(sql.format(self._t), n)
        rows_per_page = max(1.0, float(tuples) / pages) if tuples > 0 else 50.0
        # Pages are picked one by one with this probability: aim at 4n rows and 8 pages, and
        # widen the sample while it comes back short.
        percent = 100.0 * max(4 * n / (rows_per_page * pages), 8 / pages)
        while True:
            percent = min(100.0, percent)
            keys = await self._sample(
                sql.format(f"{self._t} TABLESAMPLE SYSTEM ({percent:.6f})"), n
            )
            if len(keys) >= n or percent >= 100.0:
                return keys
            percent *= 4

    async def _sample(self, sql: str, n: int) -> list[str]:
        self.feed_queries += 1
        return [str(r[0]) for r in await self._feed().fetch(sql, n)]
