"""`python -m bench feed`: what the change feed costs the table's writers, its lag from commit
to filter, and records rebuilds.

**Write cost.** bench/feed_writes.py: pgbench, 8 clients, one statement per transaction with
`synchronous_commit` on, into three identical tables in turn, several rounds: unguarded, the
*floor* (nothing but a minimal trigger appending `(op, key)` to a log table with a sequence
id), and guarded (the table `guard follow` follows, in a process of its own). Each statement
kind, and a `COPY` of 100,000 rows.

**Lag.** Writer connections in a process of their own insert rows into a PostgreSQL table the
service guards, one autocommitted INSERT per commit (`synchronous_commit` on), and note when
each commit returned: one connection at 1,000 a second, and 8 connections as fast as they go
(the highest rate the machine sustains). The service's follower (app/feed.py, in this process)
applies the feed to the filter; each of its `apply_changes` calls is timed when it returns,
with the filter's `applied` position after it. A row's lag is the time from its commit until
the first apply that covered its position: from then on, lookups find it. Writes through the
service have no lag (they wait for their change before they answer), so this is the window in
which a row written behind the service's back reads as absent. Once more at 1,000 a second
with one transaction holding an insert open all the while (the others must not wait for it),
and on SQLite, where the follower polls the log's counter.

**Rebuild.** A table of N rows, on PostgreSQL and on SQLite, rebuilt by the service's
`RecordStore.rebuild()` (bulk builder from one snapshot, feed replay, promote) and, in the
same run on the same table, by the rebuild this replaced: a staging filter reserved and filled
with `insert_many` a page at a time, then promoted.

The pipeline (bench/suite.py) gives the Redis server: a private redis-server unless
--redis-url, keys under the run's own prefix. PostgreSQL is the machine's (GUARD_TEST_POSTGRES_URL,
default 127.0.0.1:5432), in databases this run creates and drops.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import asyncpg
import redis.asyncio as aioredis

from app.db import Database, open_database
from app.metrics import Metrics
from app.records import RecordStore
from app.settings import Settings
from bench import feed_writes
from bench.markdown import Row, figures_report
from devkit.postgres import temporary_database
from guard import CuckooFilter
from guard.changes import ApplyResult, Change
from guard.connect import connect_async

FULL = {
    "seconds": 10.0, "rebuild_rows": 1_000_000, "held_s": 30.0,
    "write_seconds": 10.0, "write_rounds": 3, "write_rows": 1_000_000,
}  # fmt: skip
QUICK = {
    "seconds": 2.0, "rebuild_rows": 100_000, "held_s": 3.0,
    "write_seconds": 2.0, "write_rounds": 1, "write_rows": 100_000,
}  # fmt: skip
RATE = 1000  # direct writes per second, one connection
FLAT_OUT = 8  # connections writing as fast as they go
TABLE_ROWS = 100_000  # rows in the table before the lag runs (the filter sized for them)
PAGE = 1000  # GUARD_REBUILD_BATCH's default: the page size of both rebuilds
# The issues' targets: p99 lag at 1,000 writes/s and flat out (issue 24), a rebuild of 1M rows
# (issue 15), what guarding costs writers (issue 24).
T_P99_MS = 50.0
T_REBUILD_X = 20.0
T_INSERT_X = 0.75  # guarded one-row INSERTs / unguarded
T_FLOOR_X = 0.95  # guarded / the floor (INSERT, DELETE, key UPDATE)
T_UPDATE_X = 0.95  # guarded / unguarded, UPDATEs of other columns
T_COPY_X = 0.8  # guarded / unguarded, COPY

# The writer: `connections` connections, an INSERT per commit, at `rate` a second in all (0:
# each as fast as it goes); prints [[key, monotonic time the commit returned], ...].
# time.monotonic is the system-wide CLOCK_MONOTONIC on Linux: comparable across processes.
# PostgreSQL commits wait for their WAL flush (synchronous_commit as the server has it: on).
_WRITER = """
import asyncio, json, sqlite3, sys, time

