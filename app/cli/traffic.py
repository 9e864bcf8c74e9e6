"""A bounded HTTP load generator for `guard demo` and `guard attack`: legitimate reads of
seeded records mixed with a flood of random keys that exist nowhere."""

from __future__ import annotations

import asyncio
import random
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from rich.table import Table

from guard.middleware import BLOCKED, BYPASSED, PASSED

# The X-Guard answers counted apart (a guard failing closed answers "rejected": other).
DECISIONS = (BLOCKED, PASSED, BYPASSED)


@dataclass
class Tally:
    """What the client saw; the server's own counters come from GET /stats. Every request
    sent is counted once: answered (blocked, passed, bypassed or other) or an error."""

    started: float = field(default_factory=time.monotonic)
    answered: int = 0
    errors: int = 0  # no answer: connection refused or dropped, timed out
    last_error: str = ""
    legit: int = 0
    attack: int = 0
    found: int = 0  # legit reads answered 200
    blocked: int = 0  # X-Guard: blocked
    passed: int = 0  # X-Guard: passed
    bypassed: int = 0  # X-Guard: bypassed (the guard could not be sure: it did not block)
    other: int = 0  # answered without one of those (a 503 of a guard failing closed, ...)
    attack_passed: int = 0  # random keys the filter let through: false positives
    statuses: dict[int, int] = field(default_factory=dict)
    finished: float | None = None

    @property
    def requests(self) -> int:
        """Every request sent: blocked + passed + bypassed + other + errors."""
        return self.answered + self.errors

    @property
    def elapsed(self) -> float:
        end = self.finished if self.finished is not None else time.monotonic()
        return max(1e-9, end - self.started)

    def count(self, decision: str) -> None:
        self.answered += 1
        name = decision if decision in DECISIONS else "other"
        setattr(self, name, getattr(self, name) + 1)

    def fail(self, exc: Exception) -> None:
        self.errors += 1
        self.last_error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__

    def breakdown(self) -> str:
        """``N requests: B blocked, P passed, Y bypassed, E errors`` (other answers too, if
        any): the parts always add up to N."""
        parts = [f"{getattr(self, name):,} {name}" for name in DECISIONS]
        if self.other:
            parts.append(f"{self.other:,} other answers")
        parts.append(f"{self.errors:,} errors")
        if self.errors:
            parts[-1] += f" (last: {self.last_error})"
        return f"{self.requests:,} requests: {', '.join(parts)}"


@dataclass
class Snapshot:
    """Server counters and the records filter's info, as last polled (None: unreachable)."""

    stats: dict[str, Any] | None = None
    filter: dict[str, Any] | None = None


async def poll(client: httpx.AsyncClient, records_filter: str) -> Snapshot:
    snap = Snapshot()
    try:
        r = await client.get("/stats")
        if r.status_code == 200:
            snap.stats = r.json()
        r = await client.get(f"/filters/{records_filter}")
        if r.status_code == 200:
            snap.filter = r.json()
    except httpx.HTTPError:
        pass
    return snap


async def run(
    client: httpx.AsyncClient,
    tally: Tally,
    *,
    duration: float,
    concurrency: int,
    rate: float,
    legit_ratio: float,
    records: int,
    on_tick: Callable[[], Any] | None = None,
    tick: float = 0.25,
) -> None:
    """Send requests for `duration` seconds (0: until cancelled), at most `rate` per second
    (0: as fast as `concurrency` workers go)."""
    deadline = time.monotonic() + duration if duration > 0 else float("inf")
    interval = concurrency / rate if rate > 0 else 0.0
    rng = random.Random()
    tally.started = time.monotonic()

    async def worker(offset: float) -> None:
        next_at = time.monotonic() + offset
        while time.monotonic() < deadline:
            if interval:
                delay = next_at - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                next_at += interval
            legit = records > 0 and rng.random() < legit_ratio
            key = f"user-{rng.randint(1, records)}" if legit else f"ghost-{secrets.token_hex(8)}"
            try:
                r = await client.get(f"/records/{key}")
            except httpx.HTTPError as exc:
                tally.fail(exc)
                await asyncio.sleep(0.05)
                continue
            tally.statuses[r.status_code] = tally.statuses.get(r.status_code, 0) + 1
            decision = r.headers.get("x-guard", "")
            tally.count(decision)
            if legit:
                tally.legit += 1
                tally.found += r.status_code == 200
            else:
                tally.attack += 1
                tally.attack_passed += decision == PASSED

    workers = [asyncio.create_task(worker(i * interval / concurrency)) for i in range(concurrency)]
    try:
        while not all(w.done() for w in workers):
            await asyncio.wait(workers, timeout=tick)
            if on_tick:
                await on_tick() if asyncio.iscoroutinefunction(on_tick) else on_tick()
        for w in workers:
            w.result()  # surface a crashed worker
    finally:
        tally.finished = time.monotonic()
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)


