"""Redis unreachable: fail open or closed as configured, 503 + Retry-After, never a 500;
and the service picks Redis up again by itself."""

from __future__ import annotations

import logging

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, ReadOnlyError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from app.errors import error_response
from devkit.processes import free_port
from devkit.redis_server import RedisProcess
from guard import (
    FilterCorruptError,
    FilterExistsError,
    FilterFullError,
    FilterNotFoundError,
    InvalidParameterError,
)
from guard.connect import connect
from tests.app.conftest import AUTH, StartService

# A Redis that is down is a real socket that refuses: these run on the "redis" backend only.
real_socket = pytest.mark.parametrize("backend", ["redis"])


def dead_url() -> str:
    return f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there


FILTER_ROUTES = [
    ("GET", "/filters", None),
    ("PUT", "/filters/u", {"capacity": 10}),
    ("GET", "/filters/u", None),
    ("DELETE", "/filters/u?confirm=u", None),
    ("POST", "/filters/u/add", {"items": ["a"]}),
    ("POST", "/filters/u/check", {"items": ["a"]}),
    ("POST", "/filters/u/delete", {"items": ["a"]}),
    ("POST", "/filters/records/rebuild", None),
    ("PUT", "/filters/u/items/a", None),
    ("GET", "/filters/u/items/a", None),
    ("DELETE", "/filters/u/items/a", None),
]


@real_socket
class TestRedisDown:
    """A dead port instead of Redis."""

    async def test_starts_and_fails_open(
        self, start: StartService, caplog: pytest.LogCaptureFixture
    ) -> None:
        caplog.set_level(logging.WARNING, logger="guard.middleware")
        svc = await start(redis_url=dead_url())
        before = svc.db.queries
        r = await svc.client.get("/records/user-1")
        assert r.status_code == 200 and r.headers["x-guard"] == "bypassed"
        assert r.json()["value"] == "value-1"
        r = await svc.client.get("/records/absent")
        assert r.status_code == 404 and r.headers["x-guard"] == "bypassed"
        for _ in range(10):
            await svc.client.get("/records/user-2")
        assert svc.db.queries == before + 12  # every read went to the database
        stats = (await svc.client.get("/stats")).json()
        assert stats["bypassed"] == 12 and stats["blocked"] == 0
        incidents = [r for r in caplog.records if "unavailable" in r.getMessage()]
        assert len(incidents) == 1  # logged once per incident, not per request

    async def test_fail_closed_is_503(self, start: StartService) -> None:
        svc = await start(redis_url=dead_url(), fail_open=False, retry_after=7)
        before = svc.db.queries
        for key in ("user-1", "absent"):
            r = await svc.client.get(f"/records/{key}")
            assert r.status_code == 503 and r.headers["retry-after"] == "7"
            assert r.headers["x-guard"] == "rejected"
        assert svc.db.queries == before

    async def test_filter_routes_are_503_with_retry_after(self, start: StartService) -> None:
        svc = await start(redis_url=dead_url())
        for method, path, body in FILTER_ROUTES:
            r = await svc.client.request(method, path, json=body, headers=AUTH)
            assert r.status_code == 503, (method, path, r.text)
            assert r.headers["retry-after"] == "1"
            assert r.json() == {"detail": "Redis unavailable"}

    async def test_idempotent_add_is_503(self, start: StartService) -> None:
        svc = await start(redis_url=dead_url())
        headers = {**AUTH, "Idempotency-Key": "x"}
        r = await svc.client.post("/filters/u/add", json={"items": ["a"]}, headers=headers)
        assert r.status_code == 503

    async def test_record_writes_are_503_and_change_nothing(self, start: StartService) -> None:
        svc = await start(redis_url=dead_url())
        r = await svc.client.put("/records/new", json={"value": 1}, headers=AUTH)
        assert r.status_code == 503 and "retry-after" in r.headers
        r = await svc.client.delete("/records/user-1", headers=AUTH)
        assert r.status_code == 503
        assert await svc.db.get("new") is None and await svc.db.get("user-1") is not None

    async def test_health_metrics_stats(self, start: StartService) -> None:
        svc = await start(redis_url=dead_url())
        r = await svc.client.get("/health")
        assert r.status_code == 503 and r.json() == {
            "status": "unavailable",
            "redis": "unreachable",
        }
        assert (await svc.client.get("/stats")).status_code == 200
        r = await svc.client.get("/metrics")
        assert r.status_code == 200 and 'guard_redis_errors_total{where="health"}' in r.text


