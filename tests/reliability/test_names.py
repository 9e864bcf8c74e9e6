"""Odd and hostile filter names on every route that takes one: a 4xx naming the field and the
limit, and nothing in Redis outside the service's prefix is read into or changed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from asgi_lifespan import LifespanManager

from app.main import create_app
from app.settings import Settings
from devkit.redis_server import RedisProcess
from devkit.service import API_KEY, AUTH

pytestmark = pytest.mark.realredis

PREFIX = "svc:"
# Keys a hostile name might aim at: other prefixes, the bare filter key, a hash tag.
VICTIMS = {
    b"other:{records}": b"v1",
    b"{records}": b"v2",
    b"records": b"v3",
    b"guard:{x}": b"v4",
    b"svc": b"v5",
    b"*": b"v6",
}

# Sent percent-encoded where they need it; each decodes to a name outside the pattern.
NAMES = [
    "%7B", "%7D", "a%7Bb%7D", "%7Brecords%7D", ":", "a:b", "other:%7Brecords%7D", "*", "a*",
    "%20", "a%20b", "%2E%2E", ".hidden", "-dash", "a%0A", "a%00", "%C3%A9", "x" * 10_240,
    "a" * 65, "guard:x", "svc:%7Bx%7D",
]  # fmt: skip

# Every route with a {name}; (method, path after the name, JSON body).
ROUTES: list[tuple[str, str, Any]] = [
    ("PUT", "", {"capacity": 10}),
    ("GET", "", None),
    ("DELETE", "", None),
    ("POST", "/add", {"items": ["a"]}),
    ("POST", "/check", {"items": ["a"]}),
    ("POST", "/delete", {"items": ["a"]}),
    ("POST", "/rebuild", None),
    ("PUT", "/items/i", None),
    ("GET", "/items/i", None),
    ("DELETE", "/items/i", None),
]


def snapshot(r: redis.Redis) -> dict[bytes, bytes]:
    """Every key outside the service's prefix, with a DUMP of its value."""
    return {k: r.dump(k) or b"" for k in r.scan_iter(count=1000) if not k.startswith(b"svc:")}


@pytest.fixture(scope="module")
def private_redis() -> Iterator[RedisProcess]:
    server = RedisProcess.start()  # its own server: the snapshot covers the whole keyspace
    try:
        yield server
    finally:
        server.stop()


class TestHostileNames:
    """Refused with 422 at `loc: [path, name]`, and the keyspace outside the prefix unchanged."""

    async def test_every_route_refuses_and_touches_nothing(
        self, private_redis: RedisProcess, tmp_path: Path
    ) -> None:
        plain = redis.Redis(port=private_redis.port)
        plain.mset(VICTIMS)
        before = snapshot(plain)
        settings = Settings(
            redis_url=private_redis.url, key_prefix=PREFIX, api_key=API_KEY, demo_records=10,
            database_url=f"sqlite:///{tmp_path / 'records.db'}",
        )  # fmt: skip
        answers: list[tuple[str, str, int]] = []
        async with LifespanManager(create_app(settings)) as manager:
            transport = httpx.ASGITransport(app=manager.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                for name in NAMES:
                    for method, suffix, body in ROUTES:
                        r = await c.request(
                            method, f"/filters/{name}{suffix}", json=body, headers=AUTH
                        )
                        answers.append((method, f"{name[:20]}{suffix}", r.status_code))
                        assert r.status_code == 422, (method, name[:20], suffix, r.text[:200])
                        detail = r.json()["detail"][0]
                        assert detail["loc"] == ["path", "name"]
                        assert "{0,63}" in detail["msg"]  # the limit: 1-64 characters
                # A name with a slash (also as %2F) is another path: no route, or the item
                # route of the part before the slash; never a key with a slash in it.
                for path in ("/filters/a%2Fb", "/filters/..%2F..%2Fx"):
                    r = await c.put(path, json={"capacity": 10}, headers=AUTH)
                    assert r.status_code == 404, r.text
                # Odd record keys and items are hashed or stay under the prefix.
                for key in ("%7Bx%7D", "a:b", "*", "..%2Fsvc", "other:%7Brecords%7D"):
                    await c.put(f"/records/{key}", json={"value": 1}, headers=AUTH)
                    await c.get(f"/records/{key}")
                    await c.delete(f"/records/{key}", headers=AUTH)
        after = snapshot(plain)
        inside = [k for k in plain.scan_iter(count=1000) if k.startswith(PREFIX.encode())]
        plain.close()
        assert after == before
        assert {k: before[k] for k in VICTIMS} and len(after) == len(VICTIMS)
        # No filter was created under any of those names.
        assert all(b"{records}" in k or b"app:" in k for k in inside), inside
        assert len(answers) == len(NAMES) * len(ROUTES)
