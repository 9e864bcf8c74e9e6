"""`python -m bench feed`: the change feed's lag from commit to filter, and records rebuilds.

**Lag.** A writer process inserts rows into a PostgreSQL table the service guards, one
autocommitted INSERT at a time, at a fixed rate, and notes when each commit returned. The
service's follower (app/feed.py, in this process, woken by LISTEN/NOTIFY) applies the log to
the filter; each of its `apply_changes` calls is timed when it returns, with the filter's
`applied` id after it. A row's lag is the time from its commit until the first apply that
covered its change id: from then on, lookups find it. Writes through the service have no lag
(their change is in the filter before their commit), so this is the window in which a row
written behind the service's back reads as absent. The same on SQLite, where the follower
polls the log's counter (about every 15 ms) instead of being notified.

**Rebuild.** A table of N rows, on PostgreSQL and on SQLite, rebuilt by the service's
`RecordStore.rebuild()` (bulk builder from one snapshot, log replay, promote) and, in the same
run on the same table, by the rebuild this replaced: a staging filter reserved and filled with
`insert_many` a page at a time, then promoted.

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
from bench.markdown import Row, figures_report
from devkit.postgres import temporary_database
from guard import CuckooFilter
from guard.changes import ApplyResult, Change
from guard.connect import connect_async

FULL = {"seconds": 10.0, "rebuild_rows": 1_000_000}
QUICK = {"seconds": 2.0, "rebuild_rows": 100_000}
RATES = (100, 1000)  # direct writes per second
TABLE_ROWS = 100_000  # rows in the table before the lag runs (the filter sized for them)
PAGE = 1000  # GUARD_REBUILD_BATCH's default: the page size of both rebuilds
# The issues' targets: p99 lag at 1,000 writes/s (issue 16), a rebuild of 1M rows (issue 15).
T_P99_MS = 100.0
T_REBUILD_X = 20.0

# The writer: one connection, an INSERT per commit at `rate` a second; prints
# [[key, monotonic time the commit returned], ...]. time.monotonic is the system-wide
# CLOCK_MONOTONIC on Linux: comparable across processes. Its commits do not wait for the WAL
# flush (synchronous_commit=off): with it, writers of the table go one commit per flush
# (the change log's counter row is locked to commit), fewer than 1,000 a second here; the
# "ceiling" section measures that.
_WRITER = """
import asyncio, json, sqlite3, sys, time

async def main(url, rate, seconds, tag):
    if url.startswith("sqlite:///"):
        # Autocommit; NORMAL: in WAL mode a commit does not wait for fsync (as above).
        conn = sqlite3.connect(url[len("sqlite:///"):], isolation_level=None, timeout=10)
        conn.execute("PRAGMA synchronous=NORMAL")

        async def insert(key):
            conn.execute("INSERT INTO records (key, value) VALUES (?, '1')", (key,))
    else:
        import asyncpg

        pg = await asyncpg.connect(url, server_settings={"synchronous_commit": "off"})
        statement = await pg.prepare("INSERT INTO records (key, value) VALUES ($1, '1')")

        async def insert(key):
            await statement.fetch(key)
    done = []
    start = time.monotonic() + 0.05
    for i in range(int(rate * seconds)):
        wait = start + i / rate - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        key = f"{tag}-{i}"
        await insert(key)
        done.append((key, time.monotonic()))
    json.dump(done, sys.stdout)

asyncio.run(main(sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]))
"""


def measure(target: Any, seconds: float, rebuild_rows: int, pg_prefix: str) -> list[Row]:
    """Every figure of the report, on the pipeline's Redis (a bench.suite.Target)."""
    return asyncio.run(_measure(target.url, target.prefix, seconds, rebuild_rows, pg_prefix))


