"""A filter damaged in Redis (truncated, its tag or header overwritten, a key of another type)
is an error over HTTP, never "absent": a documented 500 with a clear message and no Redis
internals, and the guard treats a damaged records filter like Redis being down."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
import redis

from devkit.service import AUTH
from tests.reliability.conftest import InProcess, StartApp

pytestmark = pytest.mark.realredis


def _truncate(r: redis.Redis, key: str) -> None:
    value = r.get(key)
    assert value is not None
    r.set(key, value[:-3])  # loses the tag (docs/format.md)


def _overwrite_header(r: redis.Redis, key: str) -> None:
    r.setrange(key, 0, b"XXXX")  # the magic


def _overwrite_tag(r: redis.Redis, key: str) -> None:
    r.setrange(key, r.strlen(key) - 7, b"XXXXXX")  # the tag's digest (docs/format.md)


def _wrong_type(r: redis.Redis, key: str) -> None:
    r.delete(key)
    r.hset(key, "field", "value")


DAMAGE: dict[str, Callable[[redis.Redis, str], None]] = {
    "truncated": _truncate,
    "tag": _overwrite_tag,
    "wrong_type": _wrong_type,
}

ROUTES = [
    ("GET", "/filters/f", None),
    ("POST", "/filters/f/check", {"items": ["a"]}),
    ("POST", "/filters/f/add", {"items": ["b"]}),
    ("POST", "/filters/f/delete", {"items": ["a"]}),
    ("GET", "/filters/f/items/a", None),
    ("PUT", "/filters/f/items/z", None),
    ("DELETE", "/filters/f/items/a", None),
]


def assert_damaged(svc: InProcess, status: int, body: str, name: str) -> None:
    assert status == 500, body
    assert body == f'{{"detail":"filter \'{name}\' is damaged in Redis; drop it or rebuild it"}}'
    assert svc.settings.key_prefix not in body  # no key names, no Redis wording


@pytest.mark.parametrize("damage", sorted(DAMAGE))
class TestDamagedFilter:
    """Every filter route on a damaged filter: the documented 500, logged once."""

    async def test_every_route_reports_damage(
        self, start_app: StartApp, damage: str, caplog: pytest.LogCaptureFixture
    ) -> None:
        svc = await start_app()
        c = svc.client
        assert (await c.put("/filters/f", json={"capacity": 100}, headers=AUTH)).status_code == 201
        assert (await c.post("/filters/f/add", json={"items": ["a"]}, headers=AUTH)).json() == {
            "results": [True]
        }
        DAMAGE[damage](svc.redis, svc.key("f"))
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="app.errors"):
            for _ in range(2):
                for method, path, body in ROUTES:
                    r = await c.request(method, path, json=body, headers=AUTH)
                    assert_damaged(svc, r.status_code, r.text, "f")
        # The details (key name, reason) go to the server log, once, not once per request.
        logged = [rec.getMessage() for rec in caplog.records]
        assert len(logged) == 1, logged
        assert "damaged" in logged[0] and "f: " in logged[0]  # name and the library's reason
        # The listing names it, and still shows the other filters.
        listing = (await c.get("/filters")).json()
        assert [f["name"] for f in listing["filters"]] == ["records"]
        assert listing["damaged"] == ["f"]
        # /metrics keeps answering: the damaged filter is flagged, the others keep their gauges.
        metrics = await c.get("/metrics")
        assert metrics.status_code == 200
        assert 'guard_filter_damaged{filter="f"} 1.0' in metrics.text
        assert 'guard_filter_items{filter="records"} 50.0' in metrics.text
        assert 'guard_filter_items{filter="f"}' not in metrics.text
        # The remedy the message names works: drop it, create it again.
        assert (await c.delete("/filters/f?confirm=f", headers=AUTH)).status_code == 204
        assert (await c.put("/filters/f", json={"capacity": 10}, headers=AUTH)).status_code == 201
        assert "guard_filter_damaged{" not in (await c.get("/metrics")).text

    @pytest.mark.parametrize("fail_open", [True, False], ids=["open", "closed"])
    async def test_guard_treats_damaged_records_filter_as_unavailable(
        self, start_app: StartApp, damage: str, fail_open: bool, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Reads fail open (right answers from the database) or closed (503), never blocked."""
        # The watchdog would see the damage too, call the filter stale and rebuild it (tests
        # of app/watchdog.py and the chaos tests cover that); here the guard's own handling
        # of a damaged filter is under test, so it is off.
        svc = await start_app(fail_open=fail_open, redis_cooldown=0, watchdog=False)
        c = svc.client
        assert (await c.get("/records/nobody")).headers["x-guard"] == "blocked"
        DAMAGE[damage](svc.redis, svc.key("records"))
        with caplog.at_level(logging.WARNING, logger="guard.middleware"):
            for _ in range(3):
                present, absent = await c.get("/records/user-1"), await c.get("/records/nobody")
                if fail_open:
                    assert (present.status_code, present.headers["x-guard"]) == (200, "bypassed")
                    assert (absent.status_code, absent.headers["x-guard"]) == (404, "bypassed")
                else:
                    for r in (present, absent):
                        assert (r.status_code, r.headers["x-guard"]) == (503, "rejected")
                        assert "retry-after" in r.headers
        # One incident, logged once; counted as bypassed / rejected decisions.
        assert sum("unavailable" in rec.getMessage() for rec in caplog.records) == 1
        decision = "bypassed" if fail_open else "rejected"
        assert (await c.get("/stats")).json()[decision] == 6
        # Record writes commit (the filter hears of them through the change feed, once it
        # can follow it again), and say so: nothing reads them wrongly meanwhile, the guard
        # does not ask a damaged filter.
        put = await c.put("/records/new-1", json={"value": 1}, headers=AUTH)
        assert put.status_code == 201
        delete = await c.delete("/records/user-2", headers=AUTH)
        assert delete.status_code == 204
        assert (await c.get("/records/new-1")).status_code == (200 if fail_open else 503)
        assert (await c.get("/filters/records")).status_code == 500
        # Counted: every failed lookup of the guard, every damaged answer of the API.
        metrics = (await c.get("/metrics")).text
        assert 'guard_filter_failures_total{reason="damaged",where="guard"} 7.0' in metrics
        assert 'guard_filter_failures_total{reason="damaged",where="api"} 1.0' in metrics
        # A rebuild repairs it, and the guard is back by itself.
        rebuilt = await c.post("/filters/records/rebuild", headers=AUTH)
        assert rebuilt.status_code == 200 and rebuilt.json()["items"] == 50
        assert (await c.get("/records/user-2")).headers["x-guard"] == "blocked"
        assert (await c.get("/records/new-1")).headers["x-guard"] == "passed"
        assert (await c.get("/records/user-1")).headers["x-guard"] == "passed"


async def test_damaged_header_stops_writes_while_lookups_read_the_intact_table(
    start_app: StartApp,
) -> None:
    """Lookups prove their layout by the tag alone (docs/format.md), so a header overwritten
    over an intact table and tag leaves them right; every script checks the header, so no
    write, and no info, goes through until the filter is dropped or rebuilt."""
    svc = await start_app()
    c = svc.client
    assert (await c.put("/filters/f", json={"capacity": 1000}, headers=AUTH)).status_code == 201
    present = [f"p{i}" for i in range(200)]
    assert (
        await c.post("/filters/f/add", json={"items": present}, headers=AUTH)
    ).status_code == 200
    _overwrite_header(svc.redis, svc.key("f"))
    checked = await c.post("/filters/f/check", json={"items": present})
    assert checked.status_code == 200 and all(checked.json()["results"])
    assert (await c.get("/filters/f/items/p7")).json() == {"exists": True}
    lookups = {("POST", "/filters/f/check"), ("GET", "/filters/f/items/a")}
    for method, path, body in ROUTES:
        if (method, path) not in lookups:
            r = await c.request(method, path, json=body, headers=AUTH)
            assert_damaged(svc, r.status_code, r.text, "f")
