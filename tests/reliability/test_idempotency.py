"""Retries with the same Idempotency-Key change the filter once, also when the first attempt's
answer never reached the client, when Redis's answer never reached the service, and when the
process died before storing it."""

from __future__ import annotations

import asyncio
import json
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from app.idempotency import IN_DOUBT_AFTER_S
from devkit.processes import HttpProcess
from devkit.redis_server import RedisProcess
from devkit.service import AUTH, start_service
from guard import CuckooFilter
from tests.redis_faults import HOLD_SERVER_2S
from tests.reliability.conftest import StartApp

pytestmark = pytest.mark.realredis

ITEMS = [f"item-{i}" for i in range(3000)]  # a batch that takes a moment to apply


@pytest.fixture(scope="module")
def served() -> Iterator[HttpProcess]:
    with tempfile.TemporaryDirectory(prefix="guard-idem-") as tmp:
        server = RedisProcess.start()
        # redis_timeout 2 s: the machine is busy, and this test is not about timeouts.
        app = start_service(Path(tmp), server.url, redis_timeout="2")
        try:
            yield app
        finally:
            app.stop()
            server.stop()


def send_and_hang_up(app: HttpProcess, method: str, path: str, body: object, idem_key: str) -> None:
    """Send a whole request on a raw socket and close it without reading a byte of the answer."""
    payload = json.dumps(body).encode()
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Authorization: {AUTH['Authorization']}\r\nIdempotency-Key: {idem_key}\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", app.port), timeout=5) as s:
        s.sendall(head + payload)
        s.shutdown(socket.SHUT_WR)  # the request is complete; nobody reads the answer


def items_in(app: HttpProcess, name: str) -> int:
    r = httpx.get(f"{app.url}/filters/{name}", timeout=10)
    assert r.status_code == 200, r.text
    return int(r.json()["items"])


def wait_for_items(app: HttpProcess, name: str, expected: int, within: float = 20.0) -> None:
    # Generous: two busy cores; the first attempt runs on after the client hung up.
    deadline = time.monotonic() + within
    while items_in(app, name) != expected:
        assert time.monotonic() < deadline, f"{name}: the first attempt never applied"
        time.sleep(0.05)


class TestLostAnswer:
    """The client hangs up before reading the answer, then retries with the same key."""

    def test_add_then_delete_apply_once(self, served: HttpProcess) -> None:
        name = "lost-raw"
        url = f"{served.url}/filters/{name}"
        assert httpx.put(url, json={"capacity": 10_000}, headers=AUTH).status_code == 201
        send_and_hang_up(served, "POST", f"/filters/{name}/add", {"items": ITEMS}, "add-1")
        wait_for_items(served, name, len(ITEMS))
        headers = {**AUTH, "Idempotency-Key": "add-1"}
        retry = httpx.post(f"{url}/add", json={"items": ITEMS}, headers=headers, timeout=30)
        assert retry.status_code == 200 and retry.headers["idempotent-replayed"] == "true"
        assert retry.json()["results"] == [True] * len(ITEMS)
        assert items_in(served, name) == len(ITEMS)  # not 2 x

        gone = ITEMS[:1000]
        send_and_hang_up(served, "POST", f"/filters/{name}/delete", {"items": gone}, "del-1")
        wait_for_items(served, name, len(ITEMS) - len(gone))
        headers = {**AUTH, "Idempotency-Key": "del-1"}
        retry = httpx.post(f"{url}/delete", json={"items": gone}, headers=headers, timeout=30)
        assert retry.status_code == 200 and retry.headers["idempotent-replayed"] == "true"
        info = httpx.get(url).json()
        # Deleted once: a second run would have found nothing (missed deletes) or removed
        # other items' fingerprints.
        assert info["items"] == len(ITEMS) - len(gone) and info["missed_deletes"] == 0

    @pytest.mark.parametrize("op", ["add", "delete"])
    def test_client_timeout_then_retries(self, served: HttpProcess, op: str) -> None:
        """httpx gives up after 1 ms (the request may or may not have been applied); the
        client retries until it gets an answer: the filter changed exactly once."""
        name = f"lost-timeout-{op}"
        url = f"{served.url}/filters/{name}"
        assert httpx.put(url, json={"capacity": 10_000}, headers=AUTH).status_code == 201
        if op == "delete":
            assert httpx.post(f"{url}/add", json={"items": ITEMS}, headers=AUTH).status_code == 200
        headers = {**AUTH, "Idempotency-Key": f"{op}-t"}
        body = {"items": ITEMS}
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{url}/{op}", json=body, headers=headers, timeout=0.001)
        answer = None
        for _ in range(50):
            r = httpx.post(f"{url}/{op}", json=body, headers=headers, timeout=30)
            if r.status_code == 200:
                answer = r
                break
            assert r.status_code == 409, r.text  # the first attempt is still running
        assert answer is not None
        info = httpx.get(url).json()
        assert info["items"] == (len(ITEMS) if op == "add" else 0)
        assert info["missed_deletes"] == 0


