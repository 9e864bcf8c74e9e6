"""Several guarded tables in one service: a records subsystem per table the rules follow (its
filter, change feed, watchdog, rebuilds), on SQLite and on PostgreSQL (tests/app/dbs.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from app.metrics import Metrics
from tests.app.conftest import AUTH, Service, StartService, until
from tests.app.dbs import Other

FORWARD = "/authz/forward"
RULES = """rules:
  - {name: users, path: "/api/users/{id}", filter: users, source: table, table: users,
     key_column: id}
  - {name: orders, path: "/api/orders/{code}", filter: orders, source: table, table: orders,
     key_column: code}
  - {name: user-emails, path: "/api/users/by-email/{email}", filter: users, source: table,
     table: users, key_column: id}
  - {name: sessions, path: "/api/sessions/{id}", filter: sessions, source: api}
"""


@pytest.fixture
def backend() -> str:
    return "redis"


async def decision(svc: Service, uri: str) -> str:
    """What a gateway hears for the request `uri` (Caddy's convention)."""
    r = await svc.client.get(FORWARD, headers={"X-Forwarded-Method": "GET", "X-Forwarded-Uri": uri})
    return str(r.headers["x-guard"])


async def shop(
    start: StartService, db_url: str, other: Other, tmp_path: Path, **kw: Any
) -> Service:
    await other("CREATE TABLE users (id integer PRIMARY KEY, email text)")
    await other("CREATE TABLE orders (code text PRIMARY KEY, total integer)")
    await other("INSERT INTO users VALUES (1, 'a@x'), (2, 'b@x')")
    await other("INSERT INTO orders VALUES ('A-1', 10), ('A-2', 20)")
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    return await start(
        rules=str(rules), database_url=db_url, demo_records=0, records_error_rate=1e-6, **kw
    )


class TestTables:
    async def test_each_table_is_followed_by_its_own_filter(
        self, start: StartService, db_url: str, other: Other, tmp_path: Path
    ) -> None:
        svc = await shop(start, db_url, other, tmp_path)
        tables = svc.state["tables"]
        assert [s.settings.records_table for s in tables] == ["users", "orders"]
        assert [s.filter.name for s in tables] == ["users", "orders"]
        # The first table is the records table (its feed GUARD_FEED_PREFIX); the others' feeds
        # are named after their table, so two feeds never share an object.
        assert [s.settings.feed_prefix for s in tables] == ["guard", "guard_orders"]
        assert [await decision(svc, u) for u in ("/api/users/2", "/api/orders/A-1")] == [
            "passed", "passed",
        ]  # fmt: skip
        assert [await decision(svc, u) for u in ("/api/users/7", "/api/orders/B-7")] == [
            "blocked", "blocked",
        ]  # fmt: skip
        # Rows written behind the service's back, each table's, reach each filter.
        await other("INSERT INTO users VALUES (7, 'c@x')")
        await other("INSERT INTO orders VALUES ('B-7', 70)")
        await other("DELETE FROM orders WHERE code = 'A-1'")

        async def applied() -> bool:
            got = [await decision(svc, u) for u in ("/api/users/7", "/api/orders/B-7")]
            return got == ["passed", "passed"] and await decision(svc, "/api/orders/A-1") == (
                "blocked"
            )

        await until(applied, "each table's follower applied its rows")
        # The users filter does not hold the orders' keys, nor the other way round.
        users, orders = (s.filter for s in tables)
        assert await users.count("B-7") == 0 and await orders.count("7") == 0
        assert (await users.info()).items == 3 and (await orders.info()).items == 2

    async def test_each_table_filter_is_managed_and_rebuilt_on_its_own(
        self, start: StartService, db_url: str, other: Other, tmp_path: Path
    ) -> None:
        svc = await shop(start, db_url, other, tmp_path, watchdog_interval=0.05)
        c = svc.client
        for name in ("users", "orders"):
            r = await c.put(f"/filters/{name}/items/x", headers=AUTH)
            assert r.status_code == 409 and f"follows the {name} table" in r.json()["detail"]
        r = await c.post("/filters/orders/rebuild", headers=AUTH)
        assert r.status_code == 200 and r.json()["items"] == 2
        r = await c.post("/filters/sessions/rebuild", headers=AUTH)
        assert r.status_code in (404, 409)  # an API-fed filter follows no table
        # The orders filter gone: that table's watchdog says so, /health names it, the guard
        # does not block on it until it is rebuilt; the users table is unaffected.
        orders = svc.state["tables"].of_table("orders")
        assert orders.watchdog is not None
        go_on = asyncio.Event()
        real_rebuild = orders.watchdog.rebuild

        async def held_rebuild() -> Any:
            await go_on.wait()
            return await real_rebuild()

        orders.watchdog.rebuild = held_rebuild
        await svc.redis.delete(orders.filter.key(0))

        async def degraded() -> bool:
            return (await c.get("/health")).json() == {
                "status": "degraded", "redis": "ok", "filter": "stale", "reason": "missing",
                "name": "orders",
            }  # fmt: skip

        await until(degraded, "the orders table's watchdog found its filter missing")
        assert await decision(svc, "/api/orders/A-9") == "bypassed"  # not blocked while stale
        assert await decision(svc, "/api/users/9") == "blocked"  # the users filter is trusted
        go_on.set()

        async def repaired() -> bool:
            return (await c.get("/health")).json()["status"] == "ok"

        await until(repaired, "the orders filter rebuilt by its watchdog")
        assert await decision(svc, "/api/orders/A-2") == "passed"
        assert orders.watchdog.opened == 1
        assert svc.state["tables"].of_table("users").watchdog.opened == 0


def test_a_table_trusted_again_leaves_another_tables_stale_gauge() -> None:
    """Every table's watchdog reports to one guard_filter_stale: each changes its own series."""
    metrics = Metrics()
    metrics.filter_stale("orders", "missing")
    metrics.filter_stale("users", "lag")
    metrics.filter_stale("users", None)
    text = metrics.render().decode()
    stale = [line for line in text.splitlines() if line.startswith("guard_filter_stale{")]
    assert stale == ['guard_filter_stale{filter="orders",reason="missing"} 1.0']
