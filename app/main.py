"""The ASGI app: `create_app(settings)` wires everything; clients are built in the lifespan."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from functools import partial
from importlib.resources import files
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from pydantic import ValidationError

from app import errors
from app.db import DatabaseSetupError, open_database
from app.deps import FilterHandles
from app.gateway import GatewayRoute, GuardApp
from app.idempotency import Idempotency
from app.input import BodyLimitMiddleware, Utf8Middleware
from app.metrics import Metrics, RequestMetricsMiddleware
from app.openapi import document_limits
from app.records import Tables
from app.redis_conn import open_redis
from app.routes import dashboard, filters, health, records
from app.routing import add_routes
from app.rules import ServiceRules, rule_filter, rule_stale, rules_or_problem
from app.settings import Settings, describe, startup_problem, weak_api_key
from app.tasks import cancel
from guard.ages import Rollback
from guard.breaker import RedisBreaker
from guard.middleware import Guard, GuardMiddleware

log = logging.getLogger("app")

__all__ = ["ConfigError", "app", "create_app", "weak_api_key"]

# Swagger UI and ReDoc as the fastapi-offline package ships them: /docs works offline (FastAPI's
# defaults load them from a CDN).
DOCS_ASSETS = "/docs-assets"
DOCS_FILES = files("fastapi_offline") / "static"


async def _open_database(settings: Settings) -> Any:
    """A guarded table's database; a table or column it lacks stops the start-up (one line)."""
    try:
        return await open_database(settings)
    except DatabaseSetupError as exc:
        raise ConfigError(str(exc)) from None


class ConfigError(RuntimeError):
    """GUARD_* settings the service cannot start with (the message is one line)."""


class ConfigErrorGate:
    """Fails the lifespan start-up with the one-line ``problem``, so uvicorn prints that line
    and exits non-zero, instead of the traceback Starlette would send it."""

    def __init__(self, app: Any, problem: str) -> None:
        self.app = app
        self.problem = problem

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return
        await receive()  # lifespan.startup
        await send({"type": "lifespan.startup.failed", "message": self.problem})
        raise ConfigError(self.problem)


