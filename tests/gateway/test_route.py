"""The gateway route in-process: each gateway's header convention (Traefik and Envoy are tested
here only: they have no Debian package), hostile headers, Redis down and a stale filter."""

from __future__ import annotations

import sqlite3
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.db import open_database
from app.gateway import GatewayRoute, GuardApp, remove_dot_segments
from app.rules import read_rules
from app.settings import Settings
from devkit.gateways import RULES
from devkit.processes import free_port
from guard.middleware import Guard
from tests.app.conftest import AUTH, Service, StartService

Ask = Callable[..., Awaitable[httpx.Response]]
NGINX, FORWARD = "/authz/nginx", "/authz/forward"


def nginx(uri: str | bytes, method: str = "GET") -> list[tuple[str, str | bytes]]:
    """The headers deploy/nginx/gateway.conf sets on its sub-request."""
    return [("X-Original-URI", uri), ("X-Original-Method", method)]


def forward(uri: str, method: str = "GET", **extra: str) -> dict[str, str]:
    """Caddy's forward_auth headers (Traefik sends the same three, and more)."""
    return {"X-Forwarded-Method": method, "X-Forwarded-Uri": uri,
            "X-Forwarded-Host": "shop.example", **extra}  # fmt: skip


def guard(r: httpx.Response) -> tuple[int, str, str, str]:
    h = r.headers
    return r.status_code, h["x-guard"], h.get("x-guard-rule", ""), h.get("x-guard-key", "")


async def rules_service(start: StartService, tmp_path: Path, **settings: Any) -> Service:
    """The service with deploy/rules.yaml on its SQLite table `users`, and the API-fed
    filters orders, coupons and sessions made, each with one key."""
    db_url = f"sqlite:///{tmp_path / 'shop.db'}"
    db = await open_database(Settings(database_url=db_url, demo_records=0))
    await db.close()
    with sqlite3.connect(tmp_path / "shop.db") as conn:
        conn.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, email TEXT)")
        conn.executemany("INSERT INTO users VALUES (?, ?)", [(i, f"u{i}@x") for i in (1, 2, 3)])
    svc = await start(rules=str(RULES), database_url=db_url, demo_records=0, **settings)
    for name, key in (("orders", "o-1"), ("coupons", "save10"), ("sessions", "s-1")):
        r = await svc.client.put(f"/filters/{name}", json={"capacity": 100}, headers=AUTH)
        assert r.status_code in (201, 503), r.text
        await svc.client.put(f"/filters/{name}/items/{key}", headers=AUTH)
    return svc


@pytest.fixture
async def shop(start: StartService, tmp_path: Path) -> Service:
    return await rules_service(start, tmp_path)


class TestConventions:
    """Each gateway's way of naming the original request, on the same rules."""

    async def test_nginx(self, shop: Service) -> None:
        c = shop.client
        r = await c.get(NGINX, headers=nginx("/api/users/2"))
        assert guard(r) == (200, "passed", "users", "2") and r.content == b""
        # nginx accepts only 2xx/401/403: blocked is 403, its config answers the 404.
        assert guard(await c.get(NGINX, headers=nginx("/api/users/9"))) == (
            403, "blocked", "users", "9",
        )  # fmt: skip
        assert guard(await c.get(NGINX, headers=nginx("/api/orders/o-1", "DELETE"))) == (
            200, "passed", "orders", "o-1",
        )  # fmt: skip
        # No rule for the method or the path: passed, unguarded.
        assert guard(await c.get(NGINX, headers=nginx("/api/users/9", "POST")))[:2] == (
            200, "unguarded",
        )  # fmt: skip
        assert guard(await c.get(NGINX, headers=nginx("/health")))[:2] == (200, "unguarded")

    async def test_caddy_and_traefik_forward_auth(self, shop: Service) -> None:
        c = shop.client
        r = await c.get(FORWARD, headers=forward("/api/coupons?code=%20SAVE10"))
        assert guard(r) == (200, "passed", "coupons", "save10")
        r = await c.get(FORWARD, headers=forward("/api/coupons?code=nope"))
        assert guard(r) == (404, "blocked", "coupons", "nope")
        assert r.json() == {"detail": "Not Found"}  # what the client sees, as the middleware
        # Traefik's forwardAuth: the same three headers, the others it adds ignored, and
        # the original request's headers (the session key here) passed along.
        traefik = forward("/api/session", **{"X-Forwarded-Proto": "https",
                          "X-Forwarded-For": "10.0.0.1", "X-Session-Id": "s-1"})  # fmt: skip
        assert guard(await c.get(FORWARD, headers=traefik)) == (200, "passed", "sessions", "s-1")
        traefik["X-Session-Id"] = "s-2"
        assert guard(await c.get(FORWARD, headers=traefik))[:2] == (404, "blocked")

    async def test_envoy_ext_authz_http(self, shop: Service) -> None:
        """Envoy appends the original path and query to the prefix and keeps the method."""
        c = shop.client
        assert guard(await c.get("/authz/envoy/api/users/1")) == (200, "passed", "users", "1")
        r = await c.delete("/authz/envoy/api/orders/o-2")
        assert guard(r) == (404, "blocked", "orders", "o-2")
        r = await c.get("/authz/envoy/api/coupons?code=SAVE10&x=1")
        assert guard(r) == (200, "passed", "coupons", "save10")
        r = await c.head("/authz/envoy/api/users/9")
        assert guard(r)[:2] == (404, "blocked") and r.content == b""
        # Envoy forwards the original headers: Content-Length of a body it does not send.
        r = await c.post("/authz/envoy/api/users/9", headers={"Content-Length": "0"})
        assert guard(r)[:2] == (200, "unguarded")

    async def test_decisions_counted_with_the_middlewares(self, shop: Service) -> None:
        c = shop.client
        await c.get(NGINX, headers=nginx("/api/users/9"))
        await c.get("/records/9")  # the same rule set guards the service's own route
        await c.get(NGINX, headers=nginx("/api/users/1"))
        stats = (await c.get("/stats")).json()
        assert (stats["blocked"], stats["passed"]) == (2, 1)
        metrics = (await c.get("/metrics")).text
        assert 'guard_http_requests_total{method="GET",route="/authz/nginx",status="403"} 1.0' in (
            metrics
        )


