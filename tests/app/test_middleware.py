"""GuardMiddleware on its own, around a plain ASGI app (no FastAPI)."""

from __future__ import annotations

import logging
import re
from typing import Any

import httpx
import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from guard import CuckooFilter, FilterCorruptError, FilterNotFoundError
from guard.breaker import RedisBreaker
from guard.middleware import GuardMiddleware


class Downstream:
    """A bare ASGI app standing for the database: counts the calls that reach it."""

    def __init__(self) -> None:
        self.calls = 0
        self.decisions: list[Any] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.calls += 1
        self.decisions.append(scope.get("guard.decision"))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"from the database"})


class FakeFilter:
    def __init__(self, present: set[str], error: Exception | None = None) -> None:
        self.present = present
        self.error = error
        self.lookups = 0

    async def lookup(self, item: str) -> bool:
        self.lookups += 1
        if self.error is not None:
            raise self.error
        return item in self.present


def client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


class TestDecisions:
    """Blocked, passed, and what is left alone."""

    async def test_absent_key_never_reaches_the_app(self) -> None:
        down = Downstream()
        app = GuardMiddleware(down, filter=FakeFilter({"a"}), paths=[r"/items/(?P<key>[^/]+)"])
        async with client(app) as c:
            r = await c.get("/items/b")
            assert r.status_code == 404 and r.json() == {"detail": "Not Found"}
            assert r.headers["x-guard"] == "blocked"
            r = await c.get("/items/a")
            assert r.status_code == 200 and r.headers["x-guard"] == "passed"
        assert down.calls == 1 and down.decisions == ["passed"]

    async def test_other_methods_and_paths_are_not_guarded(self) -> None:
        down = Downstream()
        cf = FakeFilter(set())
        app = GuardMiddleware(down, filter=cf, paths=[r"/items/(?P<key>[^/]+)"])
        async with client(app) as c:
            assert (await c.post("/items/x")).status_code == 200
            assert (await c.get("/other/x")).status_code == 200
            assert (await c.get("/items/x/deeper")).status_code == 200  # full match only
        assert cf.lookups == 0 and down.calls == 3

    async def test_custom_key_extractor_and_several_patterns(self) -> None:
        down = Downstream()

        def key(scope: Any, match: re.Match[str]) -> str:
            return f"{match.group('kind')}:{match.group('id')}"

        app = GuardMiddleware(
            down,
            filter=FakeFilter({"user:1"}),
            paths=[re.compile(r"/(?P<kind>user)s/(?P<id>\d+)"), r"/(?P<kind>team)s/(?P<id>\d+)"],
            key=key,
        )
        async with client(app) as c:
            assert (await c.get("/users/1")).status_code == 200
            assert (await c.get("/users/2")).status_code == 404
            assert (await c.get("/teams/1")).status_code == 404
        assert down.calls == 1

    async def test_filter_from_scope_callable(self) -> None:
        down = Downstream()
        app = GuardMiddleware(
            down, filter=lambda scope: None, paths=[r"/items/(?P<key>[^/]+)"]
        )  # nothing set up yet: let everything through
        async with client(app) as c:
            assert (await c.get("/items/x")).headers["x-guard"] == "bypassed"

    async def test_missing_filter_bypasses_even_when_failing_closed(self) -> None:
        down = Downstream()
        cf = FakeFilter(set(), FilterNotFoundError("gone"))
        app = GuardMiddleware(down, filter=cf, paths=[r"/i/(\w+)"], fail_open=False)
        async with client(app) as c:
            assert (await c.get("/i/x")).headers["x-guard"] == "bypassed"

    async def test_decision_callback(self) -> None:
        seen: list[str] = []
        app = GuardMiddleware(
            Downstream(), filter=FakeFilter({"a"}), paths=[r"/i/(\w+)"], on_decision=seen.append
        )
        async with client(app) as c:
            await c.get("/i/a")
            await c.get("/i/b")
        assert seen == ["passed", "blocked"]

    @pytest.mark.parametrize("backend", ["redis", "fakeredis"])
    async def test_with_a_real_filter(self, make_settings: Any) -> None:
        import redis.asyncio as aioredis

        settings = make_settings()
        if settings.redis_url == "memory://":
            import fakeredis

            r: Any = fakeredis.FakeAsyncRedis()
        else:
            r = aioredis.Redis.from_url(settings.redis_url)
        cf = CuckooFilter(r, "mw", prefix=settings.key_prefix)
        await cf.reserve(100)
        await cf.insert("here")
        down = Downstream()
        app = GuardMiddleware(down, filter=cf, paths=[r"/r/(?P<key>.+)"])
        async with client(app) as c:
            assert (await c.get("/r/here")).status_code == 200
            assert (await c.get("/r/gone")).status_code == 404
        assert down.calls == 1
        await r.aclose()


