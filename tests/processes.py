"""Helpers for the servers tests start as subprocesses: wait until healthy, stop for good."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable

import httpx


def stop_process(proc: subprocess.Popen[bytes], grace: float = 10.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited after ``grace`` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_healthy(
    proc: subprocess.Popen[bytes],
    url: str,
    timeout: float = 30.0,
    why: Callable[[], str] = lambda: "",
) -> None:
    """Return once ``url``/health answers 200; raise (with ``why()``) if the process exits or
    the deadline passes first."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"service at {url} did not start: {why()}")
        time.sleep(0.05)
