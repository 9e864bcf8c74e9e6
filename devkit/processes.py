"""Child processes on loopback ports: a free port, waiting until one answers, stopping by PID."""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from app.cli.service import stop_process  # the CLI's demo stops its service the same way


def free_port() -> int:
    """A loopback port nothing listens on (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def answers(url: str) -> bool:
    """True when a GET of ``url`` answers 200."""
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return bool(resp.status == 200)
    except (OSError, urllib.error.HTTPError):
        return False


def wait_until_answers(
    proc: subprocess.Popen[bytes],
    url: str,
    timeout: float = 30.0,
    why: Callable[[], str] = lambda: "",
) -> None:
    """Return once ``url`` answers 200; RuntimeError (with ``why()``) if ``proc`` exits or
    the deadline passes first."""
    deadline = time.monotonic() + timeout
    while not answers(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not answer: {why()}")
        time.sleep(0.05)


@dataclass
class HttpProcess:
    """A child process serving HTTP on a loopback port, its output in ``log``; stopped by PID."""

    proc: subprocess.Popen[bytes]
    port: int
    log: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @classmethod
    def start(
        cls,
        argv: Sequence[str],
        *,
        port: int,
        env: dict[str, str],
        ready: str = "/health",
        log: Path | None = None,
        timeout: float = 30.0,
        cwd: Path | None = None,
    ) -> HttpProcess:
        """Run ``argv`` (which must listen on ``port``) and wait until ``ready`` answers 200."""
        if log is None:
            proc = subprocess.Popen(
                argv, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
        else:
            with log.open("wb") as out:
                proc = subprocess.Popen(
                    argv, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT
                )
        server = cls(proc, port, log)
        try:
            wait_until_answers(proc, server.url + ready, timeout, server.log_tail)
        except RuntimeError:
            server.stop()
            raise
        return server

    def log_tail(self, chars: int = 2000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log else "(no log kept)"

    def stop(self, grace: float = 10.0) -> None:
        stop_process(self.proc, grace)
