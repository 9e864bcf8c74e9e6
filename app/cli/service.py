"""Service commands: serve (the API), demo (the one-command tour), attack (a key flood)."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from rich.live import Live

from app.cli import traffic
from app.cli.common import (
    RedisUrl,
    check_startup,
    cli,
    console,
    describe_redis,
    settings,
    sync_redis,
)
from app.db import redacted_url
from app.redis_conn import start_embedded
from app.settings import Settings

Duration = Annotated[float, typer.Option(min=0, help="Seconds to run (0 = until Ctrl-C).")]


@cli.command()
def serve(
    host: Annotated[str, typer.Option(help="Interface to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="TCP port.")] = 8000,
    workers: Annotated[int, typer.Option(min=1, help="uvicorn worker processes.")] = 1,
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "info",
    redis_url: RedisUrl = None,
) -> None:
    """Run the service (every setting is a GUARD_* environment variable; see docs/service.md)."""
    import uvicorn

    if redis_url is not None:
        os.environ["GUARD_REDIS_URL"] = redis_url  # the app (and each worker) reads it
    # Refuse bad GUARD_* settings here, in one line, before uvicorn starts.
    check_startup(settings())
    uvicorn.run(
        "app.main:app",
        host=host,
        port=port,
        workers=workers,
        log_level=log_level,
        proxy_headers=True,
        forwarded_allow_ips="*" if host != "127.0.0.1" else None,
    )


@cli.command()
def where(redis_url: RedisUrl = None) -> None:
    """Say which Redis and which data directory the commands use (GUARD_DATA_DIR)."""
    cfg = settings(redis_url=redis_url)
    console.print(f"redis: {describe_redis(cfg)}", markup=False, highlight=False)
    console.print(f"data directory: {cfg.data_dir}", markup=False, highlight=False)
    console.print(f"database: {redacted_url(cfg.database_url)}", markup=False, highlight=False)


def _free_port(port: int = 0) -> int:
    """``port`` if nothing listens on it (0: any free port); otherwise a one-line error.

    A taken port must not be used: the demo would measure whatever answers there."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError as exc:
            raise ValueError(
                f"--port {port}: 127.0.0.1:{port} is in use ({exc.strerror}); "
                "pick another port, or 0 for a free one"
            ) from None
        return int(s.getsockname()[1])


class _Server:
    """`guard serve` in a child process (its own core and GIL), stopped by `close()`."""

    def __init__(self, cfg: Settings, port: int) -> None:
        self.env = {**os.environ, **_env_of(cfg)}
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60) -> None:
        cmd = [sys.executable, "-m", "app.cli", "serve", "--port", str(self.port)]
        cmd += ["--log-level", "warning"]
        self.proc = subprocess.Popen(cmd, env=self.env, stdin=subprocess.DEVNULL)
        try:
            wait_healthy(self.proc, self.url, timeout, interval=0.1)
        except RuntimeError:
            self.close()
            raise RuntimeError("the demo service did not start (see its log above)") from None

    def close(self) -> None:
        if self.proc is not None:
            # uvicorn shuts down cleanly: the embedded Redis stops too
            stop_process(self.proc, grace=30)


