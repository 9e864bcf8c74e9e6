"""The ASGI app: `create_app(settings)` wires everything; clients are built in the lifespan."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager, suppress
from functools import partial
from typing import Any

from fastapi import FastAPI
from pydantic import ValidationError

from app import errors
from app.db import open_database
from app.deps import FilterHandles
from app.errors import BodyLimitMiddleware, Utf8Middleware
from app.idempotency import Idempotency
from app.metrics import Metrics, RequestMetricsMiddleware
from app.records import RebuildInProgress, RecordStore
from app.redis_conn import open_redis
from app.routes import dashboard, filters, health, records
from app.routing import add_routes
from app.settings import Settings
from guard.breaker import RedisBreaker
from guard.errors import RedisUnreachable
from guard.middleware import GuardMiddleware

log = logging.getLogger("app")

REBUILD_RETRY_S = 5.0

MIN_API_KEY_CHARS = 16
# Keys that show up in examples and .env templates; compared without case and punctuation.
PLACEHOLDER_KEYS = frozenset(
    {"changeme", "changeit", "secret", "default", "test", "testkey", "password", "apikey",
     "yourapikey", "guardapikey", "example", "admin", "key", "token", "xxx"}
)  # fmt: skip


def weak_api_key(key: str) -> str | None:
    """Why `key` is unfit for production (never quoting it), or None when it is fine."""
    if not key:
        return "it is empty"
    folded = "".join(ch for ch in key.lower() if ch.isalnum())
    if folded in PLACEHOLDER_KEYS or "changeme" in folded:
        return "it is a placeholder"
    if len(set(key)) < 4:
        return "it repeats too few characters"
    if len(key) < MIN_API_KEY_CHARS:
        return f"it is shorter than {MIN_API_KEY_CHARS} characters"
    return None


def _records_filter(scope: Any) -> Any:
    """The records filter handle, from the lifespan state (None before start-up)."""
    store = scope.get("state", {}).get("records")
    return None if store is None else store.filter


async def _rebuild_once(store: RecordStore) -> bool:
    """One start-up rebuild attempt; False when Redis is unreachable."""
    try:
        await store.rebuild()
    except RebuildInProgress:
        log.info("records filter: another process is rebuilding it")
    except RedisUnreachable as exc:
        log.warning(
            "records filter rebuild failed (%r); retrying every %.0f s", exc, REBUILD_RETRY_S
        )
        return False
    return True


async def _rebuild_until_done(store: RecordStore) -> None:
    """Keep trying in the background while Redis is down (the guard fails open meanwhile,
    so the service stays usable; readers never see the half-built filter)."""
    while True:
        await asyncio.sleep(REBUILD_RETRY_S)
        try:
            await store.rebuild()
            log.info("records filter rebuilt after Redis came back")
            return
        except RebuildInProgress:
            return
        except RedisUnreachable:
            continue


def create_app(settings: Settings | None = None) -> FastAPI:
    settings_error: ValidationError | None = None
    if settings is None:
        try:
            settings = Settings()
        except ValidationError as exc:
            # Importing app.main must never fail: report bad settings when the app starts.
            settings_error = exc
            settings = Settings.model_construct()
    cfg = settings
    metrics = Metrics()
    # One window for the one Redis: a failed guard lookup spares the cache read after it.
    breaker = RedisBreaker(cfg.redis_cooldown)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        if not logging.getLogger().handlers:  # leave a host's logging setup alone
            logging.basicConfig(level=cfg.log_level, format="%(levelname)s %(name)s: %(message)s")
        if settings_error is not None:
            raise RuntimeError(f"invalid GUARD_* settings: {settings_error}")
        if cfg.env == "production":
            weak = weak_api_key(cfg.api_key.get_secret_value())
            if weak:
                raise RuntimeError(f"GUARD_ENV=production needs a real GUARD_API_KEY: {weak}")
        async with AsyncExitStack() as stack:
            clients = await stack.enter_async_context(open_redis(cfg))
            redis = clients.main
            db = await open_database(cfg.database_url, cfg.db_latency_ms)
            stack.push_async_callback(db.close)
            seeded = await db.seed(cfg.demo_records)
            if seeded:
                log.info("seeded %d demo records", seeded)
            metrics.bind_queries(lambda: db.queries)
            store = RecordStore(redis, db, cfg, metrics, breaker, clients.admin)
            if cfg.rebuild_on_startup and not await _rebuild_once(store):
                task = asyncio.create_task(_rebuild_until_done(store))
                stack.push_async_callback(_cancel, task)
            yield {
                "redis": redis,
                "admin_redis": clients.admin,
                "filters": FilterHandles(
                    redis, cfg.key_prefix, [store.filter], coalesce=cfg.lookup_coalescing
                ),
                "db": db,
                "records": store,
                "idempotency": Idempotency(
                    redis, cfg.key_prefix, cfg.idempotency_ttl, cfg.idempotency_wait
                ),
            }
            metrics.bind_queries(None)

    app = FastAPI(
        title="cuckoo-guard",
        version="0.1.0",
        summary="Cuckoo filters in Redis, and a guard that stops requests for absent keys",
        lifespan=lifespan,
    )
    app.state.settings = cfg
    app.state.metrics = metrics
    errors.install(app, cfg.retry_after)
    add_routes(app, (health.router, filters.router, records.router, dashboard.router))
    # Added innermost first: metrics see every answer, then the UTF-8 check, the body limit,
    # then the guard.
    app.add_middleware(
        GuardMiddleware,
        filter=_records_filter,
        paths=[r"/records/(?P<key>[^/]+)"],
        fail_open=cfg.fail_open,
        breaker=breaker,
        retry_after=cfg.retry_after,
        on_decision=metrics.decision,
        on_failure=partial(metrics.filter_failure, "guard"),
    )
    app.add_middleware(BodyLimitMiddleware, max_bytes=cfg.max_body_bytes)
    # Outside the guard and the routes: they only ever see the server's lossy decoding.
    app.add_middleware(Utf8Middleware, routes=app.router.routes)
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics, guarded_route="/records/{key}")
    return app


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    with suppress(asyncio.CancelledError, Exception):
        await task


app = create_app()
