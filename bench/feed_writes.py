"""What guarding a PostgreSQL table costs the application's own writers, measured with pgbench.

Three identical tables `(id bigint primary key, email text, name text)` in one database:
**unguarded**; **floor**, the same with nothing but one minimal trigger per statement kind
appending `(op, key)` to a log table with a sequence id (what any trigger-fed change log must
pay at least); **guarded**, the table the guard's follower (`guard follow`, a process of its
own, as a service would run it) follows, with the change log the service installs. Each
statement kind runs with pgbench (8 clients, prepared statements, `synchronous_commit` as the
server has it: on) for the same time on each table, in turn, several rounds: the ratios are
taken round by round, so the machine's drift cancels out.

Statement kinds: a one-row `INSERT` of a new key; a one-row `UPDATE` of a non-key column; a
one-row `UPDATE` that changes the key; a one-row `DELETE`; and a `COPY` of 100,000 rows
(timed from this process, the three tables in turn).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg

from guard import CuckooFilter, FilterNotFoundError
from guard.connect import connect_async

TABLES = ("unguarded", "floor", "guarded")
KINDS = ("insert", "update", "key_update", "delete")
CLIENTS = 8
COPY_ROWS = 100_000
FILTER = "writes"

# One statement per transaction, as an application autocommits it. Keys of inserts are random
# 63-bit numbers (a collision is as likely as none); updates and deletes pick a prefilled row.
_SCRIPTS = {
    "insert": "\\set k random(1, 9000000000000000000)\n"
    "INSERT INTO {t} (id, email, name) VALUES (:k, 'a@example.com', 'Ann');\n",
    "update": "\\set k random(1, {rows})\nUPDATE {t} SET name = 'Bob' WHERE id = :k;\n",
    # A key moved out of the prefilled range, to a key no other row has.
    "key_update": "\\set k random(1, {rows})\nUPDATE {t} SET id = -id WHERE id = :k;\n",
    "delete": "\\set k random(1, {rows})\nDELETE FROM {t} WHERE id = :k;\n",
}

# The floor: what a trigger-fed log costs at least. No lock, no notification, a sequence id.
_FLOOR_SQL = """
CREATE TABLE floor_log (id bigserial PRIMARY KEY, op char(1) NOT NULL, key text NOT NULL);
CREATE FUNCTION floor_insert() RETURNS trigger LANGUAGE plpgsql AS
  $$BEGIN INSERT INTO floor_log (op, key) SELECT 'i', id::text FROM new_rows; RETURN NULL; END$$;
CREATE FUNCTION floor_delete() RETURNS trigger LANGUAGE plpgsql AS
  $$BEGIN INSERT INTO floor_log (op, key) SELECT 'd', id::text FROM old_rows; RETURN NULL; END$$;
CREATE FUNCTION floor_update() RETURNS trigger LANGUAGE plpgsql AS
  $$BEGIN INSERT INTO floor_log (op, key) VALUES ('d', OLD.id::text), ('i', NEW.id::text);
  RETURN NULL; END$$;
CREATE TRIGGER floor_insert AFTER INSERT ON floor REFERENCING NEW TABLE AS new_rows
  FOR EACH STATEMENT EXECUTE FUNCTION floor_insert();
CREATE TRIGGER floor_delete AFTER DELETE ON floor REFERENCING OLD TABLE AS old_rows
  FOR EACH STATEMENT EXECUTE FUNCTION floor_delete();
CREATE TRIGGER floor_update AFTER UPDATE OF id ON floor FOR EACH ROW
  WHEN (OLD.id IS DISTINCT FROM NEW.id) EXECUTE FUNCTION floor_update();
