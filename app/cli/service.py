"""Service commands: serve (the API), where, demo (the one-command tour), attack (a key flood)."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any
from urllib.parse import urlsplit

import typer

from app.cli.common import (
    Failure,
    RedisUrl,
    check_startup,
    cli,
    console,
    describe_redis,
    quick_settings,
    rich_console,
    say,
    settings,
    show,
    signals_deferred,
    sync_redis,
)

if TYPE_CHECKING:
    from app.cli.traffic import Snapshot, Tally
    from app.settings import Settings

Duration = Annotated[
    float, typer.Option(metavar="SECONDS", min=0, help="Seconds to run (0 = until Ctrl-C).")
]
Concurrency = Annotated[int, typer.Option(metavar="N", min=1, max=512, help="Requests in flight.")]


def check_port(host: str, port: int, hint: str = "") -> int:
    """``port`` if a server could listen on ``host``:``port`` now (0: the free port the OS
    picks); otherwise a one-line error naming --port, before any start-up work. A taken port
    must not be used: the demo would measure whatever answers there."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ValueError(
                    f"--port {port}: {host}:{port} is in use ({exc.strerror}); "
                    f"pick another port{hint}"
                ) from None
            raise ValueError(f"--host {host} --port {port}: {exc.strerror}") from None
        return int(s.getsockname()[1])


class StartupFailure:
    """The app, with what made its lifespan start-up fail kept for `guard serve` to print as
    its one error line (uvicorn logs it, then "Application startup failed. Exiting.")."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.message: str | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return

        async def keep(message: dict[str, Any]) -> None:
            if message["type"] == "lifespan.startup.failed":
                # The app's one-line ConfigError, or a traceback whose last line says what.
                lines = (message.get("message") or "").strip().splitlines()
                self.message = lines[-1] if lines else "the service did not start"
                message = {**message, "message": ""}
            await send(message)

        await self.app(scope, receive, keep)

    def filter(self, record: logging.LogRecord) -> bool:
        """A logging filter for uvicorn: its own error lines about a start-up failure we
        report go."""
        return self.message is None or record.levelno < logging.ERROR


@cli.command()
def serve(
    host: Annotated[str, typer.Option(metavar="HOST", help="Interface to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(metavar="PORT", min=1, max=65535, help="TCP port.")] = 8000,
    workers: Annotated[int, typer.Option(metavar="N", min=1, help="uvicorn workers.")] = 1,
    log_level: Annotated[str, typer.Option(metavar="LEVEL", help="uvicorn log level.")] = "info",
    redis_url: RedisUrl = None,
) -> None:
    """Run the service (every setting is a GUARD_* environment variable; see docs/service.md).

    A taken port, a bad setting or a database the service cannot use is refused in one
    line (exit status 1). SIGTERM, SIGINT and SIGHUP stop it cleanly."""
    import uvicorn

    check_port(host, port)
    cfg = settings(redis_url=redis_url)
    check_startup(cfg)  # bad GUARD_* settings: one line, before uvicorn starts
    options: dict[str, Any] = {
        "host": host,
        "port": port,
        "log_level": log_level,
        "proxy_headers": True,
        "forwarded_allow_ips": "*" if host != "127.0.0.1" else None,
    }
    if workers > 1:  # each worker process makes the app from the GUARD_* variables
        if redis_url is not None:
            os.environ["GUARD_REDIS_URL"] = redis_url
        uvicorn.run("app.main:app", workers=workers, **options)
        return
    from app.main import create_app

    app = StartupFailure(create_app(cfg))
    server = uvicorn.Server(uvicorn.Config(app, **options))
    uvicorn_log = logging.getLogger("uvicorn.error")
    uvicorn_log.addFilter(app.filter)
    try:
        server.run()
    except SystemExit:  # uvicorn's exit status 3 for a failed start-up
        if app.message is None:
            raise
    finally:
        uvicorn_log.removeFilter(app.filter)
    if app.message is not None:
        raise Failure(app.message)


@cli.command()
def where(redis_url: RedisUrl = None) -> None:
    """Say which Redis and which data directory the commands use (GUARD_DATA_DIR)."""
    from app.db import redacted_url

    cfg = settings(redis_url=redis_url)
    say(f"redis: {describe_redis(cfg)}")
    say(f"data directory: {cfg.data_dir}")
    say(f"database: {redacted_url(cfg.database_url)}")


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
        with signals_deferred():
            self.proc = subprocess.Popen(cmd, env=self.env, stdin=subprocess.DEVNULL)
        try:
            wait_healthy(self.proc, self.url, timeout, interval=0.1)
        except RuntimeError:
            self.close()
            raise Failure("the demo service did not start (see its log above)") from None

    def close(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, grace=30)  # SIGTERM: uvicorn shuts down cleanly


def wait_healthy(
    proc: subprocess.Popen[bytes],
    url: str,
    timeout: float = 30.0,
    why: Callable[[], str] = lambda: "",
    interval: float = 0.05,
) -> None:
    """Return once ``url``/health answers 200; raise RuntimeError (with ``why()``) if the
    process exits or the deadline passes first."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise Failure(f"service at {url} did not start: {why()}")
        time.sleep(interval)


