"""Operational routes: health, Prometheus metrics, and the guard's counters."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from app.deps import DbDep, FiltersDep, MetricsDep, RedisDep, SettingsDep, TablesDep
from guard.errors import RedisUnreachable
from guard.listing import read_unsharded_filters

log = logging.getLogger(__name__)
router = APIRouter(tags=["operations"])

MAX_FILTER_GAUGES = 200  # a scrape must stay cheap however many filters there are


class Health(BaseModel):
    status: str
    redis: str
    # Only while a watchdog finds a table's filter stale (status "degraded"): "stale", why
    # (docs/consistency.md), and which filter (the first, when several are).
    filter: str | None = None
    reason: str | None = None
    name: str | None = None


class StatsOut(BaseModel):
    db_queries: int
    blocked: int
    passed: int
    bypassed: int
    rejected: int
    cache_hits: int
    negative_cache_hits: int
    false_positives: int


@router.get(
    "/health",
    response_model=Health,
    response_model_exclude_none=True,
    responses={503: {"model": Health, "description": "Redis unreachable"}},
)
async def health(
    redis: RedisDep,
    metrics: MetricsDep,
    settings: SettingsDep,
    tables: TablesDep,
    filters: FiltersDep,
) -> Any:
    """200 when Redis answers a PING, else 503. While a table's filter is stale (behind the
    table: the guard does not block on it until it is repaired) 200 with status "degraded":
    the service answers correctly, only without the filter's savings."""
    try:
        await redis.ping()
    except RedisUnreachable:
        metrics.redis_error("health")
        return JSONResponse(
            {"status": "unavailable", "redis": "unreachable"},
            status_code=503,
            headers={"Retry-After": str(settings.retry_after)},
        )
    for store in tables:
        incident = store.watchdog.incident if store.watchdog is not None else None
        if incident is not None:
            return {"status": "degraded", "redis": "ok", "filter": "stale",
                    "reason": incident.reason, "name": store.filter.name}  # fmt: skip
    # A filter that came back older, read by this process's lookups (guard/ages.py): not
    # blocking until re-created (one written through the API). A table's watchdog speaks
    # for its filter (above): it repairs it, and its verdict ends with the repair.
    watched = {store.filter.name for store in tables if store.watchdog is not None}
    unwatched = [name for name in filters.rolled_back() if name not in watched]
    if unwatched:
        return {"status": "degraded", "redis": "ok", "filter": "stale",
                "reason": "rolled_back", "name": unwatched[0]}  # fmt: skip
    return {"status": "ok", "redis": "ok"}


@router.get(
    "/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}}
)
async def metrics_route(
    redis: RedisDep, filters: FiltersDep, metrics: MetricsDep, settings: SettingsDep
) -> Response:
    """Prometheus text format. Per-filter gauges are read at scrape time; a damaged filter is
    flagged and the others keep theirs. A scrape never fails: when the gauges cannot be read
    (Redis down, anything else) they are skipped and the error counted."""
    try:
        report = await read_unsharded_filters(
            redis, filters.get, settings.key_prefix, MAX_FILTER_GAUGES
        )
        metrics.set_filters(report.infos, report.damaged)
    except RedisUnreachable as exc:
        metrics.redis_error("metrics")
        log.debug("metrics: filter gauges skipped: %r", exc)
    except Exception as exc:  # the request counters must go out whatever the filters hold
        metrics.collect_error("metrics")
        log.warning("metrics: filter gauges skipped: %r", exc)
    return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/stats", response_model=StatsOut)
async def stats(metrics: MetricsDep, db: DbDep) -> Any:
    """Counters of this process: database queries and the guard's decisions."""
    return {"db_queries": db.queries, **metrics.stats.as_dict()}
