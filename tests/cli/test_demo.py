"""`guard demo` and `guard serve` as a user runs them: real processes, embedded Redis."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import httpx

from tests.guard_process import clean_env, guard_serve, run_module

ROOT = Path(__file__).resolve().parents[2]


def test_demo_runs_on_a_fresh_machine(tmp_path: Path) -> None:
    """No GUARD_* settings at all: embedded Redis, seeded records; it exits 0 by itself and
    reports blocked reads and database queries saved."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GUARD_")}
    run = subprocess.run(
        [sys.executable, "-m", "app.cli", "demo", "--duration", "3", "--records", "500"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr + run.stdout
    out = run.stdout
    for label in ("requests", "blocked by the filter", "passed to the app", "database queries",
                  "database queries saved", "false positives (observed)",
                  "false-positive rate (estimate)"):  # fmt: skip
        assert label in out, out
    blocked = int(re.search(r"the filter blocked ([\d,]+) reads", out)[1].replace(",", ""))  # type: ignore[index]
    assert blocked > 100
    assert not list(tmp_path.iterdir())  # its scratch data went to a temporary directory


def numbers(pattern: str, text: str) -> list[int]:
    found = re.search(pattern, text)
    assert found, text
    return [int(g.replace(",", "")) for g in found.groups()]


def test_demo_summary_adds_up(tmp_path: Path) -> None:
    """Every request is in one of its parts (bypassed and errors too), and the false
    positives are counted where the database queries are: by the service, over the run."""
    run = _demo("--records", "500", "--duration", "3", cwd=tmp_path)
    assert run.returncode == 0, run.stderr + run.stdout
    summary = run.stdout.strip().splitlines()[-1]
    total, blocked, passed, bypassed, errors = numbers(
        r"^([\d,]+) requests: ([\d,]+) blocked, ([\d,]+) passed, ([\d,]+) bypassed, "
        r"([\d,]+) errors",
        summary,
    )
    assert blocked + passed + bypassed + errors == total > 0
    spared, queries, fps, fps_again, judged = numbers(
        r"the filter blocked ([\d,]+) reads .* it answered ([\d,]+) during the run, ([\d,]+) "
        r"of them for false positives: .* \(([\d,]+) of ([\d,]+) absent keys\)",
        summary,
    )
    assert spared == blocked and fps == fps_again and judged == blocked + fps
    assert queries > 0 and fps <= queries


def _demo(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GUARD_")}
    return subprocess.run(
        [sys.executable, "-m", "app.cli", "demo", "--duration", "1", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=90,
    )  # fmt: skip


def test_demo_refuses_a_port_in_use(tmp_path: Path) -> None:
    """--port of a port something listens on: a one-line error, not that service's numbers."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = _demo("--port", str(port), cwd=tmp_path)
    assert run.returncode == 1
    assert run.stderr.splitlines() == [
        f"error: --port {port}: 127.0.0.1:{port} is in use (Address already in use); "
        "pick another port, or 0 for a free one"
    ]
    assert "requests" not in run.stdout


def test_demo_with_redis_down_fails_in_one_line(tmp_path: Path) -> None:
    """--redis-url of a Redis that is down: one line naming the connection error; the demo
    never starts its service (which would wait up to a minute for it)."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # bound, never listening: connections are refused
        run = _demo("--redis-url", f"redis://127.0.0.1:{port}/0", cwd=tmp_path)
    assert run.returncode == 1
    (line,) = run.stderr.splitlines()
    assert line.startswith("error: ConnectionError") and str(port) in line
    assert "seeding" not in run.stdout


def test_attack_log_lines_tell_this_run_from_server_totals(tmp_path: Path) -> None:
    """Off a terminal, `guard attack` logs lines that label this run's counts and the server's
    totals (which include every earlier client) apart."""
    env = clean_env(GUARD_REDIS_URL="memory://", GUARD_DATA_DIR=str(tmp_path))
    with guard_serve(env) as url, httpx.Client(base_url=url) as client:
        earlier = sum(
            client.get(f"/records/earlier-{i}").headers["x-guard"] == "blocked" for i in range(50)
        )
        run = run_module(
            "app.cli", "attack", "--url", url, "--duration", "1", "--rate", "40", env=env
        )
    assert run.returncode == 0, run.stderr
    line = re.compile(
        r"^this run: ([\d,]+) requests: ([\d,]+) blocked, [\d,]+ passed, [\d,]+ bypassed, "
        r"[\d,]+ errors; "
        r"server totals: ([\d,]+) blocked, [\d,]+ passed, [\d,]+ database queries$"
    )
    logged = [m for m in map(line.match, run.stdout.splitlines()) if m]
    assert logged, run.stdout
    requests, blocked, server_blocked = (int(g.replace(",", "")) for g in logged[-1].groups())
    assert blocked <= requests and server_blocked >= earlier  # the totals count earlier clients
    assert "server totals" in run.stdout.split(logged[-1][0])[-1]  # the final table, too
