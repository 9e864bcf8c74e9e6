"""Operations that write whole filters never answer "failed" for what may have happened.

A private redis-server (big filters stay off the shared one): creating a 10,000,000-item
filter (24 MiB) takes Redis longer than the tiny socket timeouts set here.
"""

from __future__ import annotations

from typing import Any

import pytest
import redis
from redis.asyncio.connection import AbstractConnection

from tests.app.conftest import AUTH, StartService

BIG = {"capacity": 10_000_000}
ADMIN_TIMEOUT = 29.5  # tells the admin client's connections from the request client's

pytestmark = pytest.mark.parametrize("backend", ["redis"])


async def test_create_and_drop_use_the_admin_timeout(
    start: StartService, private_redis: str
) -> None:
    """Requests keep their short timeout; creating and dropping a big filter get the admin
    one, so they answer what happened."""
    svc = await start(redis_url=private_redis, redis_timeout=0.002, rebuild_on_startup=False)
    created = await svc.client.put("/filters/big", json=BIG, headers=AUTH)
    assert created.status_code == 201, created.text
    assert created.json()["capacity"] >= BIG["capacity"]
    dropped = await svc.client.delete("/filters/big?confirm=big", headers=AUTH)
    assert dropped.status_code == 204, dropped.text


async def test_create_that_times_out_answers_in_doubt(
    start: StartService, private_redis: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Even the admin timeout can be too short: the answer says the filter may exist (not
    503 "unavailable"), and a retry answers clearly."""
    svc = await start(
        redis_url=private_redis, redis_admin_timeout=ADMIN_TIMEOUT, rebuild_on_startup=False
    )
    # The admin client connected and its script loaded: the create is one command whose reply
    # is lost below.
    warm = await svc.client.put("/filters/warm", json={"capacity": 1000}, headers=AUTH)
    assert warm.status_code == 201, warm.text
    real_read = AbstractConnection.read_response

    async def reply_lost(self: AbstractConnection, *args: Any, **kwargs: Any) -> Any:
        """The command ran to its end, but its reply came after the admin timeout."""
        reply = await real_read(self, *args, **kwargs)
        if self.socket_timeout == ADMIN_TIMEOUT:
            raise redis.TimeoutError("Timeout reading from socket")
        return reply

    monkeypatch.setattr(AbstractConnection, "read_response", reply_lost)
    r = await svc.client.put("/filters/big", json=BIG, headers=AUTH)
    assert r.status_code == 504, r.text
    assert r.json() == {
        "detail": "creating filter 'big': Redis did not answer in time, so it may have happened;"
        " GET /filters/big tells (a retry answers 409 if so)"
    }
    assert "retry-after" not in r.headers
    # It did happen (the script ran to its end): the info says so, and a retry gets 409.
    assert (await svc.client.get("/filters/big")).status_code == 200
    retry = await svc.client.put("/filters/big", json=BIG, headers=AUTH)
    assert retry.status_code == 409, retry.text
