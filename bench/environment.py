"""What a benchmark ran on: the guard code (commit, and whether the imported files match it),
the machine, Python, redis-py and the Redis server. Written once into every report."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path

import redis

import guard

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


def loadavg() -> str:
    """The 1, 5 and 15-minute load averages: other work on this machine shares its CPUs."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def environment(r: redis.Redis, url: str) -> dict[str, str]:
    """Rows of the report's environment table, for a run against the server at ``url``."""
    server = r.info("server")
    memory = r.info("memory")
    return {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs ({cpu_model()}), "
        f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "redis-py": f"{redis.__version__} (hiredis: {redis.utils.HIREDIS_AVAILABLE})",
        "redis server": f"{server['redis_version']} ({memory.get('mem_allocator', '?')}), "
        f"{url.split('@')[-1]}",
        "guard commit": guard_provenance(),
        # Other work on this machine shares its CPUs with client and server alike.
        "load average at start": loadavg(),
    }