def wait_trusted(url: str, timeout: float = 10.0) -> None:
    """Wait (up to ``timeout``) until the service trusts its records filter (/health "ok",
    not "degraded"): until then the guard lets every read through ("bypassed")."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if httpx.get(f"{url}/health", timeout=1).json().get("status") == "ok":
            return
        time.sleep(0.1)


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
) -> tuple[Tally, Snapshot, Snapshot]:
    """Run the load; show a live table on a terminal, a line every 5 s elsewhere, and the
    final table. Returns this run's tally and the server's counters before and after."""
    import httpx
    from rich.live import Live

    from app.cli import traffic

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=10, limits=limits) as client:
        tally = traffic.Tally()
        first = snap = await traffic.poll(client, records_filter)
        last = [0.0]

        def render() -> Any:
            return traffic.table(tally, snap, db_latency_ms, title)

        view = Live(render(), console=rich_console(), auto_refresh=False) if live else None
        with view or nullcontext():

            async def tick() -> None:
                nonlocal snap
                now = time.monotonic()
                if now - last[0] < (0.5 if live else 5.0):
                    return
                last[0] = now
                snap = await traffic.poll(client, records_filter)
                if view is not None:
                    view.update(render(), refresh=True)
                else:
                    say(traffic.progress_line(tally, snap))

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
                if view is not None:
                    view.update(render(), refresh=True)
                else:
                    show(render())
    return tally, first, snap


@cli.command()
def demo(
    duration: Annotated[
        float, typer.Option(metavar="SECONDS", min=1, help="Seconds of traffic.")
    ] = 20,
    records: Annotated[
        int, typer.Option(metavar="N", min=1, help="Rows seeded into the database.")
    ] = 10_000,
    concurrency: Concurrency = 8,
    legit_ratio: Annotated[
        float, typer.Option(metavar="SHARE", min=0, max=1, help="Share of reads of real records.")
    ] = 0.2,
    db_latency_ms: Annotated[
        float, typer.Option(metavar="MS", min=0, help="Simulated database latency per query.")
    ] = 5.0,
    port: Annotated[
        int, typer.Option(metavar="PORT", min=0, max=65535, help="Port (0 = a free one).")
    ] = 0,
    redis_url: RedisUrl = None,
) -> None:
    """The one-command tour: seeded service, real reads plus a flood of random keys.

    Starts the service on the embedded Redis (in a scratch directory) with seeded records,
    reads real records and floods it with keys that exist nowhere, and shows live what the
    filter spared the database. Exits when done, leaving nothing behind.
    """
    from app.redis_conn import start_embedded, stop_embedded

    port = check_port("127.0.0.1", port, ", or 0 for a free one")
    if redis_url:
        # A Redis that is down fails here in one line, not after the service's start-up wait.
        with sync_redis(quick_settings(redis_url=redis_url)):
            pass
    prefix = f"guard-demo:{os.getpid()}:"
    with tempfile.TemporaryDirectory(prefix="guard-demo-") as tmp:
        embedded = None
        try:
            if not redis_url:
                # Started (and stopped) here, not by the service process: it is gone when the
                # demo ends, however the service ended.
                with signals_deferred():
                    embedded = start_embedded(Path(tmp) / "redis.rdb")
            cfg = settings(
                redis_url=redis_url or f"unix://{embedded.socket_file}",  # type: ignore[union-attr]
                database_url=f"sqlite:///{tmp}/records.db",
                demo_records=records,
                db_latency_ms=db_latency_ms,
                key_prefix=prefix,
                log_level="WARNING",
            )
            say(
                f"cuckoo-guard demo: seeding {records:,} records (user-1 ... user-{records}), "
                f"database latency {db_latency_ms:g} ms"
            )
            server = _Server(cfg, port)
            try:
                server.start()
                wait_trusted(server.url)
                say(
                    f"service and dashboard at {server.url}/  -  {duration:g} s of traffic: "
                    f"{legit_ratio:.0%} real records, {1 - legit_ratio:.0%} random keys"
                )
                tally, before, after = asyncio.run(
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
        finally:
            if embedded is not None:
                stop_embedded(embedded, save=False)
            elif redis_url:  # a Redis of the user's: leave nothing behind
                _drop_prefix(redis_url, prefix)
    say(_summary(tally, before, after))


def _summary(tally: Tally, before: Snapshot, after: Snapshot) -> str:
    """The demo's last line: every request accounted for (this client's count), then what
    the database saw, all from the service's counters over the run (the server's
    false-positive count is the one that knows a passed key was absent)."""
    if tally.answered == 0 or before.stats is None or after.stats is None:
        raise Failure(f"the demo sent no request successfully ({tally.breakdown()})")
    run = {k: after.stats.get(k, 0) - before.stats.get(k, 0) for k in after.stats}
    blocked, fp, queries = run["blocked"], run["false_positives"], run["db_queries"]
    judged = blocked + fp  # keys that exist nowhere the filter answered for
    estimate = (after.filter or {}).get("error_rate")
    return (
        f"\n{tally.breakdown()}, in {tally.elapsed:.1f} s. "
        f"the filter blocked {blocked:,} reads of keys that do not exist, sparing the database "
        f"{blocked:,} queries; it answered {queries:,} during the run, {fp:,} of them for "
        f"false positives: an observed false-positive rate of {fp / max(1, judged):.1e} "
        f"({fp:,} of {judged:,} absent keys)"
        + (f", against the filter's estimate of {estimate:.1e}." if estimate else ".")
    )


def _drop_prefix(url: str, prefix: str) -> None:
    with sync_redis(quick_settings(redis_url=url)) as client:
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            client.delete(*keys)


def _base_url(value: str) -> str:
    """--url as given, if it is an http(s) URL: without a scheme, every request would fail
    for the whole run."""
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise typer.BadParameter(
            f"{value!r} is not an http:// or https:// URL (e.g. http://127.0.0.1:8000)"
        )
    return value.rstrip("/")


def _reachable(url: str) -> None:
    """A one-line error at once if nothing answers at ``url`` (any HTTP answer will do)."""
    import httpx

    try:
        httpx.get(f"{url}/health", timeout=5)
    except httpx.TransportError as exc:
        raise ValueError(f"--url {url}: no answer ({type(exc).__name__}: {exc})") from None


@cli.command()
def attack(
    url: Annotated[
        str, typer.Option(metavar="URL", callback=_base_url, help="Base URL of a running service.")
    ] = "http://127.0.0.1:8000",
    rate: Annotated[
        float, typer.Option(metavar="N", min=0, help="Requests per second (0 = flat out).")
    ] = 200,
    duration: Duration = 0,
    concurrency: Concurrency = 8,
    legit_ratio: Annotated[
        float, typer.Option(metavar="SHARE", min=0, max=1, help="Share of reads of user-N records.")
    ] = 0.0,
    records: Annotated[
        int, typer.Option(metavar="N", min=0, help="N of the user-N records that exist.")
    ] = 1000,
    records_filter: Annotated[
        str,
        typer.Option(metavar="NAME", envvar="GUARD_RECORDS_FILTER", help="Filter to report on."),
    ] = "records",
    db_latency_ms: Annotated[
        float,
        typer.Option(metavar="MS", envvar="GUARD_DB_LATENCY_MS", help="For the time-saved column."),
    ] = 0.0,
) -> None:
    """Flood a running service with random keys (the compose `attack` profile runs this).

    Off a terminal it logs a line every 5 s: this run's requests (blocked, passed,
    bypassed, errors) and the server's totals."""
    _reachable(url)
    try:
        tally, _, _ = asyncio.run(
            _traffic(
                url,
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
    if tally.answered == 0:
        raise Failure(f"no request to {url} was answered ({tally.breakdown()})")
