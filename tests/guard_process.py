"""The `guard` command and `guard serve` as child processes, with only the GUARD_* settings a
test gives (none inherited from the shell running the tests)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from devkit.processes import HttpProcess, free_port


def clean_env(**settings: str) -> dict[str, str]:
    """This environment without any GUARD_* variable, plus ``settings``."""
    return {k: v for k, v in os.environ.items() if not k.startswith("GUARD_")} | settings


def run_module(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``python -m ARGS…`` to completion (60 s at most), output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", *args], env=env, capture_output=True, text=True, timeout=60
    )


@contextmanager
def guard_serve(env: dict[str, str]) -> Iterator[str]:
    """`guard serve` on a free port; yields its base URL once /health answers."""
    port = free_port()
    argv = [sys.executable, "-m", "app.cli", "serve", "--port", str(port), "--log-level", "warning"]
    server = HttpProcess.start(argv, port=port, env=env, timeout=30)
    try:
        yield server.url
    finally:
        server.stop(grace=20)
