"""Faults that leave a filter behind its table, and a prober that reads present rows through
the guard while they happen: shared by tests/reliability/test_feed_chaos.py and bench/repair.py.

Every fault acts on redis-servers of the run's own (never the shared one): restarted from an
older RDB file, failed over to a replica that stopped following, the filter's keys deleted,
replaced by an older copy, zeroed in place, the whole database flushed. Each fault function
returns the monotonic time of the fault itself (the clock the service's watchdog uses).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis

from devkit.processes import free_port
from devkit.redis_server import RedisProcess
from guard.layout import HEADER_BYTES, MAX_SUBFILTERS, TAG_BYTES
from guard.names import base_key

Write = Callable[[], Awaitable[None]]  # writes rows (through the service or not) when called


@dataclass
class InProcess:
    """The service running in this process (its lifespan run), and what the lifespan built:
    state["watchdog"], state["records"], state["db"]..."""

    client: httpx.AsyncClient
    state: dict[str, Any]

    async def put(self, keys: list[str], headers: dict[str, str]) -> None:
        """Rows written through the service (the filter changes in their transaction)."""
        for key in keys:
            r = await self.client.put(f"/records/{key}", json={"value": key}, headers=headers)
            if r.status_code not in (200, 201):
                raise RuntimeError(f"PUT /records/{key}: {r.status_code} {r.text}")


@contextlib.asynccontextmanager
async def in_process(settings: Any) -> AsyncIterator[InProcess]:
    """`app.main.create_app(settings)` through its lifespan, with an HTTP client on it."""
    from asgi_lifespan import LifespanManager  # a dev dependency, as is this module

    from app.main import create_app

    async with (
        LifespanManager(create_app(settings), startup_timeout=60, shutdown_timeout=30) as m,
        httpx.AsyncClient(transport=httpx.ASGITransport(app=m.app), base_url="http://test") as c,
    ):
        # LifespanManager keeps the lifespan's state dict here; the app gets it per request.
        yield InProcess(c, m._state)


@dataclass
class Sample:
    """One read of a present row through the guard."""

    start: float  # monotonic, before the request was sent
    key: str
    status: int
    guard: str  # the X-Guard header

    @property
    def blocked(self) -> bool:
        return self.status == 404 and self.guard == "blocked"


@dataclass
class Prober:
    """Reads present rows through the guard, round robin, with `workers` concurrent clients,
    until stopped; and /health every few milliseconds."""

    client: httpx.AsyncClient
    keys: list[str]
    workers: int = 4
    samples: list[Sample] = field(default_factory=list)
    health: list[tuple[float, int, str]] = field(default_factory=list)  # (start, code, status)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def __aenter__(self) -> Prober:
        self._tasks = [asyncio.create_task(self._read(n)) for n in range(self.workers)]
        self._tasks.append(asyncio.create_task(self._health()))
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)

    def add(self, keys: list[str]) -> None:
        """More present rows (committed now) to read."""
        self.keys.extend(keys)

    async def _read(self, n: int) -> None:
        i = n
        while not self._stop.is_set():
            key = self.keys[i % len(self.keys)]
            i += self.workers
            start = time.monotonic()
            try:
                r = await self.client.get(f"/records/{key}")
                status, guard = r.status_code, r.headers.get("x-guard", "")
            except httpx.HTTPError:
                status, guard = 0, ""
            self.samples.append(Sample(start, key, status, guard))
            await asyncio.sleep(0)

    async def _health(self) -> None:
        while not self._stop.is_set():
            start = time.monotonic()
            try:
                r = await self.client.get("/health")
                self.health.append((start, r.status_code, r.json().get("status", "")))
            except (httpx.HTTPError, ValueError):
                self.health.append((start, 0, ""))
            await asyncio.sleep(0.005)

    def blocked(self, since: float = -math.inf) -> list[Sample]:
        """Present rows answered 404 blocked, read at `since` or later."""
        return [s for s in self.samples if s.blocked and s.start >= since]

    def degraded(self) -> bool:
        """Whether /health ever answered 200 "degraded"."""
        return any(code == 200 and status == "degraded" for _, code, status in self.health)


@dataclass
class Outcome:
    """A fault ridden out: when it happened, the watchdog's incident it opened (None: none
    within the deadline), and every read made meanwhile."""

    fault_at: float
    incident: Any
    prober: Prober

    @property
    def blocked_before_detection(self) -> list[Sample]:
        """Present rows blocked after the fault, before the watchdog noticed: the filter
        was still trusted then (the window each fault's detection time bounds)."""
        end = self.incident.since if self.incident is not None else math.inf
        return [s for s in self.prober.blocked(self.fault_at) if s.start < end]

    @property
    def blocked_while_stale(self) -> list[Sample]:
        """Present rows blocked from the detection on: the guard must never do this."""
        return [] if self.incident is None else self.prober.blocked(self.incident.since)


async def until(condition: Callable[[], bool], what: str, deadline: float = 60.0) -> None:
    """Wait (polling) until `condition()`; RuntimeError naming `what` after `deadline` s."""
    give_up = time.monotonic() + deadline
    while not condition():
        if time.monotonic() > give_up:
            raise RuntimeError(f"gave up waiting: {what}")
        await asyncio.sleep(0.01)


async def ride_out(
    client: httpx.AsyncClient,
    watchdog: Any,
    keys: list[str],
    fault: Callable[[Prober], Awaitable[float]],
    *,
    deadline: float = 60.0,
    after: int = 100,
) -> Outcome:
    """Read `keys` (present rows) through the guard while `fault(prober)` happens (it returns
    the fault's time and adds the rows it wrote to the prober); wait until the service's
    watchdog opened an incident and trusted the filter again, then `after` more reads."""
    await until(lambda: not watchdog.stale, "the filter trusted before the fault", deadline)
    opened = watchdog.opened
    async with Prober(client, list(keys)) as prober:
        await until(lambda: len(prober.samples) > 20, "reads before the fault", deadline)
        fault_at = await fault(prober)
        await until(lambda: watchdog.opened > opened, "the fault detected", deadline)
        await until(lambda: not watchdog.stale, "the filter repaired", deadline)
        reads = len(prober.samples)
        await until(lambda: len(prober.samples) > reads + after, "reads after", deadline)
    incident = next((i for i in watchdog.history if i.since >= fault_at), None)
    return Outcome(fault_at, incident, prober)


def filter_keys(client: redis.Redis, prefix: str, name: str) -> list[str]:
    """The keys of a filter's sub-filters that exist (docs/format.md)."""
    base = base_key(prefix, name)
    names = [base if n == 0 else f"{base}:{n}" for n in range(MAX_SUBFILTERS)]
    return [k for k in names if client.exists(k)]


class Chaos:
    """Faults on a filter stored in a redis-server of the run's own, with a data directory
    that survives restarts (same port, same folder)."""

    def __init__(self, folder: Path, prefix: str, name: str) -> None:
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        self.prefix = prefix
        self.name = name
        self.port = free_port()
        self.server = RedisProcess.start(port=self.port, workdir=str(folder))
        self.back_at: float | None = None  # when a restarted server answered again

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=10)

    def keys(self) -> list[str]:
        with self.client() as c:
            return filter_keys(c, self.prefix, self.name)

    def close(self) -> None:
        self.server.stop()

    async def older_rdb(self, write: Write) -> float:
        """SAVE, `write` more rows, then Redis dies without saving and comes back from the
        older file (as after a crash with RDB snapshots only). The time returned is the
        crash's: the restart is part of what follows."""
        with self.client() as c:
            c.save()
        await write()
        lost = time.monotonic()
        with self.client() as c, contextlib.suppress(redis.ConnectionError):
            c.shutdown(nosave=True)
        await asyncio.to_thread(self.server.stop)
        self.server = await asyncio.to_thread(
            RedisProcess.start, port=self.port, workdir=str(self.folder)
        )
        self.back_at = time.monotonic()
        return lost

    async def key_deleted(self) -> float:
        with self.client() as c:
            c.delete(*filter_keys(c, self.prefix, self.name))
        return time.monotonic()

    async def older_copy(self, write: Write) -> float:
        """DUMP the filter's keys, `write` more rows, RESTORE the copies over them (REPLACE),
        and delete sub-filters the copy did not have."""
        with self.client() as c:
            copies = {k: c.dump(k) for k in filter_keys(c, self.prefix, self.name)}
        await write()
        with self.client() as c:
            pipe = c.pipeline(transaction=True)
            for key in filter_keys(c, self.prefix, self.name):
                if key not in copies:
                    pipe.delete(key)
            for key, data in copies.items():
                pipe.restore(key, 0, data, replace=True)
            pipe.execute()
        return time.monotonic()

    async def zeroed(self) -> float:
        """Every bucket byte set to 0 in place; headers and tags intact (no check fails)."""
        with self.client() as c:
            for key in filter_keys(c, self.prefix, self.name):
                size = int(c.strlen(key))
                c.setrange(key, HEADER_BYTES, bytes(size - HEADER_BYTES - TAG_BYTES))
        return time.monotonic()

    async def flushed(self) -> float:
        """Redis back empty: FLUSHDB on this run's own server."""
        with self.client() as c:
            c.flushdb()
        return time.monotonic()


