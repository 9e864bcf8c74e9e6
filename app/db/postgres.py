"""PostgreSQL as the database of record (asyncpg, with pools), and its change log.

What the change log adds to the database (docs/postgresql.md lists it, and how to remove it):
the tables `<prefix>_changes(id, op, key)` and `<prefix>_feed(source, last_id)`, four trigger
functions and four triggers on the guarded table. Nothing else of the user's table changes.

Ids are gapless and commit in id order because every logged statement takes the one row of
`<prefix>_feed` FOR UPDATE before numbering its changes, and holds that row lock until its
transaction ends: writers that change the key set are serialised from their first logged
change to their commit, and a rolled-back transaction takes its ids back with it. INSERT
(COPY too) and DELETE are logged by statement-level triggers reading transition tables (one
set-based INSERT per statement: bulk loads stay fast); an UPDATE that changes the key by a
row-level trigger whose WHEN clause leaves every other UPDATE untouched; TRUNCATE by a BEFORE
TRUNCATE trigger logging a delete per row. Each logged statement sends NOTIFY on the channel
`<prefix>_changes` with the newest id; PostgreSQL delivers it at commit.

Writers at REPEATABLE READ or SERIALIZABLE that write the table concurrently get serialisation
failures on that row (and retry, as such transactions must anyway).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import asyncpg

from app.db.base import (
    MAX_SOURCE,
    ChangeHook,
    DatabaseSetupError,
    RecordInputError,
    SnapshotHook,
    TableSpec,
    integer_key,
    quote,
    record_object,
    redacted_url,
)
from guard.changes import Change

log = logging.getLogger(__name__)

INTEGER_TYPES = {"smallint", "integer", "bigint"}
TEXT_TYPES = {"text", "character varying", "character", "name"}
# wait_for_change's fallback: a NOTIFY lost with its connection only delays a wake-up.
POLL_FALLBACK_S = 0.5
SMALL_TABLE_PAGES = 64  # sample_keys reads such a table whole


def _install_sql(spec: TableSpec) -> list[str]:
    """The change log's tables, trigger functions and triggers (idempotent)."""
    t, k = quote(spec.table), quote(spec.key_column)
    feed, changes = quote(spec.feed), quote(spec.changes)
    channel = spec.channel.replace("'", "")
    fn = {what: quote(spec.trigger(what)) for what in ("insert", "delete", "update", "truncate")}

    def statement_log(op: str, rows: str) -> str:
        # Lock the counter row first (it is what serialises writers), number the statement's
        # rows in one set-based INSERT, then move the counter past them.
        return f"""
DECLARE base bigint; n bigint;
BEGIN
  IF NOT EXISTS (SELECT 1 FROM {rows}) THEN RETURN NULL; END IF;
  SELECT last_id INTO base FROM {feed} FOR UPDATE;
  INSERT INTO {changes} (id, op, key)
    SELECT base + row_number() OVER (), '{op}', {k}::text FROM {rows};
  GET DIAGNOSTICS n = ROW_COUNT;
  UPDATE {feed} SET last_id = base + n;
  PERFORM pg_notify('{channel}', (base + n)::text);
  RETURN NULL;
END"""

    def function(name: str, body: str) -> str:
        # The names in the body resolve as at install time, whatever search_path the
        # writer's session has (an application writing sales.users from `public`).
        return (
            f"CREATE OR REPLACE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql "
            f"SET search_path FROM CURRENT AS $guard${body}$guard$"
        )

    update_body = f"""
DECLARE base bigint;
BEGIN
  SELECT last_id INTO base FROM {feed} FOR UPDATE;
  INSERT INTO {changes} (id, op, key)
    VALUES (base + 1, 'd', OLD.{k}::text), (base + 2, 'i', NEW.{k}::text);
  UPDATE {feed} SET last_id = base + 2;
  PERFORM pg_notify('{channel}', (base + 2)::text);
  RETURN NULL;
END"""
    return [
        f"CREATE TABLE IF NOT EXISTS {changes} (id bigint PRIMARY KEY, "
        "op char(1) NOT NULL CHECK (op IN ('i', 'd')), key text NOT NULL)",
        f"CREATE TABLE IF NOT EXISTS {feed} (source bigint NOT NULL, last_id bigint NOT NULL)",
        function(fn["insert"], statement_log("i", "new_rows")),
        function(fn["delete"], statement_log("d", "old_rows")),
        function(fn["update"], update_body),
        function(fn["truncate"], statement_log("d", t)),
        f"CREATE OR REPLACE TRIGGER {fn['insert']} AFTER INSERT ON {t} "
        f"REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION {fn['insert']}()",
        f"CREATE OR REPLACE TRIGGER {fn['delete']} AFTER DELETE ON {t} "
        f"REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION {fn['delete']}()",
        # Row level: a statement-level trigger with transition tables can have no column
        # list, and would compare every updated row; this one runs only for a key change.
        f"CREATE OR REPLACE TRIGGER {fn['update']} AFTER UPDATE OF {k} ON {t} FOR EACH ROW "
        f"WHEN (OLD.{k} IS DISTINCT FROM NEW.{k}) EXECUTE FUNCTION {fn['update']}()",
        # BEFORE: the rows are still there to be logged (TRUNCATE holds an exclusive lock).
        f"CREATE OR REPLACE TRIGGER {fn['truncate']} BEFORE TRUNCATE ON {t} "
        f"FOR EACH STATEMENT EXECUTE FUNCTION {fn['truncate']}()",
    ]


