"""Security: auth on every mutating route (answered before any body), the key never logged,
production refuses weak keys, CORS off by default, error bodies without stack traces, file
paths or Redis internals."""

from __future__ import annotations

import logging
import re
import tempfile
from pathlib import Path

import httpx
import pytest
from asgi_lifespan import LifespanManager
from pydantic import SecretStr

from app.main import create_app, weak_api_key
from app.settings import Settings
from devkit.keys import delete_prefixed_at
from devkit.processes import free_port
from devkit.redis_server import RedisProcess
from devkit.service import API_KEY, AUTH, start_service
from tests import raw_http
from tests.reliability.conftest import StartApp

pytestmark = pytest.mark.realredis

PARAMS = {"name": "f", "item": "i", "key": "k"}
READ_ONLY = {"/filters/f/check"}  # a POST only because a batch of items needs a body
BODIES = {"add": {"items": ["a"]}, "delete": {"items": ["a"]}, "/records/": {"value": 1}}

# What an error body must never show: tracebacks, source paths, Redis replies and classes,
# addresses, key names. ("Redis unavailable" is allowed: it tells the client what to wait for.)
LEAKS = re.compile(
    r"Traceback|File \"|\.py\b|/work/|site-packages|redis\.|exceptions|ResponseError|WRONGTYPE|"
    r"NOSCRIPT|ERR |127\.0\.0\.1|:6379|GUARD_|\{f\}|\{records\}|app:",
    re.I,
)


async def mutating_routes(client: httpx.AsyncClient) -> list[tuple[str, str, object]]:
    spec = (await client.get("/openapi.json")).json()
    routes = []
    for template, ops in spec["paths"].items():
        path = template.format(**PARAMS)
        for method in ops:
            if method in ("put", "post", "delete", "patch") and path not in READ_ONLY:
                body = next((b for k, b in BODIES.items() if path.endswith(k) or k in path), None)
                if method == "put" and body is None and "items" not in path:
                    body = {"capacity": 10}
                routes.append((method.upper(), path, body))
    return routes


class TestAuth:
    """401 on every mutating route in the OpenAPI document, without or with a wrong key."""

    async def test_every_mutating_route_needs_the_key(self, start_app: StartApp) -> None:
        svc = await start_app()
        routes = await mutating_routes(svc.client)
        assert len(routes) >= 9, routes  # filters: 8, records: 2 (and whatever comes later)
        wrong = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {API_KEY}"},
                 {"Authorization": f"Bearer {API_KEY}x"}, {"Authorization": API_KEY}]  # fmt: skip
        for method, path, body in routes:
            for headers in wrong:
                r = await svc.client.request(method, path, json=body, headers=headers)
                assert r.status_code == 401, (method, path, headers, r.text)
                assert r.json() == {"detail": "missing or invalid API key"}
                assert r.headers["www-authenticate"] == "Bearer"
        # Nothing was created, changed or deleted by any of them.
        assert (await svc.client.get("/filters/f")).status_code == 404
        assert (await svc.client.get("/records/k")).status_code == 404
        assert (await svc.client.get("/filters/records")).json()["items"] == 50


class TestAnsweredBeforeTheBody:
    """A request the key does not let through gets its 401 at once, body or not: a real
    server, and a socket that sends the headers, a declared body, and never the body."""

    def test_every_route_that_needs_the_key(
        self, real_redis_url: str, prefix: str, tmp_path: Path
    ) -> None:
        app = start_service(tmp_path, real_redis_url, key_prefix=prefix, protect_reads="true")
        try:
            with httpx.Client(base_url=app.url, timeout=10) as c:
                spec = c.get("/openapi.json").json()
                c.put("/filters/f", json={"capacity": 10}, headers=AUTH)
                routes = [
                    (method.upper(), template.format(**PARAMS))
                    for template, ops in spec["paths"].items()
                    for method in ops
                    if template.startswith("/filters") or method in ("put", "delete")
                ]
                assert len(routes) >= 13, routes  # filters: 11, records: 2
                for method, path in routes:
                    for key in ("", "Authorization: Bearer wrong\r\n"):
                        for body in ("Content-Length: 64", "Transfer-Encoding: chunked"):
                            head = f"{method} {path} HTTP/1.1\r\nHost: t\r\n{key}"
                            head += f"Content-Type: application/json\r\n{body}"
                            answer = raw_http.request(app.port, head)
                            assert answer.status == 401, (head, answer)
                            assert answer.json() == {"detail": "missing or invalid API key"}
                # Nothing was created, changed or deleted by any of them.
                assert c.get("/filters/f", headers=AUTH).json()["items"] == 0
                assert c.get("/filters/records", headers=AUTH).json()["items"] == 200
        finally:
            app.stop()
            delete_prefixed_at(real_redis_url, prefix)