class TestDiedBeforeAnswerStored:
    """The process dies after the mutation, before the answer is stored."""

    async def test_retry_is_refused_in_doubt_not_run_twice(
        self, start_app: StartApp, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        svc = await start_app()
        c = svc.client
        assert (await c.put("/filters/f", json={"capacity": 100}, headers=AUTH)).status_code == 201
        assert (await c.post("/filters/f/add", json={"items": ["a", "b"]}, headers=AUTH)).is_success
        real_delete_many = CuckooFilter.delete_many

        async def delete_then_die(self: CuckooFilter, items: list[str]) -> list[bool]:
            await real_delete_many(self, items)
            raise asyncio.CancelledError  # no except clause runs: like a killed process

        monkeypatch.setattr(CuckooFilter, "delete_many", delete_then_die)
        headers = {**AUTH, "Idempotency-Key": "died-1"}
        with pytest.raises(asyncio.CancelledError):
            await c.post("/filters/f/delete", json={"items": ["a"]}, headers=headers)
        monkeypatch.setattr(CuckooFilter, "delete_many", real_delete_many)
        claims = list(svc.redis.scan_iter(match=f"{svc.settings.key_prefix}app:idem:*"))
        assert len(claims) == 1
        # The claim is kept as long as an answer would be, not just a minute.
        assert svc.redis.pttl(claims[0]) > svc.settings.idempotency_ttl * 1000 - 60_000
        # Shortly after: "still in progress" (409); much later: "in doubt" (409). Never a rerun.
        r = await c.post("/filters/f/delete", json={"items": ["a"]}, headers=headers)
        assert r.status_code == 409 and "in progress" in r.json()["detail"]
        record = json.loads(svc.redis.get(claims[0]) or b"{}")
        record["since"] -= IN_DOUBT_AFTER_S + 1  # time passes
        svc.redis.set(claims[0], json.dumps(record), keepttl=True)
        r = await c.post("/filters/f/delete", json={"items": ["a"]}, headers=headers)
        assert r.status_code == 409 and "may have changed the filter" in r.json()["detail"]
        info = (await c.get("/filters/f")).json()
        assert (info["items"], info["missed_deletes"]) == (1, 0)


class TestNoAnswerFromRedis:
    """Redis runs the delete, but only after the service timed out waiting for it."""

    async def test_retry_is_refused_in_doubt_not_run_twice(
        self, start_app: StartApp, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        server = RedisProcess.start()  # its own: a busy script blocks every client of a server
        busy = redis.Redis.from_url(server.url)
        try:
            c = (await start_app(redis_url=server.url, redis_timeout=0.5)).client
            await self._delete_twice_with_one_key(c, busy, monkeypatch)
        finally:
            busy.close()
            server.stop()

    async def _delete_twice_with_one_key(
        self, c: httpx.AsyncClient, busy: redis.Redis, mp: pytest.MonkeyPatch
    ) -> None:
        assert (await c.put("/filters/f", json={"capacity": 100}, headers=AUTH)).status_code == 201
        body = {"items": ["a", "a", "b"]}  # two copies of "a": each delete removes one
        assert (await c.post("/filters/f/add", json=body, headers=AUTH)).is_success
        real_delete_many = CuckooFilter.delete_many
        held: list[bool] = []

        async def delete_behind_a_busy_script(self: CuckooFilter, items: list[str]) -> list[bool]:
            if held or list(items) != ["a"]:
                return await real_delete_many(self, items)
            held.append(True)
            # A 2-second script holds Redis; the delete queues behind it, the service stops
            # waiting after 0.5 s, and Redis runs the delete when the script ends.
            blocker = threading.Thread(target=busy.eval, args=(HOLD_SERVER_2S, 0))
            blocker.start()
            await asyncio.sleep(0.3)
            try:
                return await real_delete_many(self, items)
            finally:
                await asyncio.to_thread(blocker.join)

        # Patched before the first delete: a handle keeps the method it first looked up.
        mp.setattr(CuckooFilter, "delete_many", delete_behind_a_busy_script)
        # Loads the delete script: a first EVALSHA would fail NOSCRIPT behind the busy one.
        assert (await c.post("/filters/f/delete", json={"items": ["b"]}, headers=AUTH)).is_success
        headers = {**AUTH, "Idempotency-Key": "no-answer-1"}
        r = await c.post("/filters/f/delete", json={"items": ["a"]}, headers=headers)
        # It did run: the answer says it may have, never that it failed.
        assert r.status_code == 504 and "may have happened" in r.json()["detail"]
        assert (await c.get("/filters/f")).json()["items"] == 1  # it did run, unanswered
        r = await c.post("/filters/f/delete", json={"items": ["a"]}, headers=headers)
        assert r.status_code == 409 and "got no answer from Redis" in r.json()["detail"]
        # A rerun would have removed the second copy of "a": a false negative.
        assert (await c.get("/filters/f")).json()["items"] == 1
        assert (await c.get("/filters/f/items/a")).json() == {"exists": True}