def wait_healthy(
    proc: subprocess.Popen[bytes],
    url: str,
    timeout: float = 30.0,
    why: Callable[[], str] = lambda: "",
    interval: float = 0.05,
) -> None:
    """Return once ``url``/health answers 200; raise RuntimeError (with ``why()``) if the
    process exits or the deadline passes first."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"service at {url} did not start: {why()}")
        time.sleep(interval)


def stop_process(proc: subprocess.Popen[bytes], grace: float = 10.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited after ``grace`` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _env_of(cfg: Settings) -> dict[str, str]:
    """GUARD_* variables that reproduce ``cfg`` in a child process."""
    out = {}
    for name, value in cfg.model_dump().items():
        if value is None:  # unset stays unset (GUARD_PROTECT_READS: follow GUARD_ENV)
            continue
        if hasattr(value, "get_secret_value"):
            value = value.get_secret_value()
        out[f"GUARD_{name.upper()}"] = str(value).lower() if isinstance(value, bool) else str(value)
    return out


async def _traffic(
    url: str,
    *,
    duration: float,
    concurrency: int,
    rate: float,
    legit_ratio: float,
    records: int,
    records_filter: str,
    db_latency_ms: float,
    title: str,
    live: bool,
) -> tuple[traffic.Tally, traffic.Snapshot]:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=10, limits=limits) as client:
        tally = traffic.Tally()
        snap = await traffic.poll(client, records_filter)
        last = [0.0]

        def render() -> Any:
            return traffic.table(tally, snap, db_latency_ms, title)

        with Live(render(), console=console, auto_refresh=False, transient=False) as view:

            async def tick() -> None:
                nonlocal snap
                now = time.monotonic()
                if now - last[0] < (0.5 if live else 5.0):
                    return
                last[0] = now
                snap = await traffic.poll(client, records_filter)
                if live:
                    view.update(render(), refresh=True)
                else:
                    console.print(traffic.progress_line(tally, snap), markup=False)

            try:
                await traffic.run(
                    client,
                    tally,
                    duration=duration,
                    concurrency=concurrency,
                    rate=rate,
                    legit_ratio=legit_ratio,
                    records=records,
                    on_tick=tick,
                )
            finally:
                snap = await traffic.poll(client, records_filter)
                view.update(render(), refresh=True)
    return tally, snap


@cli.command()
def demo(
    duration: Annotated[float, typer.Option(min=1, help="Seconds of traffic.")] = 20,
    records: Annotated[int, typer.Option(min=1, help="Rows seeded into the database.")] = 10_000,
    concurrency: Annotated[int, typer.Option(min=1, max=512, help="Requests in flight.")] = 8,
    legit_ratio: Annotated[
        float, typer.Option(min=0, max=1, help="Share of reads for real records.")
    ] = 0.2,
    db_latency_ms: Annotated[
        float, typer.Option(min=0, help="Simulated database latency per query.")
    ] = 5.0,
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port (0 = a free one).")] = 0,
    redis_url: RedisUrl = None,
) -> None:
    """The one-command tour: seeded service, real reads plus a flood of random keys.

    Starts the service on the embedded Redis (in a scratch directory) with seeded records,
    reads real records and floods it with keys that exist nowhere, and shows live what the
    filter spared the database. Exits when done.
    """
    port = _free_port(port)
    if redis_url:
        # A Redis that is down fails here in one line, not after the service's start-up wait.
        with sync_redis(settings(redis_url=redis_url)):
            pass
    with tempfile.TemporaryDirectory(prefix="guard-demo-") as tmp:
        embedded = None
        if not redis_url:
            # The embedded redis-server is started (and stopped) here, not by the service
            # process: it is gone when the demo ends, however the service ended.
            embedded = start_embedded(Path(tmp) / "redis.rdb")
        cfg = settings(
            redis_url=redis_url or f"unix://{embedded.socket_file}",  # type: ignore[union-attr]
            database_url=f"sqlite:///{tmp}/records.db",
            demo_records=records,
            db_latency_ms=db_latency_ms,
            key_prefix=f"guard-demo:{os.getpid()}:",
            log_level="WARNING",
        )
        console.print(
            f"[bold]cuckoo-guard demo[/]: seeding {records:,} records "
            f"(user-1 ... user-{records}), database latency {db_latency_ms:g} ms"
        )
        server = _Server(cfg, port)
        try:
            server.start()
            console.print(
                f"service and dashboard at {server.url}/  -  {duration:g} s of traffic: "
                f"{legit_ratio:.0%} real records, {1 - legit_ratio:.0%} random keys"
            )
            tally, snap = asyncio.run(
                _traffic(
                    server.url,
                    duration=duration,
                    concurrency=concurrency,
                    rate=0,
                    legit_ratio=legit_ratio,
                    records=records,
                    records_filter=cfg.records_filter,
                    db_latency_ms=db_latency_ms,
                    title="cuckoo-guard demo",
                    live=console.is_terminal,
                )
            )
        finally:
            server.close()
            if embedded is not None:
                embedded.shutdown(nosave=True)  # type: ignore[call-arg]
            elif redis_url:  # a Redis of the user's: leave nothing behind
                _drop_prefix(redis_url, cfg.key_prefix)
    s = snap.stats or {}
    if tally.requests == 0 or not s:
        raise RuntimeError("the demo sent no request successfully")
    saved = tally.blocked  # this run's; the demo's own service counts nothing else
    console.print(
        f"\n{tally.requests:,} requests in {tally.elapsed:.1f} s; the filter blocked "
        f"{saved:,} reads of keys that do not exist, sparing the database {saved:,} queries "
        f"({s.get('db_queries', 0):,} were sent). Observed false-positive rate "
        f"{tally.attack_passed / max(1, tally.attack):.1e}."
    )


def _drop_prefix(url: str, prefix: str) -> None:
    with sync_redis(settings(redis_url=url)) as client:
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            client.delete(*keys)


@cli.command()
def attack(
    url: Annotated[str, typer.Option(help="Base URL of a running service.")] = (
        "http://127.0.0.1:8000"
    ),
    rate: Annotated[float, typer.Option(min=0, help="Requests per second (0 = flat out).")] = 200,
    duration: Duration = 0,
    concurrency: Annotated[int, typer.Option(min=1, max=512, help="Requests in flight.")] = 8,
    legit_ratio: Annotated[
        float, typer.Option(min=0, max=1, help="Share of reads of user-N records.")
    ] = 0.0,
    records: Annotated[int, typer.Option(min=0, help="N of the user-N records that exist.")] = (
        1000
    ),
    records_filter: Annotated[
        str, typer.Option(envvar="GUARD_RECORDS_FILTER", help="Filter to report on.")
    ] = "records",
    db_latency_ms: Annotated[
        float, typer.Option(envvar="GUARD_DB_LATENCY_MS", help="For the time-saved column.")
    ] = 0.0,
) -> None:
    """Flood a running service with random keys (the compose `attack` profile runs this)."""
    try:
        tally, _ = asyncio.run(
            _traffic(
                url.rstrip("/"),
                duration=duration,
                concurrency=concurrency,
                rate=rate,
                legit_ratio=legit_ratio,
                records=records,
                records_filter=records_filter,
                db_latency_ms=db_latency_ms,
                title=f"attack on {url}",
                live=console.is_terminal,
            )
        )
    except KeyboardInterrupt:
        return
    if tally.requests == 0:
        raise RuntimeError(f"no request to {url} succeeded ({tally.errors} transport errors)")