"""


@dataclass
class WriteCost:
    """Per statement kind and table: the transactions a second of each round."""

    tps: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    copy_s: dict[str, list[float]] = field(default_factory=dict)  # seconds per COPY
    follower_items: int = -1  # the guarded filter's items at the end
    table_rows: int = -1  # the guarded table's rows at the end

    def ratios(self, kind: str, over: str) -> list[float]:
        """guarded / `over`, round by round."""
        runs = self.tps[kind]
        return [g / o for g, o in zip(runs["guarded"], runs[over], strict=True)]

    def copy_ratios(self, over: str) -> list[float]:
        """guarded / `over` COPY throughput, run by run."""
        return [o / g for g, o in zip(self.copy_s["guarded"], self.copy_s[over], strict=True)]


def pgbench() -> str:
    found = shutil.which("pgbench") or "/usr/lib/postgresql/15/bin/pgbench"
    if not Path(found).exists():
        raise RuntimeError("pgbench not found (Debian: postgresql-client)")
    return found


async def prepare(pg: str, rows: int) -> None:
    """The three tables, each prefilled with ids 1..rows (before any trigger: not logged)."""
    conn = await asyncpg.connect(pg)
    try:
        for t in TABLES:
            await conn.execute(f"CREATE TABLE {t} (id bigint PRIMARY KEY, email text, name text)")
            await conn.execute(
                f"INSERT INTO {t} SELECT g, 'u' || g || '@example.com', 'User' "
                "FROM generate_series(1, $1::bigint) g",
                rows,
            )
        await conn.execute(_FLOOR_SQL)
        await conn.execute("VACUUM ANALYZE")
    finally:
        await conn.close()


@contextmanager
def follower(pg: str, redis_url: str, key_prefix: str) -> Iterator[subprocess.Popen[bytes]]:
    """`guard follow` on the guarded table: it installs the change log, builds the filter
    from the table and follows it, as a service would."""
    env = {
        **os.environ,
        "GUARD_REDIS_URL": redis_url,
        "GUARD_KEY_PREFIX": key_prefix,
        "GUARD_DATABASE_URL": pg,
        "GUARD_RECORDS_TABLE": "guarded",
        "GUARD_RECORDS_KEY_COLUMN": "id",
        "GUARD_RECORDS_FILTER": FILTER,
        "GUARD_DEMO_RECORDS": "0",
        "GUARD_LOG_LEVEL": "WARNING",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "follow"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def wait_for_filter(redis_url: str, key_prefix: str, proc: subprocess.Popen[bytes]) -> None:
    redis = connect_async(redis_url)
    cf = CuckooFilter(redis, FILTER, prefix=key_prefix)
    try:
        for _ in range(1200):
            if proc.poll() is not None:
                err = proc.stderr.read().decode() if proc.stderr else ""
                raise RuntimeError(f"guard follow exited ({proc.returncode}): {err[-2000:]}")
            try:
                await cf.applied_change()
                return
            except FilterNotFoundError:
                await asyncio.sleep(0.1)
        raise RuntimeError("guard follow built no filter in 120 s")
    finally:
        await redis.aclose()


def run_pgbench(pg: str, script: Path, seconds: float) -> float:
    """Transactions a second of one pgbench run (failed ones are an error)."""
    out = subprocess.run(
        [pgbench(), "-n", "-M", "prepared", "-c", str(CLIENTS), "-j", "2",
         "-T", str(max(1, round(seconds))), "-f", str(script), pg],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"pgbench failed: {out.stderr[-2000:]}")
    failed = re.search(r"number of failed transactions: (\d+)", out.stdout)
    if failed and int(failed.group(1)):
        raise RuntimeError(f"pgbench: {failed.group(1)} failed transactions\n{out.stdout}")
    tps = re.search(r"tps = ([\d.]+) \(without initial connection time\)", out.stdout)
    if tps is None:
        raise RuntimeError(f"no tps in pgbench's output:\n{out.stdout}")
    return float(tps.group(1))


async def copy_seconds(pg: str, table: str, first: int) -> float:
    conn = await asyncpg.connect(pg)
    try:
        records = [(first + i, "c@example.com", "Copy") for i in range(COPY_ROWS)]
        start = time.perf_counter()
        await conn.copy_records_to_table(table, records=records, columns=["id", "email", "name"])
        return time.perf_counter() - start
    finally:
        await conn.close()


async def measure(
    pg: str, redis_url: str, key_prefix: str, seconds: float, rounds: int, rows: int
) -> WriteCost:
    """pgbench every kind on every table, `rounds` times, the tables in turn."""
    await prepare(pg, rows)
    cost = WriteCost(
        tps={kind: {t: [] for t in TABLES} for kind in KINDS},
        copy_s={t: [] for t in TABLES},
    )
    with (
        tempfile.TemporaryDirectory(prefix="guard-bench-writes-") as tmp,
        follower(pg, redis_url, key_prefix) as proc,
    ):
        await wait_for_filter(redis_url, key_prefix, proc)
        scripts = {}
        for kind in KINDS:
            for t in TABLES:
                path = Path(tmp) / f"{kind}-{t}.sql"
                path.write_text(_SCRIPTS[kind].format(t=t, rows=rows))
                scripts[kind, t] = path
        for n in range(rounds):
            for kind in KINDS:
                # The order turns each round: no table always runs first (or last).
                order = TABLES[n % 3 :] + TABLES[: n % 3]
                for t in order:
                    tps = await asyncio.to_thread(run_pgbench, pg, scripts[kind, t], seconds)
                    cost.tps[kind][t].append(tps)
            for t in TABLES[n % 3 :] + TABLES[: n % 3]:
                # Keys far above the prefilled ones and the inserts' random keys' range.
                first = -(10**15) * (n + 1)
                cost.copy_s[t].append(await copy_seconds(pg, t, first))
        if proc.poll() is not None:
            raise RuntimeError(f"guard follow stopped during the run ({proc.returncode})")
        cost.follower_items, cost.table_rows = await _caught_up(pg, redis_url, key_prefix)
    return cost


async def _caught_up(pg: str, redis_url: str, key_prefix: str) -> tuple[int, int]:
    """(filter items, table rows) once the follower applied the last change."""
    conn = await asyncpg.connect(pg)
    redis = connect_async(redis_url)
    cf = CuckooFilter(redis, FILTER, prefix=key_prefix)
    try:
        rows = int(await conn.fetchval("SELECT count(*) FROM guarded"))
        items = -1
        for _ in range(600):
            items = (await cf.info()).items
            if items == rows:
                break
            await asyncio.sleep(0.1)
        return items, rows
    finally:
        await conn.close()
        await redis.aclose()


def summary(cost: WriteCost) -> list[tuple[str, str, str, str, str]]:
    """(statement, unguarded tps, guarded tps, guarded/unguarded, guarded/floor) medians."""
    out = []
    for kind in KINDS:
        runs = cost.tps[kind]
        out.append((
            kind,
            f"{statistics.median(runs['unguarded']):,.0f}",
            f"{statistics.median(runs['floor']):,.0f}",
            f"{statistics.median(runs['guarded']):,.0f}",
            f"{statistics.median(cost.ratios(kind, 'unguarded')):.2f}",
            f"{statistics.median(cost.ratios(kind, 'floor')):.2f}",
        ))  # fmt: skip
    return out
