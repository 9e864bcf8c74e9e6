"""Prometheus metrics on a per-app registry, the /stats counters, and request timing."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send


@dataclass
class Stats:
    """Plain counters behind GET /stats (this process only)."""

    blocked: int = 0
    passed: int = 0
    bypassed: int = 0
    rejected: int = 0
    cache_hits: int = 0
    negative_cache_hits: int = 0
    false_positives: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class _QueryCollector(Collector):
    """Reads the database's own query counter at scrape time, so the two never disagree."""

    def __init__(self) -> None:
        self.source: Callable[[], int] | None = None

    def collect(self) -> Iterable[Metric]:
        family = CounterMetricFamily("guard_db_queries", "Statements sent to the database")
        family.add_metric([], float(self.source() if self.source else 0))
        yield family


class Metrics:
    """Every metric the service exports; one instance (and registry) per app."""

    def __init__(self) -> None:
        # A registry per app: several apps in one test process must not share counters.
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "guard_http_requests", "HTTP requests", ["route", "method", "status"], registry=r
        )
        self.latency = Histogram(
            "guard_http_request_duration_seconds", "HTTP latency", ["route", "method"], registry=r
        )
        self.decisions = Counter(
            "guard_decisions",
            "Guard decisions: blocked, passed, bypassed (fail open), rejected (fail closed), "
            "false_positive",
            ["decision"],
            registry=r,
        )
        self.cache_hits = Counter("guard_cache_hits", "Record cache hits", ["kind"], registry=r)
        self.redis_errors = Counter(
            "guard_redis_errors", "Redis calls that failed", ["where"], registry=r
        )
        self.filter_failures = Counter(
            "guard_filter_failures",
            "Filter calls that failed; where: guard (the middleware's lookups), api (filter "
            "routes and record writes); reason: unreachable (Redis), damaged (the filter's "
            "data in Redis), error (anything else), stale (not asked: the watchdog found it "
            "behind the table, docs/consistency.md)",
            ["where", "reason"],
            registry=r,
        )
        self.collect_errors = Counter(
            "guard_collect_errors",
            "Filter gauges (/metrics) or infos (/dashboard.json) skipped for an error other "
            "than Redis being unreachable (see the log)",
            ["where"],
            registry=r,
        )
        self.filter_load = Gauge(
            "guard_filter_load_factor", "Filter load factor", ["filter"], registry=r
        )
        self.filter_items = Gauge("guard_filter_items", "Items in a filter", ["filter"], registry=r)
        # A gauge, not a counter: the figure lives in Redis (shared by every process, kept
        # across restarts); it only grows, so rate() and increase() work on it all the same.
        self.filter_missed_deletes = Gauge(
            "guard_filter_missed_deletes",
            "Deletes that found nothing in a filter: each may have removed another item's "
            "fingerprint (a false negative)",
            ["filter"],
            registry=r,
        )
        self.filter_damaged = Gauge(
            "guard_filter_damaged",
            "1 for a filter whose data in Redis failed the header check (drop or rebuild it)",
            ["filter"],
            registry=r,
        )
        self.stale_gauge = Gauge(
            "guard_filter_stale",
            "1 while the watchdog finds the records filter behind the table (the guard then "
            "does not block), by reason (docs/consistency.md)",
            ["filter", "reason"],
            registry=r,
        )
        self.stale_incidents = Counter(
            "guard_filter_stale_incidents",
            "Times the watchdog found the records filter stale, by first reason",
            ["filter", "reason"],
            registry=r,
        )
        self.filter_rollbacks = Counter(
            "guard_filter_rollbacks",
            "Lookups that met a filter older than one this process had read (an older copy came "
            "back: snapshot restore, failover); answered 'maybe present' (docs/consistency.md)",
            ["filter"],
            registry=r,
        )
        self.filter_repairs = Counter(
            "guard_filter_repairs",
            "Repairs of a stale filter; how: catch_up (replay of the change log) or rebuild; "
            "outcome: done or failed",
            ["filter", "how", "outcome"],
            registry=r,
        )
        self.audit_keys = Counter(
            "guard_audit_keys",
            "Existing keys the watchdog's audit looked up; result: found or missed (a miss "
            "is then confirmed against a snapshot of the table)",
            ["filter", "result"],
            registry=r,
        )
        self.audit_rounds = Counter(
            "guard_audit_rounds",
            "Audits of the records filter; result: clean, miss (a confirmed false negative) "
            "or inconclusive",
            ["filter", "result"],
            registry=r,
        )
        # labels() checks and looks up its values on every call (3 µs of each request):
        # the request series are kept here by (route, method, status) instead.
        self._request_series: dict[tuple[str, str, int], tuple[Counter, Histogram]] = {}
        self._decision_series: dict[str, Counter] = {}
        self._stale_reasons: dict[str, str] = {}  # filter -> its series in stale_gauge
        self._queries = _QueryCollector()
        r.register(self._queries)
        self.stats = Stats()

    def bind_queries(self, source: Callable[[], int] | None) -> None:
        self._queries.source = source

    def request(self, route: str, method: str, status: int, seconds: float) -> None:
        """Count and time one HTTP request."""
        series = self._request_series.get((route, method, status))
        if series is None:
            series = (
                self.requests.labels(route, method, str(status)),
                self.latency.labels(route, method),
            )
            self._request_series[route, method, status] = series
        series[0].inc()
        series[1].observe(seconds)

    def decision(self, decision: str) -> None:
        """Count a guard decision (called by the guard middleware and the records store)."""
        counter = self._decision_series.get(decision)
        if counter is None:  # labels() costs more than the count: kept, as for requests
            counter = self._decision_series[decision] = self.decisions.labels(decision)
        counter.inc()
        if decision == "false_positive":
            self.stats.false_positives += 1
        elif hasattr(self.stats, decision):
            setattr(self.stats, decision, getattr(self.stats, decision) + 1)

    def cache_hit(self, negative: bool) -> None:
        self.cache_hits.labels("negative" if negative else "positive").inc()
        if negative:
            self.stats.negative_cache_hits += 1
        else:
            self.stats.cache_hits += 1

    def redis_error(self, where: str) -> None:
        self.redis_errors.labels(where).inc()

    def filter_failure(self, where: str, reason: str) -> None:
        self.filter_failures.labels(where, reason).inc()

    def filter_stale(self, name: str, reason: str | None) -> None:
        """A watchdog's verdict on filter `name`: stale for `reason` (an incident begins), or
        trusted. Only its own series changes: every guarded table has a watchdog."""
        old = self._stale_reasons.pop(name, None)
        if old is not None:
            self.stale_gauge.remove(name, old)
        if reason is not None:
            self._stale_reasons[name] = reason
            self.stale_gauge.labels(name, reason).set(1)
            self.stale_incidents.labels(name, reason).inc()

    def filter_rollback(self, name: str) -> None:
        self.filter_rollbacks.labels(name).inc()

    def filter_repair(self, name: str, how: str, outcome: str) -> None:
        self.filter_repairs.labels(name, how, outcome).inc()

    def audit(self, name: str, keys: int, missed: int, result: str) -> None:
        self.audit_keys.labels(name, "found").inc(keys - missed)
        self.audit_keys.labels(name, "missed").inc(missed)
        self.audit_rounds.labels(name, result).inc()

    def collect_error(self, where: str) -> None:
        self.collect_errors.labels(where).inc()

    def set_filters(self, infos: Sequence[Any], damaged: Sequence[str] = ()) -> None:
        # clear() first so a dropped filter stops being reported.
        self.filter_load.clear()
        self.filter_items.clear()
        self.filter_missed_deletes.clear()
        for info in infos:
            self.filter_load.labels(info.name).set(info.load_factor)
            self.filter_items.labels(info.name).set(info.items)
            self.filter_missed_deletes.labels(info.name).set(info.missed_deletes)
        self.filter_damaged.clear()
        for name in damaged:
            self.filter_damaged.labels(name).set(1)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestMetricsMiddleware:
    """Counts and times every HTTP request by route template (not raw path: bounded labels)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        start = time.perf_counter()

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            seconds = time.perf_counter() - start
            self.metrics.request(self._route(scope), scope["method"], status, seconds)

    def _route(self, scope: Scope) -> str:
        route = scope.get("route")
        if route is not None:
            return str(getattr(route, "path", "other"))
        # Answered before routing: by the guard (blocked, rejected: its rule's path) or the
        # body limit.
        rule = scope.get("guard.rule")
        return "unrouted" if rule is None else str(rule.path)