async def _measure(
    url: str, prefix: str, seconds: float, rebuild_rows: int, pg_prefix: str
) -> list[Row]:
    rows: list[Row] = []
    async with temporary_database(pg_prefix) as pg:
        conn = await asyncpg.connect(pg)
        version = await conn.fetchval("SHOW server_version")
        await conn.close()
        rows.append(Row("setup", "PostgreSQL server", 0, "", f"{version}, loopback"))
        for rate in RATES:
            rows += await _lag_rows(url, f"{prefix}lag{rate}:", pg, "PostgreSQL", rate, seconds)
        rows += await _ceiling_rows(pg, min(seconds, 3.0))
    with tempfile.TemporaryDirectory(prefix="guard-bench-feed-", dir="/tmp") as tmp:
        sqlite = f"sqlite:///{Path(tmp) / 'lag.db'}"
        for rate in RATES:
            rows += await _lag_rows(url, f"{prefix}sqlag{rate}:", sqlite, "SQLite", rate, seconds)
    async with temporary_database(pg_prefix) as pg:
        rows += await _rebuild_rows(url, f"{prefix}pg:", pg, "PostgreSQL", rebuild_rows)
    with tempfile.TemporaryDirectory(prefix="guard-bench-feed-", dir="/tmp") as tmp:
        sqlite = f"sqlite:///{Path(tmp) / 'records.db'}"
        rows += await _rebuild_rows(url, f"{prefix}sqlite:", sqlite, "SQLite", rebuild_rows)
    return rows


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
    url: str, prefix: str, database: str, name: str, rate: int, seconds: float
) -> list[Row]:
    cfg = _settings(url, prefix, database)
    redis, db, store = await _open(cfg)
    try:
        await db.seed(TABLE_ROWS)
        await store.rebuild()
        applies = _timed_applies(store.filter)
        follower = store.follower()
        task = asyncio.create_task(follower.run())
        tag = f"lag{rate}"
        writer = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _WRITER, database, str(rate), str(seconds), tag,
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, _ = await writer.communicate()
        if writer.returncode != 0:
            raise RuntimeError(f"the writer failed ({writer.returncode})")
        commits: list[tuple[str, float]] = json.loads(out)
        newest = await db.newest_change()
        while not applies or applies[-1][1] < newest:
            await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        ids = {c.item: c.id for c in await db.changes_after(0, 10 * len(commits) + TABLE_ROWS)}
    finally:
        await _drop(redis, prefix)
        await db.close()
    times = [t for t, _ in applies]
    covered = [a for _, a in applies]
    lags = []
    for key, committed in commits:
        first = bisect.bisect_left(covered, ids[key])  # applies are in id order
        lags.append(max(0.0, times[first] - committed) * 1000)
    span = commits[-1][1] - commits[0][1]
    section = f"lag from commit to filter, {name}, {rate:,} direct writes/s"
    per_call = len(commits) / len(applies)
    return [
        Row(section, "writes", len(commits), "", f"{len(commits) / span:,.0f}/s achieved "
            f"over {span:.1f} s, one INSERT per commit"),
        Row(section, "p50", statistics.median(lags), "ms"),
        Row(section, "p99", _quantile(lags, 0.99), "ms"),
        Row(section, "max", max(lags), "ms"),
        Row(section, "apply_changes calls", len(applies), "",
            f"{per_call:.1f} changes per call"),
    ]  # fmt: skip


async def _ceiling_rows(pg: str, seconds: float) -> list[Row]:
    """Single-row commits a second into the guarded table, as fast as they go."""
    section = "commits a second into the guarded table (PostgreSQL, no follower)"
    out = []
    for sync, connections in (("on", 1), ("on", 4), ("off", 1)):
        done = await _commit_flat_out(pg, sync, connections, seconds)
        note = "each waits for the one before to commit (the log's counter row)"
        out.append(
            Row(section, f"synchronous_commit={sync}, {connections} connection(s)",
                done / seconds, "commits/s", note if connections > 1 else "")
        )  # fmt: skip
    return out


async def _commit_flat_out(pg: str, sync: str, connections: int, seconds: float) -> int:
    conns = [
        await asyncpg.connect(pg, server_settings={"synchronous_commit": sync})
        for _ in range(connections)
    ]
    stop = time.monotonic() + seconds

    async def write(conn: asyncpg.Connection, n: int) -> int:
        i = 0
        while time.monotonic() < stop:
            await conn.execute(
                "INSERT INTO records (key, value) VALUES ($1, '1')",
                f"c-{sync}{connections}-{n}-{i}",
            )
            i += 1
        return i

    try:
        return sum(await asyncio.gather(*(write(c, n) for n, c in enumerate(conns))))
    finally:
        for conn in conns:
            await conn.close()


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
    p99 = get[(f"lag from commit to filter, PostgreSQL, {RATES[-1]:,} direct writes/s", "p99")]
    out = [(f"p99 lag <= {T_P99_MS:g} ms at {RATES[-1]:,} writes/s", f"{p99:.1f} ms",
            p99 <= T_P99_MS)]  # fmt: skip
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

- The writer runs in a process of its own; the follower in this one, as in the service (one
  event loop, the filter on the same Redis). Lag is clamped at 0 when the follower's apply
  returned before the writer's INSERT did (the commit's NOTIFY can outrun the reply).
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
    if row.unit == "commits/s":
        return f"{row.value:,.0f}/s"
    if row.unit == "rows/s":
        return f"{row.value:,.0f} rows/s"
    if row.unit == "x":
        return f"{row.value:.1f}x"
    return f"{row.value:,.0f}"


def report(rows: list[Row]) -> str:
    """The markdown of docs/bench-feed.md (the pipeline adds the title and environment)."""
    return figures_report(__doc__ or "", targets(rows), NOTES, rows, _value)