class TestRedisDown:
    """Lookup errors: fail open or closed, logged once per incident, retried after a pause."""

    async def test_fail_open(self, caplog: pytest.LogCaptureFixture) -> None:
        caplog.set_level(logging.WARNING, logger="guard.middleware")
        down = Downstream()
        cf = FakeFilter(set(), RedisConnectionError("refused"))
        app = GuardMiddleware(down, filter=cf, paths=[r"/i/(\w+)"], cooldown=0)
        async with client(app) as c:
            for _ in range(5):
                r = await c.get("/i/x")
                assert r.status_code == 200 and r.headers["x-guard"] == "bypassed"
            cf.error = None
            assert (await c.get("/i/x")).status_code == 404  # recovered: blocking again
            cf.error = RedisConnectionError("again")
            await c.get("/i/x")
        messages = [r.getMessage() for r in caplog.records]
        assert sum("unavailable" in m for m in messages) == 2  # two incidents
        assert sum("reachable again" in m for m in messages) == 1
        assert down.calls == 6

    async def test_fail_closed(self) -> None:
        down = Downstream()
        cf = FakeFilter(set(), TimeoutError("slow"))
        app = GuardMiddleware(down, filter=cf, paths=[r"/i/(\w+)"], fail_open=False, retry_after=3)
        async with client(app) as c:
            r = await c.get("/i/x")
            assert r.status_code == 503 and r.headers["retry-after"] == "3"
            assert r.headers["x-guard"] == "rejected"
            r = await c.head("/i/x")
            assert r.status_code == 503 and r.content == b""
        assert down.calls == 0

    async def test_cooldown_skips_redis(self) -> None:
        cf = FakeFilter(set(), RedisConnectionError("refused"))
        app = GuardMiddleware(Downstream(), filter=cf, paths=[r"/i/(\w+)"], cooldown=60)
        async with client(app) as c:
            for _ in range(10):
                await c.get("/i/x")
        assert cf.lookups == 1  # one failure, then no more waiting on a dead Redis

    @pytest.mark.parametrize("fail_open", [True, False], ids=["open", "closed"])
    async def test_damaged_filter_is_an_incident_without_the_breaker(
        self, caplog: pytest.LogCaptureFixture, fail_open: bool
    ) -> None:
        """FilterCorruptError fails open or closed like an outage, logged once when it starts
        and once when it clears, each lookup reported; Redis answers, so the shared breaker
        (which would send the app's cache reads away too) is left closed."""
        caplog.set_level(logging.WARNING, logger="guard.middleware")
        breaker = RedisBreaker(60)
        failures: list[str] = []
        cf = FakeFilter(set(), FilterCorruptError("records: bad magic in key x"))
        app = GuardMiddleware(
            Downstream(), filter=cf, paths=[r"/i/(\w+)"], fail_open=fail_open,
            breaker=breaker, on_failure=failures.append,
        )  # fmt: skip
        async with client(app) as c:
            for _ in range(4):
                r = await c.get("/i/x")
                expected = (200, "bypassed") if fail_open else (503, "rejected")
                assert (r.status_code, r.headers["x-guard"]) == expected
            assert not breaker.open and cf.lookups == 4
            cf.error = RedisConnectionError("refused")  # now Redis goes too: another cause
            await c.get("/i/x")
            assert breaker.open
        assert failures == ["damaged"] * 4 + ["unreachable"]
        messages = [r.getMessage() for r in caplog.records]
        policy = "failing open" if fail_open else "failing closed (503)"
        incidents = [m for m in messages if "unavailable" in m]
        assert len(incidents) == 2, incidents  # once per cause, not once per request
        assert incidents[0].startswith(f"guard filter unavailable (damaged), {policy}: ")
        assert "bad magic" in incidents[0]
        assert incidents[1].startswith(f"guard filter unavailable (unreachable), {policy}: ")
        breaker.cooldown = 0
        breaker.trip()
        cf.error = None
        async with client(app) as c:
            assert (await c.get("/i/x")).status_code == 404
            assert (await c.get("/i/x")).status_code == 404
        assert sum("reachable again" in r.getMessage() for r in caplog.records) == 1

    async def test_non_http_scopes_pass(self) -> None:
        calls: list[str] = []

        async def inner(scope: Any, receive: Any, send: Any) -> None:
            calls.append(scope["type"])

        app = GuardMiddleware(inner, filter=FakeFilter(set()), paths=[r"/i/(\w+)"])
        await app({"type": "lifespan"}, None, None)  # type: ignore[arg-type]
        assert calls == ["lifespan"]