@real_socket
class TestReconnect:
    """Redis goes away and comes back; nobody restarts the service."""

    async def test_recovers_by_itself(
        self, start: StartService, caplog: pytest.LogCaptureFixture
    ) -> None:
        caplog.set_level(logging.WARNING, logger="guard.middleware")
        port = free_port()
        server = RedisProcess.start(port=port)
        try:
            svc = await start(redis_url=f"redis://127.0.0.1:{port}/0", redis_cooldown=0)
            assert (await svc.client.get("/records/absent")).headers["x-guard"] == "blocked"
            server.stop()
            r = await svc.client.get("/records/user-1")
            assert r.status_code == 200 and r.headers["x-guard"] == "bypassed"
            assert (await svc.client.get("/health")).status_code == 503
            server = RedisProcess.start(port=port)  # back, but empty: no filter any more
            assert (await svc.client.get("/health")).status_code == 200
            r = await svc.client.get("/records/user-1")
            assert r.status_code == 200 and r.headers["x-guard"] == "bypassed"  # missing filter
            assert (
                await svc.client.post("/filters/records/rebuild", headers=AUTH)
            ).status_code == 200
            assert (await svc.client.get("/records/absent")).headers["x-guard"] == "blocked"
            assert (await svc.client.get("/records/user-1")).headers["x-guard"] == "passed"
            messages = [r.getMessage() for r in caplog.records]
            assert sum("unavailable" in m for m in messages) == 1
            assert sum("reachable again" in m for m in messages) == 1
        finally:
            server.stop()


@real_socket
class TestOutOfMemory:
    """Redis at its maxmemory (noeviction) refuses writes: 507, not a 500."""

    async def test_writes_are_507(self, start: StartService) -> None:
        server = RedisProcess.start("--maxmemory-policy", "noeviction")
        try:
            svc = await start(redis_url=server.url)
            admin = connect(server.url)  # the test's own, to lower the limit
            admin.config_set("maxmemory", 1)  # below what an empty server already uses
            admin.close()
            r = await svc.client.put("/filters/u", json={"capacity": 10}, headers=AUTH)
            assert r.status_code == 507
            assert r.json() == {"detail": "Redis is out of memory (maxmemory)"}
        finally:
            server.stop()


class TestErrorMapping:
    """app.errors.error_response: the one table of error → status."""

    @pytest.mark.parametrize(
        ("exc", "status"),
        [
            (RedisConnectionError("refused"), 503),
            (RedisTimeoutError("slow"), 503),
            (ReadOnlyError("READONLY You can't write against a read only replica."), 503),
            (OutOfMemoryError("command not allowed when used memory > 'maxmemory'."), 507),
            (FilterNotFoundError("x"), 404),
            (FilterExistsError("x"), 409),
            (FilterFullError("x", [True, False]), 507),
            (InvalidParameterError("capacity must be ..."), 422),
            (FilterCorruptError("x"), 500),
        ],
    )
    def test_status(self, exc: Exception, status: int) -> None:
        response = error_response(exc, retry_after=4)
        assert response is not None and response.status_code == status
        if status == 503:
            assert response.headers["retry-after"] == "4"

    def test_unknown_errors_are_not_mapped(self) -> None:
        assert error_response(ResponseError("ERR unknown command")) is None
        assert error_response(KeyError("bug")) is None