class ConfigErrorLine:
    """A ConfigError found while the lifespan starts (a table the database lacks): its one
    line instead of the traceback Starlette reports, as ConfigErrorGate does."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return
        failed: list[dict[str, Any]] = []

        async def hold_failure(message: dict[str, Any]) -> None:
            if message["type"] == "lifespan.startup.failed":
                failed.append(message)  # sent once we know what raised
            else:
                await send(message)

        try:
            await self.app(scope, receive, hold_failure)
        except ConfigError as exc:
            await send({"type": "lifespan.startup.failed", "message": str(exc)})
            raise
        except BaseException:
            for message in failed:
                await send(message)
            raise
        for message in failed:
            await send(message)


def _rollback_met(metrics: Metrics, tables: Tables, rollback: Rollback) -> None:
    """A lookup read a filter older than one this process had read (guard/ages.py): it
    answered "maybe present"; counted, and a table's filter is stale at once (its watchdog
    replays the feed); a filter written only through the API stays untrusted in this process
    (/health degraded) until it is restarted or the filter re-created."""
    metrics.filter_rollback(rollback.filter)
    log.warning(
        "filter %s rolled back: write count %d after %d, applied %d after %d (older copy); "
        "it answers 'maybe present' until repaired (docs/consistency.md, Rollbacks)",
        rollback.filter,
        rollback.writes,
        rollback.highest_writes,
        rollback.applied,
        rollback.highest_applied,
    )
    store = tables.of_filter(rollback.filter)
    if store is not None and store.watchdog is not None:
        store.watchdog.rollback_met(rollback.applied, rollback.highest_applied)


def create_app(settings: Settings | None = None) -> FastAPI:
    """The service: its settings checked, the subsystems composed (the records tables, the
    routes, the guard and the middleware around them); clients open in the lifespan."""
    served, problem = _served(settings)
    cfg = served.settings
    metrics = Metrics()
    # One window for the one Redis: a failed guard lookup spares the cache read after it.
    breaker = RedisBreaker(cfg.redis_cooldown)
    history = dashboard.History()
    app = GuardApp(
        title="cuckoo-guard",
        version="0.1.0",
        summary="Cuckoo filters in Redis, and a guard that stops requests for absent keys",
        lifespan=partial(_lifespan, served, metrics, breaker, history),
        docs_url=None,  # served by _add_docs, from the package
        redoc_url=None,
    )
    app.state.settings = cfg
    app.state.metrics = metrics
    app.state.dashboard_history = history
    errors.install(app, cfg.retry_after)
    add_routes(app, (health.router, filters.router, records.router, dashboard.router))
    _add_docs(app, cfg)
    _add_guard(app, served, metrics, breaker, problem)
    return app


def _served(settings: Settings | None) -> tuple[ServiceRules, str | None]:
    """The settings and route rules the service runs with, and the first problem with them
    (reported when the app starts: importing app.main must never fail)."""
    problem: str | None = None
    if settings is None:
        try:
            settings = Settings()
        except ValidationError as exc:
            problem = describe(exc)
            settings = Settings.model_construct()
    problem = problem or startup_problem(settings)
    # The route rules; a table-backed one puts the records store on its table.
    served, rules_problem = rules_or_problem(settings)
    return served, problem or rules_problem


@asynccontextmanager
async def _lifespan(
    served: ServiceRules,
    metrics: Metrics,
    breaker: RedisBreaker,
    history: dashboard.History,
    app: FastAPI,
) -> AsyncIterator[dict[str, Any]]:
    """The clients and background work of a running service, in the state requests see."""
    cfg = served.settings
    if not logging.getLogger().handlers:  # leave a host's logging setup alone
        logging.basicConfig(level=cfg.log_level, format="%(levelname)s %(name)s: %(message)s")
    async with AsyncExitStack() as stack:
        clients = await stack.enter_async_context(open_redis(cfg))
        redis = clients.main
        # The records subsystems, one per guarded table: filter, caches, follower,
        # watchdog, rebuilds (app/records.py); the first serves /records.
        tables = await stack.enter_async_context(
            Tables.running(served.tables, clients, metrics, breaker, _open_database)
        )
        store = tables.primary
        db = store.db
        metrics.bind_queries(lambda: db.queries)
        sampler = asyncio.create_task(
            dashboard.sample(history, lambda: dashboard.counters(metrics, db))
        )
        stack.push_async_callback(cancel, sampler)
        handles = FilterHandles(
            redis,
            cfg.key_prefix,
            [s.filter for s in tables],
            coalesce=cfg.lookup_coalescing,
            on_rollback=partial(_rollback_met, metrics, tables),
        )
        yield {
            "redis": redis,
            "admin_redis": clients.admin,
            "filters": handles,
            "rule_filters": {rule.name: handles.pin(rule.filter) for rule in served.rules},
            "db": db,
            "records": store,
            "tables": tables,
            "follower": store.follower if cfg.feed else None,
            "watchdog": store.watchdog,
            "idempotency": Idempotency(
                redis, cfg.key_prefix, cfg.idempotency_ttl, cfg.idempotency_wait
            ),
        }
        metrics.bind_queries(None)


def _add_guard(
    app: GuardApp,
    served: ServiceRules,
    metrics: Metrics,
    breaker: RedisBreaker,
    problem: str | None,
) -> None:
    """The guard on the app's own routes and on the gateway route, and the middleware around
    them."""
    cfg = served.settings
    # One decision for the app's own guarded routes and the gateway route.
    guard = Guard(
        filter=rule_filter,
        breaker=breaker,
        on_decision=metrics.decision,
        on_failure=partial(metrics.filter_failure, "guard"),
        stale=rule_stale,
    )
    # Added innermost first: metrics see every answer, then the UTF-8 check, the body limit,
    # then the guard.
    app.add_middleware(
        GuardMiddleware, rules=served.rules, guard=guard, retry_after=cfg.retry_after
    )
    app.add_middleware(BodyLimitMiddleware, max_bytes=cfg.max_body_bytes)
    # Outside the guard and the routes: they only ever see the server's lossy decoding.
    app.add_middleware(Utf8Middleware, routes=app.router.routes)
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics)
    # Every proxied request's hop: answered before anything else runs (app/gateway.py).
    app.gateway = GatewayRoute(
        rules=served.rules, guard=guard, retry_after=cfg.retry_after, on_request=metrics.request
    )
    if problem is not None:
        app.add_middleware(ConfigErrorGate, problem=problem)
    else:
        app.add_middleware(ConfigErrorLine)


def _add_docs(app: FastAPI, settings: Settings) -> None:
    """The OpenAPI schema, stating the limits ``settings`` set; /docs and /redoc with their
    JavaScript, CSS and icon served from DOCS_ASSETS."""

    generate = app.openapi  # made once, then kept

    def openapi() -> dict[str, Any]:
        made = app.openapi_schema is None
        schema = generate()
        return document_limits(schema, settings) if made else schema

    app.openapi = openapi  # type: ignore[method-assign]
    app.mount(DOCS_ASSETS, StaticFiles(directory=str(DOCS_FILES)), name="docs-assets")
    page: dict[str, Any] = {
        "openapi_url": app.openapi_url or "/openapi.json",
        "title": f"{app.title} - API",
    }

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(
            **page,
            swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{DOCS_ASSETS}/favicon.png",
        )

    @app.get("/redoc", include_in_schema=False)
    async def redoc() -> HTMLResponse:
        return get_redoc_html(
            **page,
            redoc_js_url=f"{DOCS_ASSETS}/redoc.standalone.js",
            redoc_favicon_url=f"{DOCS_ASSETS}/favicon.png",
            with_google_fonts=False,
        )


app = create_app()