async def main(url, rate, seconds, tag, connections):
    done = []
    start = time.monotonic() + 0.05
    stop = start + seconds
    if url.startswith("sqlite:///"):
        # Autocommit; NORMAL: in WAL mode a commit does not wait for fsync.
        conn = sqlite3.connect(url[len("sqlite:///"):], isolation_level=None, timeout=10)
        conn.execute("PRAGMA synchronous=NORMAL")

        async def insert(_, key):
            conn.execute("INSERT INTO records (key, value) VALUES (?, '1')", (key,))

        statements = [None]
    else:
        import asyncpg

        conns = [await asyncpg.connect(url) for _ in range(connections)]
        statements = [
            await c.prepare("INSERT INTO records (key, value) VALUES ($1, '1')") for c in conns
        ]

        async def insert(statement, key):
            await statement.fetch(key)

    async def write(n, statement):
        i = 0
        while True:
            if rate:
                wait = start + i / rate - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
            if time.monotonic() >= stop:
                return
            key = f"{tag}-{n}-{i}"
            await insert(statement, key)
            done.append((key, time.monotonic()))
            i += 1

    await asyncio.gather(*(write(n, s) for n, s in enumerate(statements)))
    json.dump(done, sys.stdout)

asyncio.run(main(sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4],
                 int(sys.argv[5])))
