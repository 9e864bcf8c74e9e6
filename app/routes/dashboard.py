"""The dashboard: `GET /` (a static page, no build step) and the JSON it polls."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import FileResponse

from app.db import Database
from app.deps import DbDep, FiltersDep, MetricsDep, RedisDep, SettingsDep
from app.metrics import Metrics
from guard.errors import RedisUnreachable
from guard.listing import read_unsharded_filters

log = logging.getLogger(__name__)
router = APIRouter(tags=["dashboard"])

# Shipped as package data (pyproject: app = ["static/*"]); a plain directory once installed.
STATIC = Path(__file__).resolve().parent.parent / "static"
ASSETS = {"index.html", "dashboard.js", "dashboard.css"}
HISTORY_SECONDS = 300  # the chart's window
SAMPLE_EVERY = 1.0  # seconds between samples
GAP_AFTER = 3.0  # samples further apart than this many intervals: a gap, drawn as one
SERIES = ("blocked", "passed", "db_queries")
MAX_FILTERS = 50


def counters(metrics: Metrics, db: Database) -> dict[str, int]:
    """This process's counters, as the dashboard shows them."""
    return {"db_queries": db.queries, **metrics.stats.as_dict()}


class History:
    """The counters, sampled every ``every`` seconds by `sample` (a task of the service's
    lifespan, so the chart has data before anyone looks); the last ``seconds`` are kept."""

    def __init__(self, seconds: float = HISTORY_SECONDS, every: float = SAMPLE_EVERY) -> None:
        self.seconds = seconds
        self.every = every
        self.samples: deque[dict[str, float]] = deque(maxlen=math.ceil(seconds / every) + 1)

    def add(self, t: float, values: dict[str, int]) -> None:
        self.samples.append({"t": t, **{k: float(values[k]) for k in SERIES}})
        while self.samples and t - self.samples[0]["t"] > self.seconds:
            self.samples.popleft()

    def rates(self) -> list[dict[str, float | None]]:
        """Per-second rates between consecutive samples, at the later one's time. Where the
        sampler did not run (a stalled process) the rates are None: the chart breaks the
        line there instead of drawing a straight one across."""
        out: list[dict[str, float | None]] = []
        for a, b in pairwise(self.samples):
            dt = b["t"] - a["t"]
            gap = not 0 < dt <= GAP_AFTER * self.every
            out.append(
                {"t": b["t"], **{k: None if gap else max(0.0, b[k] - a[k]) / dt for k in SERIES}}
            )
        return out


async def sample(history: History, read: Callable[[], dict[str, int]]) -> None:
    """Add a sample of ``read()`` to ``history`` every ``history.every`` seconds, forever."""
    while True:
        history.add(time.time(), read())
        await asyncio.sleep(history.every)


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
    """What the dashboard shows: this process's counters, their per-second rates over the
    last minutes (null where none were sampled), every filter's items, capacity, load factor
    and memory, and the names of damaged filters (`filters` and `damaged` are null while the
    filters cannot be read, e.g. Redis is unreachable)."""
    stats = counters(metrics, db)
    now = time.time()
    history: History = request.app.state.dashboard_history
    infos: list[dict[str, Any]] | None = None
    damaged: list[str] | None = None
    try:
        report = await read_unsharded_filters(redis, filters.get, settings.key_prefix, MAX_FILTERS)
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
        "window_s": history.seconds,
        "rates": history.rates(),
    }