def progress_line(tally: Tally, snap: Snapshot) -> str:
    """One line for a log: this run's own answers, then the server's totals (which count
    every client since the service started), each labelled as such."""
    line = f"this run: {tally.breakdown()}"
    s = snap.stats
    if s is not None:
        line += (
            f"; server totals: {s.get('blocked', 0):,} blocked, {s.get('passed', 0):,} passed, "
            f"{s.get('db_queries', 0):,} database queries"
        )
    return line


def table(tally: Tally, snap: Snapshot, db_latency_ms: float, title: str) -> Table:
    """The live table: requests, blocked, passed, bypassed, database queries and queries
    saved, and the observed false-positive rate next to the filter's own estimate."""
    t = Table(title=title, title_justify="left", min_width=64)
    t.add_column("", style="bold")
    t.add_column("value", justify="right")
    t.add_column("", style="dim")
    s = snap.stats or {}
    rps = tally.requests / tally.elapsed
    t.add_row("this run", "", "what this client sent and saw")
    t.add_row("requests", f"{tally.requests:,}", f"{rps:,.0f}/s")
    t.add_row("  legitimate reads", f"{tally.legit:,}", f"{tally.found:,} found")
    t.add_row("  random keys (attack)", f"{tally.attack:,}", "")
    t.add_row("blocked by the filter", f"{tally.blocked:,}", "404, no DB query")
    t.add_row("passed to the app", f"{tally.passed:,}", "")
    t.add_row("bypassed", f"{tally.bypassed:,}", "guard not sure: not blocked")
    if tally.other:
        t.add_row("other answers", f"{tally.other:,}", "no X-Guard decision")
    t.add_row("errors", f"{tally.errors:,}", tally.last_error[:40] if tally.errors else "no answer")
    observed = tally.attack_passed / tally.attack if tally.attack else 0.0
    t.add_row(
        "false positives (observed)",
        f"{observed:.2e}",
        f"{tally.attack_passed} of {tally.attack:,}",
    )
    if snap.stats is not None:
        # The server counts every client since it started: kept apart from this run's rows.
        t.add_section()
        t.add_row("server totals", "", "all clients, since the service started")
        t.add_row("blocked", f"{s.get('blocked', 0):,}", f"{s.get('passed', 0):,} passed")
        queries = s.get("db_queries", 0)
        hits = s.get("cache_hits", 0)
        t.add_row("database queries", f"{queries:,}", f"{hits:,} cache hits")
        saved = s.get("blocked", 0)
        note = f"{saved * db_latency_ms / 1000:,.1f} s of DB time" if db_latency_ms else ""
        t.add_row("database queries saved", f"{saved:,}", note)
    if snap.filter is not None:
        f = snap.filter
        target = f.get("target_error_rate")
        t.add_section()
        t.add_row(
            "false-positive rate (estimate)",
            f"{f.get('error_rate', 0.0):.2e}",
            f"target {target:g}" if target else "",
        )
        t.add_row(
            "filter load factor", f"{f.get('load_factor', 0.0):.3f}", f"{f.get('items', 0):,} items"
        )
    return t
