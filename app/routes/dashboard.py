"""The dashboard: `GET /` (a static page, no build step) and the JSON it polls."""

from __future__ import annotations

import logging
import time
from collections import deque
from pathlib import Path
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import FileResponse

from app.deps import DbDep, FiltersDep, MetricsDep, RedisDep, SettingsDep
from guard.errors import RedisUnreachable
from guard.listing import read_filters

log = logging.getLogger(__name__)
router = APIRouter(tags=["dashboard"])

# Shipped as package data (pyproject: app = ["static/*"]); a plain directory once installed.
STATIC = Path(__file__).resolve().parent.parent / "static"
ASSETS = {"index.html", "dashboard.js", "dashboard.css"}
HISTORY_SECONDS = 600  # the chart's window
SAMPLE_EVERY = 1.0  # seconds; polls closer together than this share a sample
MAX_FILTERS = 50


class History:
    """Counter samples taken when the page polls (per process; nothing runs in between)."""

    def __init__(self) -> None:
        self.samples: deque[dict[str, float]] = deque()

    def add(self, sample: dict[str, float]) -> None:
        # The newest sample follows the counters until it is SAMPLE_EVERY past the one before.
        if len(self.samples) >= 2 and sample["t"] - self.samples[-2]["t"] < SAMPLE_EVERY:
            self.samples[-1] = sample
        else:
            self.samples.append(sample)
        while self.samples and sample["t"] - self.samples[0]["t"] > HISTORY_SECONDS:
            self.samples.popleft()


def _history(request: Request) -> History:
    history: History | None = getattr(request.app.state, "dashboard_history", None)
    if history is None:
        history = request.app.state.dashboard_history = History()
    return history


def _asset(name: str) -> FileResponse:
    if name not in ASSETS:
        raise HTTPException(404, "Not Found")
    return FileResponse(str(STATIC / name), headers={"Cache-Control": "no-cache"})


@router.get("/", include_in_schema=False)
async def index() -> FileResponse:
    return _asset("index.html")


@router.get("/static/{name}", include_in_schema=False)
async def asset(name: str) -> FileResponse:
    return _asset(name)


@router.get("/dashboard.json")
async def dashboard_data(
    request: Request,
    redis: RedisDep,
    filters: FiltersDep,
    metrics: MetricsDep,
    db: DbDep,
    settings: SettingsDep,
) -> dict[str, Any]:
    """What the dashboard shows: this process's counters, their recent history, every
    filter's items, load factor and memory, and the names of damaged filters (`filters` and
    `damaged` are null while the filters cannot be read, e.g. Redis is unreachable)."""
    stats: dict[str, Any] = {"db_queries": db.queries, **metrics.stats.as_dict()}
    now = time.time()
    history = _history(request)
    history.add({"t": now, **{k: float(v) for k, v in stats.items()}})
    infos: list[dict[str, Any]] | None = None
    damaged: list[str] | None = None
    try:
        report = await read_filters(redis, filters.get, settings.key_prefix, MAX_FILTERS)
        infos, damaged = [i.as_dict() for i in report.infos], report.damaged
    except RedisUnreachable:
        metrics.redis_error("dashboard")
    except Exception as exc:  # the counters are worth showing whatever the filters hold
        metrics.collect_error("dashboard")
        log.warning("dashboard: filters skipped: %r", exc)
    return {
        "time": now,
        "records_filter": settings.records_filter,
        "db_latency_ms": settings.db_latency_ms,
        "stats": stats,
        "filters": infos,
        "damaged": damaged,
        "history": list(history.samples),
    }