class TestKeyNeverLogged:
    """Requests that carry the key (valid, wrong, failing) leave no trace of it in any log."""

    async def test_in_process_logs(
        self, start_app: StartApp, caplog: pytest.LogCaptureFixture
    ) -> None:
        with caplog.at_level(logging.DEBUG):
            svc = await start_app()
            c = svc.client
            await c.put("/filters/f", json={"capacity": 10}, headers=AUTH)
            await c.post("/filters/f/add", json={"items": [API_KEY]}, headers=AUTH)  # as data
            await c.put("/filters/f", json={"capacity": 10}, headers=AUTH)  # 409
            near = {"Authorization": f"Bearer {API_KEY[:-1]}"}
            await c.put("/filters/g", json={"capacity": 10}, headers=near)  # 401
            svc.redis.setrange(svc.key("f"), 0, b"XXXX")
            await c.post("/filters/f/check", json={"items": ["a"]}, headers=AUTH)  # 500 damaged
            await c.post("/filters/f/add", json={"bad": 1}, headers=AUTH)  # 422
        assert caplog.records
        text = "\n".join(f"{r.getMessage()} {r.args!r} {r.exc_text or ''}" for r in caplog.records)
        assert API_KEY not in text and API_KEY[:-1] not in text
        assert API_KEY not in repr(svc.settings) and API_KEY not in str(svc.settings.model_dump())

    def test_uvicorn_log_with_redis_down(self) -> None:
        """A real server's whole output, access log included, while Redis goes away."""
        with tempfile.TemporaryDirectory(prefix="guard-sec-") as tmp:
            server = RedisProcess.start()
            app = start_service(Path(tmp), server.url)
            try:
                with httpx.Client(base_url=app.url, timeout=10) as c:
                    c.put("/filters/f", json={"capacity": 10}, headers=AUTH)
                    c.put("/filters/f", json={"capacity": 10}, headers={"Authorization": "x"})
                    server.stop()
                    assert c.put("/filters/f/items/x", headers=AUTH).status_code == 503
                    c.get("/records/user-1", headers=AUTH)
                    c.get("/health", headers=AUTH)
            finally:
                app.stop()
                server.stop()
            log = app.log.read_text()
        assert "PUT /filters/f" in log and "503" in log  # the log is really there
        assert API_KEY not in log


class TestProductionKeys:
    """GUARD_ENV=production refuses to start with an empty, placeholder or short key."""

    @pytest.mark.parametrize(
        "key",
        ["", "changeme", "CHANGE-ME", "change-me-demo-key", "secret", "default", "test",
         "password", "api-key", "short-key-123", "a" * 40, "abababababababababab"],
    )  # fmt: skip
    async def test_refused(self, key: str, tmp_path: Path) -> None:
        assert weak_api_key(key) is not None
        settings = Settings(env="production", redis_url="memory://", api_key=SecretStr(key),
                            database_url=f"sqlite:///{tmp_path}/r.db")  # fmt: skip
        with pytest.raises(RuntimeError, match="GUARD_API_KEY") as err:
            async with LifespanManager(create_app(settings)):
                pass
        assert not key or key not in str(err.value)  # the reason, never the key itself

    async def test_real_key_starts(self, tmp_path: Path) -> None:
        settings = Settings(env="production", redis_url="memory://", api_key=SecretStr(API_KEY),
                            database_url=f"sqlite:///{tmp_path}/r.db", demo_records=1)  # fmt: skip
        assert weak_api_key(API_KEY) is None
        async with LifespanManager(create_app(settings)):
            pass