"""


def measure(target: Any, **sizes: Any) -> list[Row]:
    """Every figure of the report, on the pipeline's Redis (a bench.suite.Target); `sizes`:
    FULL's or QUICK's keys, and pg_prefix."""
    return asyncio.run(_measure(target.url, target.prefix, **sizes))


async def _measure(
    url: str,
    prefix: str,
    *,
    seconds: float,
    rebuild_rows: int,
    pg_prefix: str,
    held_s: float,
    write_seconds: float,
    write_rounds: int,
    write_rows: int,
) -> list[Row]:
    rows: list[Row] = []
    async with temporary_database(pg_prefix) as pg:
        conn = await asyncpg.connect(pg)
        version = await conn.fetchval("SHOW server_version")
        sync = await conn.fetchval("SHOW synchronous_commit")
        await conn.close()
        rows.append(Row("setup", "PostgreSQL server", 0, "", f"{version}, loopback, "
                        f"synchronous_commit={sync}"))  # fmt: skip
    async with temporary_database(pg_prefix) as pg:
        cost = await feed_writes.measure(
            pg, url, f"{prefix}writes:", write_seconds, write_rounds, write_rows
        )
        rows += _write_rows(cost, write_seconds, write_rounds)
    lags = (
        ("1,000 direct writes/s", RATE, 1, 0.0),
        (f"as fast as {FLAT_OUT} connections go", 0, FLAT_OUT, 0.0),
        (f"1,000 direct writes/s, one transaction held open {held_s:g} s", RATE, 1, held_s),
    )
    for n, (what, rate, connections, held) in enumerate(lags):
        async with temporary_database(pg_prefix) as pg:
            rows += await _lag_rows(
                url, f"{prefix}lag{n}:", pg, "PostgreSQL", what, rate, connections,
                max(seconds, held), held,
            )  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="guard-bench-feed-", dir="/tmp") as tmp:
        sqlite = f"sqlite:///{Path(tmp) / 'lag.db'}"
        rows += await _lag_rows(url, f"{prefix}sqlag:", sqlite, "SQLite",
                                "1,000 direct writes/s", RATE, 1, seconds, 0.0)  # fmt: skip
    async with temporary_database(pg_prefix) as pg:
        rows += await _rebuild_rows(url, f"{prefix}pg:", pg, "PostgreSQL", rebuild_rows)
    with tempfile.TemporaryDirectory(prefix="guard-bench-feed-", dir="/tmp") as tmp:
        sqlite = f"sqlite:///{Path(tmp) / 'records.db'}"
        rows += await _rebuild_rows(url, f"{prefix}sqlite:", sqlite, "SQLite", rebuild_rows)
    return rows


WRITE_SECTION = "what guarding costs the table's own writers (PostgreSQL, pgbench, 8 clients)"
KIND_NAMES = {
    "insert": "one-row INSERT",
    "update": "one-row UPDATE of another column",
    "key_update": "one-row UPDATE of the key",
    "delete": "one-row DELETE",
}


def _write_rows(cost: feed_writes.WriteCost, seconds: float, rounds: int) -> list[Row]:
    out = []
    for kind in feed_writes.KINDS:
        runs = cost.tps[kind]
        medians = {t: statistics.median(runs[t]) for t in feed_writes.TABLES}
        note = (f"transactions/s: unguarded {medians['unguarded']:,.0f}, floor "
                f"{medians['floor']:,.0f}, guarded {medians['guarded']:,.0f} "
                f"(medians of {rounds} rounds of {seconds:g} s each)")  # fmt: skip
        name = KIND_NAMES[kind]
        out.append(Row(WRITE_SECTION, f"{name}: guarded / unguarded",
                       statistics.median(cost.ratios(kind, "unguarded")), "x", note))  # fmt: skip
        out.append(Row(WRITE_SECTION, f"{name}: guarded / floor",
                       statistics.median(cost.ratios(kind, "floor")), "x"))  # fmt: skip
    copy = {t: statistics.median(cost.copy_s[t]) for t in feed_writes.TABLES}
    note = (
        f"seconds per COPY of {feed_writes.COPY_ROWS:,} rows: unguarded "
        f"{copy['unguarded']:.2f}, floor {copy['floor']:.2f}, guarded {copy['guarded']:.2f}"
    )
    out.append(Row(WRITE_SECTION, "COPY: guarded / unguarded",
                   statistics.median(cost.copy_ratios("unguarded")), "x", note))  # fmt: skip
    out.append(Row(WRITE_SECTION, "COPY: guarded / floor",
                   statistics.median(cost.copy_ratios("floor")), "x"))  # fmt: skip
    out.append(Row(WRITE_SECTION, "the follower's filter at the end", cost.follower_items, "",
                   f"items; the guarded table has {cost.table_rows:,} rows"))  # fmt: skip
    return out


def _settings(url: str, prefix: str, database_url: str) -> Settings:
    return Settings(
        redis_url=url,
        key_prefix=prefix,
        database_url=database_url,
        demo_records=0,
        redis_timeout=5.0,
        redis_admin_timeout=120.0,
        feed_compact_interval=3600.0,  # the log is read back at the end
    )


async def _open(cfg: Settings) -> tuple[aioredis.Redis, Database, RecordStore]:
    redis = connect_async(cfg.redis_url, socket_timeout=cfg.redis_admin_timeout)
    db = await open_database(cfg)
    return redis, db, RecordStore(redis, db, cfg, Metrics())


async def _lag_rows(
    url: str,
    prefix: str,
    database: str,
    name: str,
    what: str,
    rate: int,
    connections: int,
    seconds: float,
    held_s: float,
) -> list[Row]:
    cfg = _settings(url, prefix, database)
    redis, db, store = await _open(cfg)
    try:
        await db.seed(TABLE_ROWS)
        await store.rebuild()
        applies = _timed_applies(store.filter)
        task = asyncio.create_task(store.follower.run())
        tag = f"lag{rate}x{connections}"
        held = asyncio.create_task(_held_insert(database, held_s)) if held_s else None
        writer = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _WRITER, database, str(rate), str(seconds), tag,
            str(connections), stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, _ = await writer.communicate()
        if writer.returncode != 0:
            raise RuntimeError(f"the writer failed ({writer.returncode})")
        commits: list[tuple[str, float]] = json.loads(out)
        if held is not None:
            commits.append(await held)
        newest = await db.newest_change()
        while not applies or applies[-1][1] < newest:
            await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        ids = {c.item: c.id for c in await _all_changes(db)}
    finally:
        await _drop(redis, prefix)
        await db.close()
    times = [t for t, _ in applies]
    covered = [a for _, a in applies]
    lags = {}
    for key, committed in commits:
        first = bisect.bisect_left(covered, ids[key])  # applies are in position order
        lags[key] = max(0.0, times[first] - committed) * 1000
    values = list(lags.values())
    span = max(t for _, t in commits) - min(t for _, t in commits)
    section = f"lag from commit to filter, {name}, {what}"
    per_call = len(commits) / len(applies)
    out = [
        Row(section, "writes", len(commits), "", f"{len(commits) / span:,.0f}/s achieved "
            f"over {span:.1f} s, one INSERT per commit"),
        Row(section, "p50", statistics.median(values), "ms"),
        Row(section, "p99", _quantile(values, 0.99), "ms"),
        Row(section, "max", max(values), "ms"),
        Row(section, "apply_changes calls", len(applies), "",
            f"{per_call:.1f} changes per call"),
    ]  # fmt: skip
    if held_s:
        out.append(Row(section, "the held row, from its commit", lags[HELD_KEY], "ms"))
    return out


HELD_KEY = "held-open"


async def _held_insert(database: str, held_s: float) -> tuple[str, float]:
    """A transaction that inserts a row and stays open `held_s` seconds: (key, commit time)."""
    conn = await asyncpg.connect(database)
    try:
        async with conn.transaction():
            await conn.execute("INSERT INTO records (key, value) VALUES ($1, '1')", HELD_KEY)
            await asyncio.sleep(held_s)
        return HELD_KEY, time.monotonic()
    finally:
        await conn.close()


async def _all_changes(db: Database) -> list[Change]:
    out: list[Change] = []
    while changes := await db.changes_after(len(out), 100_000):
        out += changes
    return out


def _timed_applies(cf: CuckooFilter) -> list[tuple[float, int]]:
    """(monotonic time, applied id after it) of each apply_changes call on ``cf``."""
    applies: list[tuple[float, int]] = []
    real = CuckooFilter.apply_changes

    async def timed(changes: list[Change], *, source: int) -> ApplyResult:
        result = await real(cf, changes, source=source)
        applies.append((time.monotonic(), result.applied))
        return result

    cf.apply_changes = timed  # type: ignore[method-assign]
    return applies


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _rebuild_rows(url: str, prefix: str, database: str, name: str, n: int) -> list[Row]:
    cfg = _settings(url, prefix, database)
    redis, db, store = await _open(cfg)
    section = f"records rebuild, {name}, {n:,} rows"
    try:
        start = time.perf_counter()
        await db.seed(n)
        seeded = time.perf_counter() - start
        start = time.perf_counter()
        info = await store.rebuild()
        new = time.perf_counter() - start
        sample = [f"user-{i}" for i in range(1, n + 1, max(1, n // 10_000))]
        missing = (await store.filter.lookup_many(sample)).count(False)
        old = await _old_rebuild(store, db, cfg)
    finally:
        await _drop(redis, prefix)
        await db.close()
    return [
        Row(section, "RecordStore.rebuild() (bulk builder + log)", n / new, "rows/s",
            f"{new:.2f} s; {info.items:,} items, capacity {info.capacity:,}"),
        Row(section, "the rebuild it replaced (reserve + insert_many per page)", n / old,
            "rows/s", f"{old:.2f} s"),
        Row(section, "speed-up", old / new, "x"),
        Row(section, "false negatives in a sample", missing, "",
            f"{len(sample):,} rows looked up after the rebuild"),
        Row(section, "seeding the table (for reference)", n / seeded, "rows/s",
            f"{seeded:.1f} s, change log kept by its triggers"),
    ]  # fmt: skip


async def _old_rebuild(store: RecordStore, db: Database, cfg: Settings) -> float:
    """The records rebuild before the bulk builder, timed (its journal of deletes aside)."""
    staging = CuckooFilter(store.redis, "old-rebuild", prefix=cfg.key_prefix).staging()
    start = time.perf_counter()
    await staging.reserve(cfg.capacity_for(await db.count()), error_rate=cfg.records_error_rate)
    async for page in db.iter_keys(PAGE):
        await staging.insert_many(page)
    await staging.promote()
    return time.perf_counter() - start


async def _drop(redis: aioredis.Redis, prefix: str) -> None:
    async for key in redis.scan_iter(match=f"{prefix}*", count=1000):
        await redis.delete(key)
    await redis.aclose()


def targets(rows: list[Row]) -> list[tuple[str, str, bool]]:
    get = {(row.section, row.figure): row.value for row in rows}
    out = []
    for row in rows:
        if row.figure == "p99" and "PostgreSQL" in row.section:
            where = row.section.removeprefix("lag from commit to filter, PostgreSQL, ")
            out.append((f"p99 lag <= {T_P99_MS:g} ms ({where})", f"{row.value:.1f} ms",
                        row.value <= T_P99_MS))  # fmt: skip
    write = [
        ("one-row INSERT: guarded / unguarded", T_INSERT_X),
        ("one-row INSERT: guarded / floor", T_FLOOR_X),
        ("one-row DELETE: guarded / floor", T_FLOOR_X),
        ("one-row UPDATE of the key: guarded / floor", T_FLOOR_X),
        ("one-row UPDATE of another column: guarded / unguarded", T_UPDATE_X),
        ("COPY: guarded / unguarded", T_COPY_X),
    ]
    for figure, target in write:
        value = get.get((WRITE_SECTION, figure))
        if value is not None:
            out.append((f"{figure} >= {target:g}x", f"{value:.2f}x", value >= target))
    for row in rows:
        if row.figure == "speed-up":
            where = row.section.removeprefix("records rebuild, ")
            out.append((f"rebuild >= {T_REBUILD_X:g}x the one it replaced ({where})",
                        f"{row.value:.1f}x", row.value >= T_REBUILD_X))  # fmt: skip
        if row.figure.startswith("false negatives"):
            where = row.section.removeprefix("records rebuild, ")
            out.append((f"zero false negatives ({where})", f"{row.value:.0f}", row.value == 0))
    return out


NOTES = """How to read it:

