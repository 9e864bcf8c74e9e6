"""Debian's nginx and caddy running deploy/'s configs in front of a backend that is not the
guard (a second nginx answering every request itself, its access log counted), the guard
service a process of its own following a PostgreSQL table, with deploy/rules.yaml.

What reaches the backend is read from its access log: absent keys never, present keys always,
a row inserted with psql once the feed applied it; Redis stopped: fail-open rules pass and
fail-closed ones are refused at the gateway; the guard down or frozen: the gateway fails open
after its timeout (docs/gateway.md)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from devkit.gateways import (
    RULES,
    Nginx,
    missing_programs,
    start_backend,
    start_caddy,
    start_nginx_gateway,
)
from devkit.postgres import create_database, drop_database
from devkit.processes import HttpProcess
from devkit.redis_server import RedisProcess
from devkit.service import AUTH, start_service

GATEWAYS = ["nginx", "caddy"]
USERS = 100  # rows 1..100 in the users table


def test_gateways_are_installed() -> None:
    """.ci/run installs them: the tests below must never be skipped for want of them."""
    assert missing_programs() == []
    run = subprocess.run(["nginx", "-V"], capture_output=True, text=True, check=True)
    assert "--with-http_auth_request_module" in run.stderr


def psql(url: str, sql: str) -> None:
    subprocess.run(["psql", url, "-v", "ON_ERROR_STOP=1", "-qc", sql], check=True, timeout=30)


@dataclass
class Stack:
    """Redis, the guard service, the backend, and the gateways started in front of them."""

    redis: RedisProcess
    pg_url: str
    guard: HttpProcess
    backend: Nginx
    workdir: Path
    stack: ExitStack

    def gateway(self, kind: str) -> str:
        """A gateway of ``kind`` in front of the backend, asking the guard; its URL."""
        guard, backend = f"127.0.0.1:{self.guard.port}", f"127.0.0.1:{self.backend.port}"
        where = self.workdir / f"{kind}-{uuid.uuid4().hex[:6]}"
        if kind == "nginx":
            server: Any = start_nginx_gateway(where, guard, backend)
        else:
            server = start_caddy(where, guard, backend)
        self.stack.callback(server.stop)
        return str(server.url)

    def reached(self, action: Callable[[], Any]) -> list[str]:
        """The backend's access-log lines that ``action`` caused: those between two marker
        requests sent to the backend itself (nginx logs a request just after answering it,
        so the last line may not be there yet when its client has the answer)."""
        start = self._mark()
        action()
        return self.backend.requests()[start : self._mark() - 1]

    def _mark(self) -> int:
        """Log a marker request; the index just after its line."""
        mark = f"/mark/{uuid.uuid4().hex}"
        httpx.get(self.backend.url + mark, timeout=10)
        found: list[int] = []

        def logged() -> bool:
            lines = self.backend.requests()
            found[:] = [i + 1 for i, line in enumerate(lines) if f" {mark} " in line]
            return bool(found)

        assert wait_for(logged, 10), mark
        return found[0]


@contextmanager
def running_stack(workdir: Path) -> Iterator[Stack]:
    with ExitStack() as stack:
        redis = RedisProcess.start()
        stack.callback(redis.stop)
        pg_url = asyncio.run(create_database("gw25_"))
        stack.callback(lambda: asyncio.run(drop_database(pg_url)))
        psql(pg_url, "CREATE TABLE users (id bigint PRIMARY KEY, email text NOT NULL)")
        psql(pg_url, f"INSERT INTO users SELECT g, 'u' || g FROM generate_series(1, {USERS}) g")
        workdir.mkdir(parents=True, exist_ok=True)
        guard = start_service(
            workdir, redis.url, rules=str(RULES), database_url=pg_url, demo_records="0",
            redis_cooldown="0.2",
        )  # fmt: skip
        stack.callback(guard.stop)
        for name, key in (("orders", "o-1"), ("coupons", "save10"), ("sessions", "s-1")):
            httpx.put(f"{guard.url}/filters/{name}", json={"capacity": 100}, headers=AUTH)
            httpx.put(f"{guard.url}/filters/{name}/items/{key}", headers=AUTH)
        backend = start_backend(workdir / "backend")
        stack.callback(backend.stop)
        yield Stack(redis, pg_url, guard, backend, workdir, stack)


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("gateways")) as stack:
        yield stack


@pytest.fixture
def own(tmp_path: Path) -> Iterator[Stack]:
    """A stack for a test that stops part of it."""
    with running_stack(tmp_path) as stack:
        yield stack


def get(url: str, **kwargs: Any) -> httpx.Response:
    return httpx.get(url, timeout=10, **kwargs)


def wait_for(check: Callable[[], bool], seconds: float = 20.0) -> bool:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.parametrize("kind", GATEWAYS)
class TestThroughTheGateway:
    """Each gateway with the guard running."""

    def test_absent_keys_never_reach_the_backend(self, shared: Stack, kind: str) -> None:
        url = shared.gateway(kind)
        answers: list[httpx.Response] = []

        def absent() -> None:
            for i in range(USERS + 1, USERS + 41):
                answers.append(get(f"{url}/api/users/{i}"))
            answers.append(get(f"{url}/api/orders/o-404"))
            answers.append(get(f"{url}/api/coupons", params={"code": "nope"}))
            answers.append(get(f"{url}/api/session", headers={"X-Session-Id": "s-404"}))
            answers.append(httpx.head(f"{url}/api/users/{USERS + 1}"))

        assert shared.reached(absent) == []
        assert {(r.status_code, r.headers["x-guard"]) for r in answers} == {(404, "blocked")}
        assert answers[0].json() == {"detail": "Not Found"}

    def test_present_keys_always_do(self, shared: Stack, kind: str) -> None:
        url = shared.gateway(kind)
        answers: list[httpx.Response] = []

        def present() -> None:
            for i in range(1, USERS + 1):
                answers.append(get(f"{url}/api/users/{i}"))
            answers.append(get(f"{url}/api/orders/o-1"))
            answers.append(get(f"{url}/api/coupons", params={"code": " SAVE10 "}))
            answers.append(get(f"{url}/api/session", headers={"X-Session-Id": "s-1"}))
            answers.append(get(f"{url}/not/guarded"))

        reached = shared.reached(present)
        assert all(r.status_code == 200 and r.text.startswith("backend: ") for r in answers)
        assert reached[:USERS] == [f"GET /api/users/{i} guard=passed key={i}" for i in
                                   range(1, USERS + 1)]  # fmt: skip
        assert reached[USERS:] == [
            "GET /api/orders/o-1 guard=passed key=o-1",
            "GET /api/coupons?code=+SAVE10+ guard=passed key=save10",
            "GET /api/session guard=passed key=s-1",
            # No rule: passed on, the rule and key headers empty ("-" in nginx's log).
            f"GET /not/guarded guard=unguarded key={'-' if kind == 'nginx' else ''}",
        ]

    def test_a_row_inserted_with_psql_passes_once_the_feed_applied_it(
        self, shared: Stack, kind: str
    ) -> None:
        url = shared.gateway(kind)
        new = 1000 + GATEWAYS.index(kind)
        assert shared.reached(lambda: get(f"{url}/api/users/{new}")) == []
        psql(shared.pg_url, f"INSERT INTO users VALUES ({new}, 'new@example.com')")
        statuses: list[int] = []
        seen = wait_for(lambda: statuses.append(get(f"{url}/api/users/{new}").status_code)
                        or statuses[-1] == 200)  # fmt: skip
        assert seen, statuses[-5:]
        # Blocked until the feed applied the row, let through from then on, every time.
        assert set(statuses[:-1]) <= {404}
        reached = shared.reached(lambda: [get(f"{url}/api/users/{new}") for _ in range(5)])
        assert reached == [f"GET /api/users/{new} guard=passed key={new}"] * 5


@pytest.mark.parametrize("kind", GATEWAYS)
class TestFailures:
    """Parts of the stack stopped: what docs/gateway.md says happens."""

    def test_redis_stopped(self, own: Stack, kind: str) -> None:
        """Fail-open rules pass (to the backend, X-Guard: bypassed); the fail-closed one is
        refused at the gateway with 503 and Retry-After."""
        url = own.gateway(kind)
        own.redis.stop()
        answers: list[httpx.Response] = []

        def during() -> None:
            answers.append(get(f"{url}/api/users/{USERS + 1}"))  # absent, let through
            answers.append(get(f"{url}/api/users/1"))
            answers.append(get(f"{url}/api/orders/o-1"))  # fail_open: false
            answers.append(get(f"{url}/api/orders/o-404"))

        reached = own.reached(during)
        assert reached == [f"GET /api/users/{USERS + 1} guard=bypassed key={USERS + 1}",
                           "GET /api/users/1 guard=bypassed key=1"]  # fmt: skip
        assert [r.status_code for r in answers] == [200, 200, 503, 503]
        assert answers[2].headers["x-guard"] == "rejected"
        assert answers[2].headers["retry-after"] == "1"
        assert answers[2].json() == {"detail": "Guard filter unavailable"}

    def test_guard_down(self, own: Stack, kind: str) -> None:
        """The gateway cannot reach the guard: it fails open, X-Guard: unchecked."""
        url = own.gateway(kind)
        own.guard.stop()
        reached = own.reached(
            lambda: [get(f"{url}/api/users/{k}") for k in (1, USERS + 1)]
        )  # fmt: skip
        assert reached == ["GET /api/users/1 guard=unchecked key=-",
                           f"GET /api/users/{USERS + 1} guard=unchecked key=-"]  # fmt: skip

    def test_guard_slow(self, own: Stack, kind: str) -> None:
        """The guard frozen (SIGSTOP: connections accepted, nothing answered): the gateway
        waits its 500 ms and fails open; once the guard answers again, it blocks again."""
        url = own.gateway(kind)
        pid = own.guard.proc.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            answers: list[httpx.Response] = []
            reached = own.reached(lambda: answers.append(get(f"{url}/api/users/{USERS + 1}")))
        finally:
            os.kill(pid, signal.SIGCONT)
        assert answers[0].status_code == 200
        assert reached == [f"GET /api/users/{USERS + 1} guard=unchecked key=-"]
        assert wait_for(lambda: get(f"{url}/api/users/{USERS + 1}").status_code == 404, 10)
