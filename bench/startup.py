"""`python -m bench startup`: how long the `guard` command takes to start, and a 1M-key load.

A command with next to nothing to do (`guard --help`, `guard check NAME ITEM` of one item) is
timed from process start to exit, as a shell would see it: what it measures is Python, the
imports and the set-up. Each command runs in a child process, interleaved with the others and
with a bare `python -c pass`, 11 times (3 with --quick); the median is the figure (the machine
is shared: its load average is in the environment table). Bytecode is cached as any installed
command's is after its first run (in a folder of the run's own; one warm-up run first); the
same commands are also timed with no bytecode cache at all (PYTHONDONTWRITEBYTECODE=1 and an
empty cache folder: every module compiled on every run), which is how a session with that
variable set sees a checkout no run has written bytecode for.
`guard load --create` of a file of 1M keys is timed end to end the same way (3 runs after a
warm-up), its rate counted over the whole process.

The pipeline (bench/suite.py) gives the server: a private redis-server unless --redis-url, keys
under the run's own prefix. ``measure(target, quick)`` returns the rows, ``report(rows)`` the
markdown.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.bulk import write_keys
from bench.markdown import Row, figures_report

REPO = Path(__file__).resolve().parents[1]
T_START = 0.35  # seconds: `guard --help`, `guard check NAME ITEM` (issue 27)
T_LOAD_RATE = 1_000_000  # items/s, `guard load --create` of 1M keys with its start-up
FULL = {"runs": 11, "keys": 1_000_000, "loads": 3}
QUICK = {"runs": 3, "keys": 100_000, "loads": 1}
HELP, CHECK, LOAD = "guard --help", "guard check NAME ITEM", "guard load NAME FILE --create"
# What `guard check` cannot do without: its framework and its client (numpy is for batches).
FLOOR = "python -c 'import typer, redis'"


def _guard() -> list[str]:
    """The console script installed beside this Python (what a user runs), else -m app.cli."""
    script = Path(sys.executable).with_name("guard")
    return [str(script)] if script.exists() else [sys.executable, "-m", "app.cli"]


def _env(target: Any, pycache: str, *, write: bool = True) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GUARD_", "PYTHON"))}
    env |= {"GUARD_REDIS_URL": target.url, "GUARD_KEY_PREFIX": target.prefix}
    env["PYTHONPATH"] = str(REPO)
    # Bytecode is read from this folder only: never from the __pycache__ folders beside the
    # sources, which any earlier run (or a test) may have written.
    env["PYTHONPYCACHEPREFIX"] = pycache
    if not write:
        env["PYTHONDONTWRITEBYTECODE"] = "1"  # the folder stays empty: every module compiled
    return env


def _time(argv: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    run = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if run.returncode not in (0, 1):  # check's status 1: an item is absent
        raise RuntimeError(f"{' '.join(argv)} failed: {run.stderr[-2000:]}")
    return seconds


def _medians(commands: dict[str, list[str]], env: dict[str, str], runs: int) -> dict[str, Any]:
    """Each command ``runs`` times, interleaved; per command the median and the fastest."""
    for argv in commands.values():  # warm-up: bytecode written, files in the page cache
        _time(argv, env)
    times: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(runs):
        for name, argv in commands.items():
            times[name].append(_time(argv, env))
    return {name: (statistics.median(ts), min(ts)) for name, ts in times.items()}


def measure(target: Any, quick: bool) -> list[Row]:
    sizes = QUICK if quick else FULL
    guard = _guard()
    target.filter("startup").reserve(1000)
    target.filter("startup").insert("user-1")
    commands = {
        "python -c pass": [sys.executable, "-c", "pass"],
        "python -c 'import guard'": [sys.executable, "-c", "import guard"],
        FLOOR: [sys.executable, "-c", "import typer, redis"],
        HELP: [*guard, "--help"],
        CHECK: [*guard, "check", "startup", "user-1"],
    }
    rows = []
    with tempfile.TemporaryDirectory(prefix="guard-bench-startup-") as tmp:
        for section, pycache, write in (
            ("bytecode cached (as after a command's first run)", tmp, True),
            ("no bytecode cache (PYTHONDONTWRITEBYTECODE=1)", str(Path(tmp, "empty")), False),
        ):
            figures = _medians(commands, _env(target, pycache, write=write), sizes["runs"])
            bare = figures["python -c pass"][0]  # the same run's: the machine's load cancels
            rows += [
                Row(section, name, median, "s",
                    f"fastest {fastest:.3f} s; {median / bare:.1f} times `python -c pass`")
                for name, (median, fastest) in figures.items()
            ]  # fmt: skip
        rows += _load_rows(target, guard, Path(tmp), sizes)
    return rows


def _load_rows(target: Any, guard: list[str], folder: Path, sizes: dict[str, int]) -> list[Row]:
    keys, loads = sizes["keys"], sizes["loads"]
    path = folder / "keys.txt"
    write_keys(path, keys)
    env = _env(target, str(folder / "pycache"))
    argv = [*guard, "load", "big", str(path), "--create"]
    _time(argv, env)  # warm-up: bytecode for the load's modules, the file in the page cache
    seconds = []
    for _ in range(loads):
        target.filter("big").drop()
        seconds.append(_time(argv, env))
    if target.filter("big").info().items != keys:
        raise RuntimeError("the load did not load every key")
    median = statistics.median(seconds)
    section = f"`{LOAD}`, {keys:,} keys, end to end (bytecode cached)"
    return [
        Row(section, "items/s over the whole process", keys / median, "items/s",
            f"{median:.2f} s wall (median of {loads}), fastest {min(seconds):.2f} s"),
    ]  # fmt: skip


def targets(rows: list[Row]) -> list[tuple[str, str, bool]]:
    cached = {r.figure: r for r in rows if r.section.startswith("bytecode cached")}
    (load,) = [r for r in rows if r.unit == "items/s"]
    out = [
        (f"`{name}` ≤ {T_START} s (bytecode cached)", f"{cached[name].value:.3f} s",
         cached[name].value <= T_START)
        for name in (HELP, CHECK)
    ]  # fmt: skip
    out.append(
        (f"`{LOAD}` ≥ {T_LOAD_RATE:,} items/s with its start-up", f"{load.value:,.0f} items/s",
         load.value >= T_LOAD_RATE)
    )  # fmt: skip
    return out


NOTES = (
    "`guard --help` imports typer and app/cli/common.py only: each command's module is imported "
    "when it runs. `guard check` reads its settings without pydantic (app/env.py) and imports "
    "what a lookup of a few items needs: redis-py and mmh3, not numpy (imported by the batch "
    f"paths when first used); `{FLOOR}` is that floor. redis-py 8.1 imports its asyncio client, "
    "its cluster client and OpenTelemetry whatever part of it is imported (redis/__init__.py, "
    "redis.commands.core): most of the floor. "
    "The figures are wall-clock times on a shared 2-core machine: compare them with "
    "`python -c pass` of the same run, not across runs."
)


def _value(row: Row) -> str:
    return f"{row.value:,.0f}" if row.unit == "items/s" else f"{row.value:.3f} s"


def report(rows: list[Row]) -> str:
    """The markdown of docs/bench-startup.md (the pipeline adds the title and environment)."""
    return figures_report(__doc__ or "", targets(rows), NOTES, rows, _value)
