"""One run of the core benchmark: measure every section, print it, write the report and plots."""

from __future__ import annotations

import os
import platform
import secrets
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

import guard
from bench import core, report
from bench.core import Bench

REPO = Path(__file__).resolve().parents[1]


def git(*args: str) -> bytes:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, check=True).stdout


def guard_provenance() -> str:
    """Which guard code ran: the commit, and whether the imported files match it byte for byte.

    The imported package may be a snapshot outside the work tree (PYTHONPATH), so its files are
    compared with the commit's instead of asking git about the work tree.
    """
    root = Path(guard.__file__).parent
    try:
        commit = git("rev-parse", "--short", "HEAD").decode().strip()
        differ = []
        for path in sorted([*root.glob("*.py"), *root.glob("lua/*.lua")]):
            rel = path.relative_to(root).as_posix()
            try:
                same = git("show", f"HEAD:guard/{rel}") == path.read_bytes()
            except subprocess.CalledProcessError:
                same = False  # a file the commit does not have
            if not same:
                differ.append(rel)
    except (OSError, subprocess.CalledProcessError):
        return f"unknown (imported from {root})"
    state = f"differs in {', '.join(differ)}" if differ else "identical to the commit"
    return f"{commit}; imported guard ({root}) {state}"


def environment(r: redis.Redis, url: str) -> dict[str, str]:
    server = r.info("server")
    memory = r.info("memory")
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    commit = guard_provenance()
    return {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs ({cpu}), {platform.system()} "
        f"{platform.release()}",
        "python": platform.python_version(),
        "redis-py": f"{redis.__version__} (hiredis: {redis.utils.HIREDIS_AVAILABLE})",
        "redis server": f"{server['redis_version']} ({memory.get('mem_allocator', '?')}), "
        f"{url.split('@')[-1]}",
        "guard commit": commit,
        # Other work on this machine shares its CPUs with client and server alike.
        "load average at start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }


def run(url: str, *, quick: bool, out: str | None) -> int:
    started = time.perf_counter()
    r = redis.Redis.from_url(url)
    bench = Bench(
        r, f"bench:core:{os.getpid()}-{secrets.token_hex(3)}:", core.QUICK if quick else core.FULL
    )
    env = environment(r, url)
    rb = core.redisbloom_loaded(r)
    results: dict[str, Any] = {}
    steps: list[tuple[str, Callable[[], Any]]] = [
        ("memory", lambda: core.measure_memory(bench, rb)),
        ("error_rates", lambda: core.measure_error_rates(bench)),
        ("load", lambda: core.measure_load(bench)),
        ("fit", lambda: core.measure_fit(bench)),
        ("fpr", lambda: core.measure_fpr(bench)),
        ("throughput", lambda: core.measure_throughput(bench)),
    ]
    try:
        for name, step in steps:
            t0 = time.perf_counter()
            results[name] = step()
            bench.seconds[name] = time.perf_counter() - t0
            print(report.section(name, results[name]), flush=True)
    finally:
        left = bench.cleanup()
        if left:
            print(f"(deleted {left} leftover benchmark keys)")
    total = time.perf_counter() - started
    doc = report.document(
        results,
        env=env,
        quick=quick,
        redisbloom=rb,
        seconds=bench.seconds,
        total=total,
        scale=bench.scale,
    )
    print(report.summary(results))
    print(f"total time: {total:.0f} s")
    if out:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        from bench import plots  # matplotlib only when files are written

        plots.write(results, path.parent / "img")
        path.write_text(doc)
        print(f"wrote {path} and plots in {path.parent / 'img'}")
    return 0