def uninstall_sql(spec: TableSpec) -> list[str]:
    """What removes the change log again (docs/postgresql.md shows it)."""
    t = quote(spec.table)
    out = []
    for what in ("insert", "delete", "update", "truncate"):
        name = quote(spec.trigger(what))
        out.append(f"DROP TRIGGER IF EXISTS {name} ON {t}")
        out.append(f"DROP FUNCTION IF EXISTS {name}()")
    out.append(f"DROP TABLE IF EXISTS {quote(spec.changes)}, {quote(spec.feed)}")
    return out


class PostgresDatabase:
    """PostgreSQL through asyncpg: a pool for the records, a small one for the change feed
    and the audit, and one connection that LISTENs.

    The feed has a pool of its own so that a hook or a barrier holder reading the log never
    waits for a connection held by a writer that is itself waiting for the hook's or the
    barrier's row lock.
    """

    def __init__(
        self,
        url: str,
        latency_ms: float = 0.0,
        table: TableSpec | None = None,
        pool_size: int = 10,
        feed_pool_size: int = 4,
    ) -> None:
        self.url = url
        self.latency = latency_ms / 1000
        self.spec = table or TableSpec()
        self.queries = 0
        self.feed_queries = 0
        self.integer_keys = False
        self.key_type = "text"
        self.columns: tuple[str, ...] = ()
        self._pool_size = max(3, pool_size)  # iter_keys holds two at once
        self._feed_pool_size = max(1, feed_pool_size)
        self._pool: asyncpg.Pool | None = None
        self._feed_pool: asyncpg.Pool | None = None
        self._listener: asyncpg.Connection | None = None
        self._woken = asyncio.Event()  # set, and replaced, by each NOTIFY
        self.notifications = 0
        self._t, self._k = quote(self.spec.table), quote(self.spec.key_column)
        self._feed_t, self._changes_t = quote(self.spec.feed), quote(self.spec.changes)
        self._select = ""
        self._key_sql = "$1"
        self._match = ""

    # ---- setup -------------------------------------------------------------------------

    async def connect(self) -> None:
        try:
            self._pool = await asyncpg.create_pool(self.url, min_size=1, max_size=self._pool_size)
            self._feed_pool = await asyncpg.create_pool(
                self.url, min_size=1, max_size=self._feed_pool_size
            )
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            await self.close()
            raise DatabaseSetupError(
                f"GUARD_DATABASE_URL: cannot connect to {redacted_url(self.url)}: {exc}"
            ) from exc
        try:
            async with self._pool.acquire() as conn, conn.transaction():
                # Two services starting at once install the log once.
                await conn.execute("SELECT pg_advisory_xact_lock(hashtext($1))", self.spec.feed)
                # Only when missing: even IF NOT EXISTS needs CREATE on the schema.
                if self.spec.own and await conn.fetchval("SELECT to_regclass('records') IS NULL"):
                    await conn.execute(
                        "CREATE TABLE IF NOT EXISTS records "
                        "(key text PRIMARY KEY, value text NOT NULL)"
                    )
                await self._describe_table(conn)
                if not await self._installed(conn):
                    for statement in _install_sql(self.spec):
                        await conn.execute(statement)
                await conn.execute(
                    f"INSERT INTO {self._feed_t} (source, last_id) SELECT $1, 0 "
                    f"WHERE NOT EXISTS (SELECT 1 FROM {self._feed_t})",
                    secrets.randbelow(MAX_SOURCE) + 1,
                )
            await self._listen()
        except BaseException:
            await self.close()
            raise

    async def _describe_table(self, conn: asyncpg.Connection) -> None:
        spec = self.spec
        rows = await conn.fetch(
            "SELECT a.attname, format_type(a.atttypid, a.atttypmod) AS type "
            "FROM pg_attribute a WHERE a.attrelid = to_regclass($1) "
            "AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum",
            self._t,
        )
        types = {str(r["attname"]): str(r["type"]) for r in rows}
        if not types:
            raise DatabaseSetupError(f"GUARD_RECORDS_TABLE: no table {spec.table!r}")
        missing = [c for c in (spec.key_column, *spec.columns) if c not in types]
        if spec.own and "value" not in types:
            missing.append("value")
        if missing:
            raise DatabaseSetupError(f"table {spec.table!r} has no column {', '.join(missing)}")
        unique = await conn.fetchval(
            "SELECT EXISTS (SELECT 1 FROM pg_index i JOIN pg_attribute a "
            "ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0] "
            "WHERE i.indrelid = to_regclass($1) AND i.indisunique AND i.indnkeyatts = 1 "
            "AND i.indpred IS NULL AND a.attname = $2)",
            self._t,
            spec.key_column,
        )
        if not unique:
            raise DatabaseSetupError(
                f"GUARD_RECORDS_KEY_COLUMN: {spec.table}.{spec.key_column} must be the primary "
                "key or have a unique index of its own (a key names one row)"
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
        # A delete's hook names the key as given: it must be the spelling the log holds.
        self._match = match
        if spec.own:
            self._select = f"SELECT value FROM records WHERE {match}"
        else:
            self.columns = spec.columns or tuple(types)
            cols = ", ".join(quote(c) for c in self.columns)
            self._select = (
                f"SELECT row_to_json(r)::text FROM (SELECT {cols} FROM {self._t} WHERE {match}) r"
            )

    async def _installed(self, conn: asyncpg.Connection) -> bool:
        """Whether the log's tables and the four triggers are there: then a start needs no
        DDL, so the service's user needs no more than reads and writes of the tables."""
        names = [self.spec.trigger(w) for w in ("insert", "delete", "update", "truncate")]
        return bool(
            await conn.fetchval(
                "SELECT to_regclass($1) IS NOT NULL AND to_regclass($2) IS NOT NULL "
                "AND (SELECT count(*) FROM pg_trigger WHERE tgrelid = to_regclass($3) "
                "AND tgname = ANY($4::text[])) = 4",
                self._changes_t,
                self._feed_t,
                self._t,
                names,
            )
        )

    async def _listen(self) -> None:
        self._listener = await asyncpg.connect(self.url)
        await self._listener.add_listener(self.spec.channel, self._on_notify)

    def _on_notify(self, _conn: Any, _pid: int, _channel: str, _payload: str) -> None:
        # Only a wake-up: the waiter reads the counter itself, so a log that was reset (ids
        # starting again) cannot be mistaken for one that moved on.
        self.notifications += 1
        woken, self._woken = self._woken, asyncio.Event()
        woken.set()

    async def close(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None and not listener.is_closed():
            await listener.close()
        for pool in (self._pool, self._feed_pool):
            if pool is not None:
                await pool.close()
        self._pool = self._feed_pool = None

    # ---- helpers -----------------------------------------------------------------------

    async def _query(self) -> None:
        """Count one statement and apply the artificial latency of a remote database."""
        self.queries += 1
        if self.latency:
            await asyncio.sleep(self.latency)

    def _records(self) -> asyncpg.Pool:
        if self._pool is None:
            raise RuntimeError("database is not connected")
        return self._pool

    def _feed(self) -> asyncpg.Pool:
        if self._feed_pool is None:
            raise RuntimeError("database is not connected")
        return self._feed_pool

    def _key(self, key: str) -> str | int | None:
        """The key as a parameter; None when no row can have it."""
        if self.integer_keys:
            return integer_key(key)
        return key

    async def _new_key(self, conn: asyncpg.Connection, key: str) -> str | int:
        k = self._key(key)
        if k is not None and self._key_sql.startswith("$1::text::"):
            # A type of its own (uuid, date, ...): its canonical spelling, or no key.
            try:
                printed = await conn.fetchval(f"SELECT ({self._key_sql})::text", key)
            except asyncpg.DataError:
                printed = None
            k = key if printed == key else None
        if k is None:
            raise RecordInputError(
                ("path", "key"), f"must be a {self.key_type} as the database prints it"
            )
        return k

    # ---- records -----------------------------------------------------------------------

    async def get(self, key: str) -> str | None:
        k = self._key(key)
        if k is None:
            return None
        await self._query()
        try:
            raw = await self._records().fetchval(self._select, k)
        except asyncpg.DataError:  # not a value of the key's type: no such row
            return None
        return None if raw is None else str(raw)

    async def _hook(
        self, conn: asyncpg.Connection, key: str, insert: bool, on_change: ChangeHook | None
    ) -> None:
        """Run the hook with the change the trigger just logged: this transaction holds the
        counter row, so the counter's value is that change's id."""
        if on_change is None:
            return
        await self._query()
        change_id = await conn.fetchval(f"SELECT last_id FROM {self._feed_t}")
        await on_change(Change(int(change_id), insert, key))

    def _write_sql(self, value: str) -> tuple[str | None, str, list[Any]]:
        """(UPDATE or None when there is nothing to set, INSERT ... RETURNING 1, parameters
        after the key) for a put."""
        t, k, key_sql = self._t, self._k, self._key_sql
        if self.spec.own:
            return (
                f"UPDATE records SET value = $2 WHERE key = {key_sql}",
                f"INSERT INTO records (key, value) VALUES ({key_sql}, $2) "
                "ON CONFLICT (key) DO NOTHING RETURNING 1",
                [value],
            )
        writable = tuple(c for c in self.columns if c != self.spec.key_column)
        obj = record_object(value, writable, self.spec.key_column)
        # json_populate_record converts each value to its column's type, as INSERT would.
        src = f"json_populate_record(NULL::{t}, $2::json) AS r"
        names = [quote(c) for c in obj]
        update = None
        if names:
            sets = ", ".join(f"{n} = r.{n}" for n in names)
            update = f"UPDATE {t} SET {sets} FROM {src} WHERE {t}.{k} = {key_sql}"
        insert = (
            f"INSERT INTO {t} ({', '.join([k, *names])}) "
            f"SELECT {', '.join([key_sql, *(f'r.{n}' for n in names)])} FROM {src} "
            f"ON CONFLICT ({k}) DO NOTHING RETURNING 1"
        )
        return update, insert, [json.dumps(obj)]

    async def put(self, key: str, value: str, on_change: ChangeHook | None = None) -> bool:
        update, insert, params = self._write_sql(value)
        exists = f"SELECT 1 FROM {self._t} WHERE {self._k} = {self._key_sql}"
        async with self._records().acquire() as conn, conn.transaction():
            k = await self._new_key(conn, key)
            try:
                # A row another transaction inserts between the two statements makes the
                # INSERT do nothing: then it is a replace, so try the UPDATE again.
                for _ in range(10):
                    await self._query()
                    if update is not None:
                        done = await conn.execute(update, k, *params) != "UPDATE 0"
                    else:
                        done = await conn.fetchval(exists, k) is not None
                    if done:
                        return False
                    await self._query()
                    if await conn.fetchval(insert, k, *params) is not None:
                        break
                else:
                    raise RuntimeError(f"row {key!r} kept appearing and disappearing")
            except (asyncpg.DataError, asyncpg.IntegrityConstraintViolationError) as exc:
                column = getattr(exc, "column_name", None)
                loc = ("body", "value", column) if column else ("body", "value")
                raise RecordInputError(loc, exc.args[0] if exc.args else str(exc)) from exc
            await self._hook(conn, key, True, on_change)
            return True

    async def delete(self, key: str, on_change: ChangeHook | None = None) -> bool:
        k = self._key(key)
        if k is None:
            return False
        async with self._records().acquire() as conn, conn.transaction():
            await self._query()
            try:
                status = await conn.execute(f"DELETE FROM {self._t} WHERE {self._match}", k)
            except asyncpg.DataError:
                return False
            if status == "DELETE 0":
                return False
            await self._hook(conn, key, False, on_change)
            return True

    async def count(self) -> int:
        await self._query()
        return int(await self._records().fetchval(f"SELECT count(*) FROM {self._t}"))

    async def seed(self, n: int) -> int:
        """Fill the service's own empty table with `n` demo rows `user-1` … `user-n`; return
        rows added. A table the service did not create is never seeded."""
        if n <= 0 or not self.spec.own or await self.count():
            return 0
        await self._query()
        await self._records().execute(
            "INSERT INTO records (key, value) "
            "SELECT 'user-' || g, '\"value-' || g || '\"' FROM generate_series(1, $1) g "
            "ON CONFLICT (key) DO NOTHING",
            n,
        )
        return n

    # ---- snapshot and barrier ----------------------------------------------------------

    @asynccontextmanager
    async def write_barrier(self) -> AsyncIterator[None]:
        """Hold the counter row of the change log for the block.

        Every statement that changes the key set, from any connection or process, takes that
        row lock before logging and keeps it to its commit: so this waits for the writers
        under way and holds off the next ones until the block ends. An advisory lock would
        hold off only the writers that ask for it (not the user's application), and a table
        lock would hold off plain UPDATEs and take more than is needed. UPDATEs that leave
        keys alone (a replace) still run: they change nothing the filter holds.
        """
        async with self._records().acquire() as conn, conn.transaction():
            await conn.execute(f"SELECT 1 FROM {self._feed_t} FOR UPDATE")
            yield

    async def iter_keys(
        self, batch_size: int, at_snapshot: SnapshotHook | None = None
    ) -> AsyncIterator[list[str]]:
        """One REPEATABLE READ snapshot, taken while the barrier's row lock is held: it has
        every change up to the counter's value and none after it. Writers wait only for the
        snapshot to be taken (and at_snapshot), not for the paging."""
        pool = self._records()
        async with pool.acquire() as snap:
            tx = snap.transaction(isolation="repeatable_read", readonly=True)
            await tx.start()
            try:
                async with pool.acquire() as lock, lock.transaction():
                    await lock.execute(f"SELECT 1 FROM {self._feed_t} FOR UPDATE")
                    # The snapshot's first statement, so the snapshot is taken now.
                    snapshot_id = int(await snap.fetchval(f"SELECT last_id FROM {self._feed_t}"))
                    if at_snapshot is not None:
                        await at_snapshot(snapshot_id)
                await self._query()
                # A page per fetch: iterating the cursor row by row cost a rebuild of 1M rows
                # 1.3 s of Python, against 0.4 s.
                cursor = await snap.cursor(f"SELECT {self._k}::text FROM {self._t}")
                while page := await cursor.fetch(batch_size):
                    yield [record[0] for record in page]
            finally:
                await tx.rollback()

    # ---- change feed -------------------------------------------------------------------

    async def _feed_val(self, sql: str, *args: Any) -> Any:
        self.feed_queries += 1
        return await self._feed().fetchval(sql, *args)

    async def feed_source(self) -> int:
        return int(await self._feed_val(f"SELECT source FROM {self._feed_t}"))

    async def newest_change(self) -> int:
        return int(await self._feed_val(f"SELECT last_id FROM {self._feed_t}"))

    async def oldest_change(self) -> int:
        # One statement, one snapshot: a compaction between two reads cannot skew them.
        return int(
            await self._feed_val(
                f"SELECT COALESCE((SELECT min(id) FROM {self._changes_t}), last_id + 1) "
                f"FROM {self._feed_t}"
            )
        )

    async def changes_after(self, after: int, limit: int) -> list[Change]:
        self.feed_queries += 1
        rows = await self._feed().fetch(
            f"SELECT id, op, key FROM {self._changes_t} WHERE id > $1 ORDER BY id LIMIT $2",
            after,
            limit,
        )
        return [Change(int(r[0]), r[1] == "i", str(r[2])) for r in rows]

    async def wait_for_change(self, after: int, timeout: float) -> bool:
        """Woken by NOTIFY; every POLL_FALLBACK_S it also reads the counter (and reconnects
        the listener if it was lost), so a lost notification only delays."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            woken = self._woken  # before the read: a NOTIFY during it still wakes us
            if await self.newest_change() > after:
                return True
            left = deadline - loop.time()
            if left <= 0:
                return False
            if self._listener is None or self._listener.is_closed():
                await self._relisten()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(woken.wait(), min(left, POLL_FALLBACK_S))

    async def _relisten(self) -> None:
        try:
            await self._listen()
        except (OSError, asyncpg.PostgresError) as exc:
            log.warning("could not LISTEN on %s again (%s); polling", self.spec.channel, exc)

    async def compact(self, upto: int) -> int:
        self.feed_queries += 1
        status = await self._feed().execute(f"DELETE FROM {self._changes_t} WHERE id <= $1", upto)
        return int(status.split()[-1])

    async def sample_keys(self, n: int) -> list[str]:
        """Random keys: a small table is read whole; a big one samples pages (TABLESAMPLE
        SYSTEM), so an audit costs about what it returns."""
        if n <= 0:
            return []
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