# Every hostile case, its headers and its answer: docs/gateway.md lists the same table.
HOSTILE: list[tuple[str, str, list[tuple[str, str | bytes]], tuple[int, str], str]] = [
    ("missing URI", NGINX, [("X-Original-Method", "GET")], (200, "bypassed"),
     "x-original-uri: missing"),
    ("missing method", NGINX, [("X-Original-URI", "/api/users/9")], (200, "bypassed"),
     "x-original-method: missing"),
    ("no headers at all (forward)", FORWARD, [], (200, "bypassed"),
     "x-forwarded-method: missing"),
    ("two URIs", NGINX, [*nginx("/api/users/9"), ("X-Original-URI", "/api/users/1")],
     (200, "bypassed"), "x-original-uri: 2 values"),
    ("two methods", FORWARD, [("X-Forwarded-Method", "GET"), ("X-Forwarded-Method", "POST"),
                              ("X-Forwarded-Uri", "/api/users/9")],
     (200, "bypassed"), "x-forwarded-method: 2 values"),
    ("raw bytes not UTF-8", NGINX, nginx(b"/api/users/\xff\xfe"), (200, "bypassed"),
     "x-original-uri: not UTF-8 once percent-decoded"),
    ("%FF: not UTF-8", NGINX, nginx("/api/users/%FF"), (200, "bypassed"),
     "x-original-uri: not UTF-8 once percent-decoded"),
    ("not a path", NGINX, nginx("api/users/9"), (200, "bypassed"),
     "x-original-uri: not a path starting with /"),
    ("method not a token", NGINX, nginx("/api/users/9", "G E T"), (200, "bypassed"),
     "x-original-method: not an HTTP method"),
    ("query key twice", NGINX, nginx("/api/coupons?code=a&code=b"), (200, "bypassed"),
     "2 values of query 'code'"),
    ("header key twice", FORWARD, [*forward("/api/session").items(), ("X-Session-Id", "s-9"),
                                   ("X-Session-Id", "s-1")],
     (200, "bypassed"), "2 values of header 'x-session-id'"),
    # Dot segments resolved as the gateway resolves them before routing:
    ("'..' into a guarded path", NGINX, nginx("/api/orders/../users/9"), (403, "blocked"), ""),
    ("'..' out of a guarded path", NGINX, nginx("/api/users/9/.."), (200, "unguarded"), ""),
    ("'..' as the key", NGINX, nginx("/api/users/.."), (200, "unguarded"), ""),
    ("'..' above the root", NGINX, nginx("/../../api/users/9"), (403, "blocked"), ""),
    ("'%2E%2E' is '..'", NGINX, nginx("/api/users/%2E%2E/users/9"), (403, "blocked"), ""),
    # %2F decodes to '/' (nginx's $uri does): /api/users/a/b is no one-segment key.
    ("%2F in the key", NGINX, nginx("/api/users/9%2F1"), (200, "unguarded"), ""),
    ("absolute-form URI", FORWARD, list(forward("http://shop.example/api/users/9").items()),
     (404, "blocked"), ""),
    ("64 KiB URI", NGINX, nginx("/api/users/" + "9" * 65536), (403, "blocked"), ""),
]  # fmt: skip


