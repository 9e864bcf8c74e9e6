"""`python -m bench repair`: how fast the watchdog finds each fault that leaves the records
filter behind its table, how long until every row is found again, and what it costs.

**Faults.** The service runs in this process (its lifespan, the default watchdog settings:
a check every 0.5 s, stale after 1 s of lag, an audit of 32 sampled keys every second) on a
redis-server of the run's own, with a table of N rows. Four clients read present rows through
the guard without pause while one fault is injected (devkit/chaos.py, the chaos tests'
faults). Figures per fault: **detected** (fault to the watchdog's incident: from then on the
guard does not block), **repaired** (fault to the filter trusted again, every row in it: the
issue's "time from Redis losing data to every row found again"), which repair ran, and how
many reads of present rows were blocked before the detection (the window) and after it (must
be 0).

**Cost.** The same service idle, then under the same read load, three ways: watchdog off,
watchdog checks only (GUARD_AUDIT_INTERVAL=0), watchdog with the audit (default). Database
statements (the change-feed connection's, which the follower also uses) and Redis commands
(INFO commandstats of the private server) per second, and reads per second; and the time of
one audit round (sample, lookup) taken alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import redis

from app.settings import Settings
from bench.markdown import table
from devkit.chaos import (
    Chaos,
    Failover,
    InProcess,
    Prober,
    in_process,
    insert_directly,
    ride_out,
)
from devkit.postgres import temporary_database
from devkit.service import API_KEY, AUTH

FULL = {"rows": 100_000, "runs": 3, "seconds": 10.0}
QUICK = {"rows": 10_000, "runs": 1, "seconds": 3.0}
PREFIX = "bench:repair:"
WRITTEN = 100  # rows the faults that need them write after the copy is taken
PROBED = 2000  # present rows the readers cycle through
# (fault, database): every fault on SQLite; those where the database matters on PostgreSQL.
CASES = [
    ("older RDB", "sqlite"),
    ("older RDB", "postgres"),
    ("replica promoted behind", "sqlite"),
    ("key deleted", "sqlite"),
    ("older copy (RESTORE)", "sqlite"),
    ("zeroed in place", "sqlite"),
    ("Redis back empty", "sqlite"),
    ("direct writes, no follower", "sqlite"),
    ("direct writes, no follower", "postgres"),
]


@contextlib.asynccontextmanager
async def _database(kind: str, folder: Path, pg_prefix: str) -> AsyncIterator[str]:
    if kind == "sqlite":
        yield f"sqlite:///{folder / 'records.db'}"
        return
    async with temporary_database(pg_prefix) as url:
        yield url


def _settings(redis_url: str, database: str, rows: int, **extra: Any) -> Settings:
    return Settings(
        redis_url=redis_url,
        key_prefix=PREFIX,
        database_url=database,
        api_key=API_KEY,
        demo_records=rows,
        redis_timeout=2.0,
        log_level="WARNING",
        **extra,
    )


def _writer(svc: InProcess, tag: str) -> Callable[[Prober], Callable[[], Awaitable[None]]]:
    def make(prober: Prober) -> Callable[[], Awaitable[None]]:
        async def write() -> None:
            keys = [f"{tag}-{i}" for i in range(WRITTEN)]
            await svc.put(keys, AUTH)
            prober.add(keys)

        return write

    return make


async def one_fault(fault: str, kind: str, rows: int, pg_prefix: str) -> dict[str, Any]:
    """One run of one fault: its figures."""
    with tempfile.TemporaryDirectory(prefix="guard-bench-repair-", dir="/tmp") as tmp:
        folder = Path(tmp)
        async with contextlib.AsyncExitStack() as stack:
            database = await stack.enter_async_context(_database(kind, folder, pg_prefix))
            if fault.startswith("replica"):
                pair = await Failover(folder / "pair", PREFIX, "records").start()
                stack.push_async_callback(pair.close)
                url = pair.url
            else:
                chaos = Chaos(folder / "redis", PREFIX, "records")
                stack.callback(chaos.close)
                url = chaos.url
            extra = {"feed": False} if "no follower" in fault else {}
            svc = await stack.enter_async_context(
                in_process(_settings(url, database, rows, **extra))
            )
            write = _writer(svc, "written")

            async def inject(prober: Prober) -> float:
                if fault == "older RDB":
                    return await chaos.older_rdb(write(prober))
                if fault.startswith("replica"):
                    return await pair.promote_behind(write(prober))
                if fault == "key deleted":
                    return await chaos.key_deleted()
                if fault.startswith("older copy"):
                    return await chaos.older_copy(write(prober))
                if fault == "zeroed in place":
                    return await chaos.zeroed()
                if fault == "Redis back empty":
                    return await chaos.flushed()
                keys = [f"direct-{i}" for i in range(WRITTEN)]
                await insert_directly(database, keys)
                prober.add(keys)
                return time.monotonic()

            step = max(1, rows // PROBED)
            keys = [f"user-{i}" for i in range(1, rows + 1, step)]
            out = await ride_out(svc.client, svc.state["watchdog"], keys, inject, deadline=120)
    incident = out.incident
    during = [s for s in out.prober.samples if out.fault_at <= s.start < incident.until]
    back = chaos.back_at if fault == "older RDB" else None
    return {
        "restart": None if back is None else back - out.fault_at,
        "detected": incident.since - out.fault_at,
        "repaired": incident.until - out.fault_at,
        "reason": incident.reason,
        "how": incident.how,
        "reads": len(during),
        "blocked_before": len(out.blocked_before_detection),
        "blocked_after": len(out.blocked_while_stale),
    }


def measure_fault(fault: str, kind: str, rows: int, runs: int, pg_prefix: str) -> list[dict]:
    return [asyncio.run(one_fault(fault, kind, rows, pg_prefix)) for _ in range(runs)]


# -- cost ----------------------------------------------------------------------------------

CONFIGS = {
    "watchdog off": {"watchdog": False},
    "checks only": {"audit_interval": 0.0},
    "checks + audit (default)": {},
}


def _redis_calls(port: int) -> int:
    with redis.Redis(port=port) as r:
        stats = r.info("commandstats")
    return sum(int(v["calls"]) for v in stats.values())


async def _cost(config: dict[str, Any], kind: str, rows: int, seconds: float, pg: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="guard-bench-repair-", dir="/tmp") as tmp:
        chaos = Chaos(Path(tmp) / "redis", PREFIX, "records")
        try:
            async with (
                _database(kind, Path(tmp), pg) as database,
                in_process(_settings(chaos.url, database, rows, **config)) as svc,
            ):
                db = svc.state["db"]
                await asyncio.sleep(1.0)  # start-up done, first audit due
                q0, c0, t0 = db.feed_queries, _redis_calls(chaos.port), time.monotonic()
                await asyncio.sleep(seconds)
                idle = time.monotonic() - t0
                queries = (db.feed_queries - q0) / idle
                calls = (_redis_calls(chaos.port) - c0) / idle
                step = max(1, rows // PROBED)
                keys = [f"user-{i}" for i in range(1, rows + 1, step)]
                async with Prober(svc.client, keys) as prober:
                    await asyncio.sleep(0.5)
                    n0, t0 = len(prober.samples), time.monotonic()
                    await asyncio.sleep(seconds)
                    reads = (len(prober.samples) - n0) / (time.monotonic() - t0)
                audit_ms: list[float] = []
                watchdog = svc.state["watchdog"]
                if watchdog is not None:
                    for _ in range(20):
                        t = time.perf_counter()
                        await watchdog.audit()
                        audit_ms.append((time.perf_counter() - t) * 1000)
        finally:
            chaos.close()
    return {
        "db_per_s": queries,
        "redis_per_s": calls,
        "reads_per_s": reads,
        "audit_ms": statistics.median(audit_ms) if audit_ms else None,
    }


def measure_cost(kind: str, rows: int, seconds: float, pg_prefix: str) -> dict[str, dict]:
    return {
        name: asyncio.run(_cost(config, kind, rows, seconds, pg_prefix))
        for name, config in CONFIGS.items()
    }


# -- report --------------------------------------------------------------------------------


def _span(values: list[float], scale: float = 1.0, unit: str = " s") -> str:
    values = sorted(v * scale for v in values)
    if len(values) == 1:
        return f"{values[0]:.2f}{unit}"
    return f"{statistics.median(values):.2f}{unit} ({values[0]:.2f} to {values[-1]:.2f})"


FAULT_HEAD = [
    "fault",
    "database",
    "Redis restarted after",
    "reason found",
    "detected",
    "repaired (all rows found)",
    "repair",
    "present reads blocked before detection / reads",
    "blocked after detection",
]


def fault_row(fault: str, kind: str, runs: list[dict]) -> list[str]:
    return [
        fault,
        "SQLite" if kind == "sqlite" else "PostgreSQL",
        "" if runs[0]["restart"] is None else _span([r["restart"] for r in runs]),
        ", ".join(sorted({r["reason"] for r in runs})),
        _span([r["detected"] for r in runs]),
        _span([r["repaired"] for r in runs]),
        # "": the incident closed before the watchdog repaired it (the follower's replay did).
        ", ".join(sorted({r["how"] or "follower" for r in runs})),
        f"{sum(r['blocked_before'] for r in runs)} / {sum(r['reads'] for r in runs)}",
        str(sum(r["blocked_after"] for r in runs)),
    ]


def fault_table(results: dict[str, list[dict]]) -> str:
    rows = [fault_row(f, k, results[case_name(f, k)]) for f, k in CASES]
    return table(FAULT_HEAD, rows)


def case_name(fault: str, kind: str) -> str:
    return f"{fault} ({kind})"


def cost_table(costs: dict[str, dict]) -> str:
    rows = []
    for name, c in costs.items():
        rows.append(
            [
                name,
                f"{c['db_per_s']:.1f}",
                f"{c['redis_per_s']:.1f}",
                f"{c['reads_per_s']:.0f}",
                "" if c["audit_ms"] is None else f"{c['audit_ms']:.1f} ms",
            ]
        )
    head = [
        "watchdog",
        "feed-connection statements/s (idle)",
        "Redis commands/s (idle)",
        "guarded reads/s (4 clients, in process)",
        "one audit round (median)",
    ]
    return table(head, rows)


def document(m: Any, env: dict[str, str], rows: int, runs: int, seconds: float) -> str:
    from bench.suite import header  # the pipeline's; this module stays importable alone

    results = {name: m.results[name] for name in m.results if not name.startswith("cost")}
    done = [(f, k) for f, k in CASES if case_name(f, k) in results]
    faults = table(FAULT_HEAD, [fault_row(f, k, results[case_name(f, k)]) for f, k in done])
    parts = [
        header("Repair: the watchdog's detection and repair times, and its cost", "repair", m, env),
        "",
        f"A table of {rows:,} rows; {runs} run(s) per fault (median, then min to max); the default "
        "watchdog settings (GUARD_WATCHDOG_INTERVAL=0.5, GUARD_WATCHDOG_MAX_LAG=1, "
        "GUARD_AUDIT_INTERVAL=1, GUARD_AUDIT_SAMPLE=32). The service runs in the bench's process "
        "with 4 clients reading present rows through the guard. What each figure means: "
        "bench/repair.py; what the guard does for each fault: docs/consistency.md.",
        "",
        "## Faults",
        "",
        faults,
        "",
    ]
    for name, kind in (("cost (SQLite)", "SQLite"), ("cost (PostgreSQL)", "PostgreSQL")):
        if name in m.results:
            parts += [
                f"## What the watchdog costs ({kind}, {rows:,} rows)",
                "",
                f"Idle for {seconds:g} s, then {seconds:g} s of reads; statements of the "
                "change-feed connection (the follower's polls included: compare with "
                "'watchdog off'), Redis commands of the whole server.",
                "",
                cost_table(m.results[name]),
                "",
            ]
    return "\n".join(parts)
