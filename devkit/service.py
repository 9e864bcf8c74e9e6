"""The service as a child process: `uvicorn app.main:app` on a free port, configured by
GUARD_* settings alone, its output kept in a log file; stopped by PID."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from devkit.processes import HttpProcess, free_port

API_KEY = "reliability-test-key-0123456789"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
KEY_PREFIX = "rel:"


def start_service(workdir: Path, redis_url: str, **settings: str) -> HttpProcess:
    """The service on ``redis_url`` with a SQLite file and a log in ``workdir``; ``settings``
    become GUARD_<NAME> variables (``redis_timeout="2"``)."""
    port = free_port()
    env = {
        **os.environ,
        "GUARD_REDIS_URL": redis_url,
        "GUARD_DATABASE_URL": f"sqlite:///{workdir / 'records.db'}",
        "GUARD_API_KEY": API_KEY,
        "GUARD_DEMO_RECORDS": "200",
        "GUARD_KEY_PREFIX": KEY_PREFIX,
        **{f"GUARD_{k.upper()}": v for k, v in settings.items()},
    }
    argv = [sys.executable, "-m", "uvicorn", "app.main:app", "--port", str(port),
            "--host", "127.0.0.1", "--log-level", "info"]  # fmt: skip
    return HttpProcess.start(
        argv, port=port, env=env, log=workdir / f"uvicorn-{port}.log", timeout=20
    )