class TcpProxy:
    """A loopback TCP forwarder whose target can be switched: the address a failover moves
    (a virtual IP, a DNS name, a proxy in front of Redis). Switching drops open connections,
    as a failover does."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> TcpProxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    def switch(self, target: int) -> None:
        self.target = target
        for w in list(self._writers):
            w.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self.switch(self.target)
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_writer}
        try:
            await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer))
        finally:
            self._writers -= {writer, up_writer}

    @staticmethod
    async def _pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            dst.close()


class Failover:
    """A primary and its replica behind a TcpProxy; the service talks to the proxy."""

    def __init__(self, folder: Path, prefix: str, name: str) -> None:
        self.prefix = prefix
        self.name = name
        folder.mkdir(parents=True, exist_ok=True)
        self.primary = RedisProcess.start()
        self.replica = RedisProcess.start("--replicaof", "127.0.0.1", str(self.primary.port))
        self.proxy = TcpProxy(self.primary.port)

    async def start(self) -> Failover:
        await self.proxy.start()
        return self

    @property
    def url(self) -> str:
        return self.proxy.url

    def wait_synced(self, timeout: float = 20.0) -> None:
        """Until the replica holds every write the primary took so far."""
        with redis.Redis(port=self.primary.port) as p:
            if p.execute_command("WAIT", 1, int(timeout * 1000)) != 1:
                raise RuntimeError("the replica did not catch up")

    async def promote_behind(self, write: Write) -> float:
        """The replica stops following (it is behind from here), `write` more rows on the
        primary, then the replica is promoted and the address moves to it."""
        await asyncio.to_thread(self.wait_synced)
        with redis.Redis(port=self.replica.port) as r:
            r.execute_command("REPLICAOF", "NO", "ONE")
        await write()
        self.proxy.switch(self.replica.port)
        moved = time.monotonic()
        await asyncio.to_thread(self.primary.stop)
        return moved

    async def close(self) -> None:
        await self.proxy.close()
        self.replica.stop()
        self.primary.stop()


async def insert_directly(database: str, keys: list[str]) -> None:
    """Rows written by another connection, as the user's application would: the database
    logs them (its triggers), the service is not told."""
    rows = [(k, '"direct"') for k in keys]
    sql = "INSERT INTO records (key, value) VALUES "
    if database.startswith("sqlite:"):
        import sqlite3

        def run() -> None:
            with sqlite3.connect(database.removeprefix("sqlite:///"), timeout=10) as conn:
                conn.executemany(sql + "(?, ?)", rows)

        await asyncio.to_thread(run)
        return
    import asyncpg  # the server extra's driver, only for a PostgreSQL URL

    conn = await asyncpg.connect(database)
    try:
        await conn.executemany(sql + "($1, $2)", rows)
    finally:
        await conn.close()