class TestCorsOff:
    """No CORS headers unless someone adds them on purpose."""

    async def test_cross_origin_requests_get_no_cors_headers(self, start_app: StartApp) -> None:
        svc = await start_app()
        origin = {"Origin": "https://evil.example"}
        preflight = await svc.client.options(
            "/filters/f", headers={**origin, "Access-Control-Request-Method": "PUT"}
        )
        assert preflight.status_code in (405, 404)
        for r in (
            preflight,
            await svc.client.get("/filters", headers=origin),
            await svc.client.get("/records/user-1", headers=origin),
            await svc.client.put("/filters/f", json={"capacity": 10}, headers={**origin, **AUTH}),
        ):
            assert not [h for h in r.headers if h.lower().startswith("access-control-")], r.headers


class TestErrorBodies:
    """A sample of every error status: no stack trace, path, Redis internals or key names."""

    async def test_no_leaks(self, start_app: StartApp) -> None:
        svc = await start_app(max_body_bytes=1024)
        c = svc.client
        tiny = {"capacity": 4, "expansion": 0, "bucket_size": 1, "fingerprint_bits": 4}
        await c.put("/filters/tiny", json=tiny, headers=AUTH)
        await c.put("/filters/f", json={"capacity": 10}, headers=AUTH)
        many = {"items": [f"i{n}" for n in range(60)]}
        answers = {
            401: await c.put("/filters/x", json={"capacity": 1}),
            404: await c.get("/filters/nope"),
            409: await c.put("/filters/f", json={"capacity": 10}, headers=AUTH),
            413: await c.post("/filters/f/add", content=b"x" * 2048, headers=AUTH),
            422: await c.put("/filters/%7Bx%7D", json={"capacity": -1}, headers=AUTH),
            507: await c.post("/filters/tiny/add", json=many, headers=AUTH),
        }
        json_type = {"Content-Type": "application/json"}
        bad_utf8 = await c.post("/filters/f/check", content=b"\xff\xfe", headers=json_type)
        svc.redis.delete(svc.key("f"))
        svc.redis.hset(svc.key("f"), "x", "y")  # a key of the wrong type under the filter's name
        damaged = await c.post("/filters/f/check", json={"items": ["a"]})
        records_409 = await c.post("/filters/records/add", json={"items": ["a"]}, headers=AUTH)
        for status, r in answers.items():
            assert r.status_code == status, (status, r.text)
        samples = [*answers.values(), bad_utf8, damaged, records_409]
        assert [r.status_code for r in samples[-3:]] == [422, 500, 409]
        unavailable = await self._unavailable()
        for r in [*samples, *unavailable]:
            assert r.headers["content-type"] == "application/json", r.text
            assert not LEAKS.search(r.text), (r.status_code, r.text)
            assert svc.settings.key_prefix not in r.text

    @staticmethod
    async def _unavailable() -> list[httpx.Response]:
        """503s from an app whose Redis is a closed port (write, filter read, guard closed)."""
        with tempfile.TemporaryDirectory() as tmp:
            settings = Settings(
                redis_url=f"redis://127.0.0.1:{free_port()}/0", api_key=API_KEY,
                database_url=f"sqlite:///{tmp}/r.db", demo_records=1, fail_open=False,
            )  # fmt: skip
            async with LifespanManager(create_app(settings)) as m:
                transport = httpx.ASGITransport(app=m.app)
                async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                    out = [
                        await c.post("/filters/f/add", json={"items": ["a"]}, headers=AUTH),
                        await c.get("/filters/f"),
                        await c.put("/records/k", json={"value": 1}, headers=AUTH),
                    ]
                    await c.get("/filters/f")  # guard: closed
                    # Guard, failing closed: the middleware's own answer.
                    out.append(await c.get("/records/user-1"))
        assert [r.status_code for r in out] == [503] * 4, [r.text for r in out]
        return out