class TestHostileHeaders:
    """Bad or hostile headers: a documented answer, never a 5xx. What the guard cannot read
    for sure it lets pass (X-Guard: bypassed, X-Guard-Reason): it only ever blocks a key it
    was asked about."""

    @pytest.mark.parametrize(
        ("route", "headers", "answer", "reason"),
        [case[1:] for case in HOSTILE],
        ids=[case[0] for case in HOSTILE],
    )
    async def test_case(
        self,
        shop: Service,
        route: str,
        headers: list[tuple[str, str | bytes]],
        answer: tuple[int, str],
        reason: str,
    ) -> None:
        r = await shop.client.get(route, headers=headers)
        assert (r.status_code, r.headers["x-guard"]) == answer
        assert r.headers.get("x-guard-reason", "") == reason

    async def test_long_keys_are_looked_up_but_not_echoed(self, shop: Service) -> None:
        """nginx reads an answer's headers into 4 KiB: a 64 KiB X-Guard-Key would fail it."""
        r = await shop.client.get(NGINX, headers=nginx("/api/users/" + "9" * 65536))
        assert guard(r) == (403, "blocked", "users", "")
        assert len(r.headers.raw) < 10 and all(len(v) < 100 for _, v in r.headers.raw)

    async def test_a_body_is_never_read(self, shop: Service) -> None:
        """A gateway may forward Content-Length without the body: the answer does not wait."""

        async def never() -> Any:
            raise AssertionError("the route read the body")

        scope = {"type": "http", "method": "POST", "path": "/authz/nginx", "raw_path": b"",
                 "query_string": b"", "state": {},
                 "headers": [(b"content-length", b"10"), (b"x-original-uri", b"/api/users/1"),
                             (b"x-original-method", b"GET")]}  # fmt: skip
        sent: list[Any] = []

        async def send(message: Any) -> None:
            sent.append(message)

        app = GuardApp()
        app.gateway = GatewayRoute(rules=read_rules(RULES), guard=Guard(filter=lambda s: None))
        await app(scope, never, send)
        assert sent[0]["status"] == 200

    def test_dot_segments(self) -> None:
        cases = {"/a/b/../c": "/a/c", "/a/./b": "/a/b", "/..": "/", "/a/b/..": "/a/",
                 "/a/b/.": "/a/b/", "/a.b/c": "/a.b/c", "/...": "/..."}  # fmt: skip
        assert {p: remove_dot_segments(p) for p in cases} == cases


def dead_url() -> str:
    return f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there


@pytest.mark.parametrize("backend", ["redis"])  # a refused socket: a real Redis URL
class TestRedisDown:
    """Redis down: each rule's fail-open decides, exactly as in the middleware."""

    async def test_fail_open_and_closed_rules(self, start: StartService, tmp_path: Path) -> None:
        svc = await rules_service(start, tmp_path, redis_url=dead_url(), retry_after=7)
        c = svc.client
        # users: fail open (the default); orders: fail_open: false.
        assert guard(await c.get(NGINX, headers=nginx("/api/users/9"))) == (
            200, "bypassed", "users", "9",
        )  # fmt: skip
        r = await c.get(NGINX, headers=nginx("/api/orders/o-9"))
        assert guard(r) == (401, "rejected", "orders", "o-9")  # nginx maps 401 to 503
        r = await c.get(FORWARD, headers=forward("/api/orders/o-9"))
        assert guard(r)[:2] == (503, "rejected") and r.headers["retry-after"] == "7"
        r = await c.get("/authz/envoy/api/orders/o-1")
        assert guard(r)[:2] == (503, "rejected") and r.headers["retry-after"] == "7"
        # The middleware in front of the service's own /records route, on the same rules:
        r = await c.get("/records/9")
        assert r.headers["x-guard"] == "bypassed"
        stats = (await c.get("/stats")).json()
        assert (stats["bypassed"], stats["rejected"]) == (2, 3)


class TestStale:
    """While the watchdog finds the table's filter stale, its rules never block; the
    API-fed filters' rules are not concerned."""

    async def test_stale_table_filter_is_not_asked(
        self, start: StartService, tmp_path: Path
    ) -> None:
        svc = await rules_service(start, tmp_path, watchdog_interval=60)
        c = svc.client
        assert guard(await c.get(NGINX, headers=nginx("/api/users/9")))[:2] == (403, "blocked")
        watchdog = svc.state["watchdog"]
        watchdog.incident = object()  # what the watchdog sets when it finds the filter behind
        assert watchdog.stale
        assert guard(await c.get(NGINX, headers=nginx("/api/users/9")))[:2] == (200, "bypassed")
        assert guard(await c.get(NGINX, headers=nginx("/api/orders/o-9")))[:2] == (
            403, "blocked",
        )  # fmt: skip
        watchdog.incident = None