- Write cost: the ratios are taken round by round (the tables in turn, the order turning
  each round), then the median; the guarded table's follower runs the whole time, so its
  work (reading the feed, applying it to Redis) is in the guarded figure, on the same two
  cores. The last row checks the follower kept the filter equal to the table.
- The writer runs in a process of its own; the follower in this one, as in the service (one
  event loop, the filter on the same Redis). Lag is clamped at 0 when the follower's apply
  returned before the writer's INSERT did.
- A batch of changes is applied in one script call: under load the follower falls behind by
  a batch at most, and catches up by sending more per call.
- The rebuilds run on the same table, one after the other; *rows/s* counts from the first
  query to the promoted filter. The old rebuild's figure is what `POST /filters/records/
  rebuild` and the start-up rebuild cost before the bulk builder.
- The machine is shared (2 cores): absolute figures move with the load average above; the
  ratios are measured side by side."""


def _value(row: Row) -> str:
    if row.section == "setup":
        return ""
    if row.unit == "ms":
        return f"{row.value:.1f} ms"
    if row.unit == "x" and row.section == WRITE_SECTION:
        return f"{row.value:.2f}x"
    if row.unit == "rows/s":
        return f"{row.value:,.0f} rows/s"
    if row.unit == "x":
        return f"{row.value:.1f}x"
    return f"{row.value:,.0f}"


def report(rows: list[Row]) -> str:
    """The markdown of docs/bench-feed.md (the pipeline adds the title and environment)."""
    return figures_report(__doc__ or "", targets(rows), NOTES, rows, _value)
