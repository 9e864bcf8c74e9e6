"""HTTP load for `python -m bench perf`: uvicorn subprocesses, wrk runs, a small async client.

wrk (Debian package `wrk`) drives the throughput tables: it is a C load generator, so the
client costs the 2-core machine little. The attack test needs to know, per request, whether
it was legitimate, so it uses the async HTTP/1.1 keep-alive client below (uvloop).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from devkit.processes import HttpProcess, free_port

REPO = Path(__file__).resolve().parents[1]
# The service's own flags (docs/service.md): one worker, uvloop, httptools.
UVICORN_FLAGS = ["--workers", "1", "--loop", "uvloop", "--http", "httptools", "--no-access-log"]


def start_uvicorn(
    name: str, target: str, env: dict[str, str], ready: str, workdir: Path
) -> HttpProcess:
    """``uvicorn <target> --factory`` with the service's flags, its log in ``workdir``."""
    port = free_port()
    cmd = [sys.executable, "-m", "uvicorn", target, "--factory", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), *UVICORN_FLAGS, "--log-level", "warning"]
    full_env = {**os.environ, **env, "PYTHONPATH": str(REPO)}
    try:
        return HttpProcess.start(
            cmd, port=port, env=full_env, ready=ready, log=workdir / f"{name}.log",
            timeout=60, cwd=REPO,
        )  # fmt: skip
    except RuntimeError as exc:
        raise RuntimeError(f"{name} did not start: {exc}") from None


def get_json(server: HttpProcess, path: str) -> Any:
    with urllib.request.urlopen(server.url + path, timeout=30) as resp:
        return json.loads(resp.read())


# -- wrk ----------------------------------------------------------------------------------------

# {method}, {path_fmt} (one %d), {n}: random integer in 1..n per request; {bodies}: a Lua table
# of request bodies taken in turn (empty for GET); {extra}: headers whose values are formats of
# the same integer (a gateway's X-Original-URI). done() prints one JSON line we parse.
WRK_SCRIPT = """
math.randomseed({seed})
local bodies = {{ {bodies} }}
local extra = {{ {extra} }}
local k = 0
local headers = {{ ["Content-Type"] = "application/json" }}
request = function()
  local n = math.random(1, {n})
  local path = string.format("{path_fmt}", n)
  if next(extra) ~= nil then
    local h = {{}}
    for name, fmt in pairs(extra) do h[name] = string.format(fmt, n) end
    return wrk.format("{method}", path, h)
  end
  if #bodies == 0 then return wrk.format("{method}", path) end
  k = k % #bodies + 1
  return wrk.format("{method}", path, headers, bodies[k])
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRKJSON {{"requests": %d, "duration_us": %d, "errors": %d, "status_errors": %d, '
    .. '"p50_us": %d, "p99_us": %d, "mean_us": %.1f}}\\n',
    summary.requests, summary.duration, e.connect + e.read + e.write + e.timeout, e.status,
    latency:percentile(50), latency:percentile(99), latency.mean))
end
"""


@dataclass(frozen=True)
class WrkCase:
    key: str  # what the report looks the route up by
    name: str
    server: str  # key into the running servers
    path_fmt: str  # "/records/absent-%d"
    n: int  # the %d is uniform in 1..n
    connections: int
    method: str = "GET"
    bodies: tuple[str, ...] = ()
    headers: tuple[tuple[str, str], ...] = ()  # (name, value format with one %d)


@dataclass(frozen=True)
class WrkResult:
    key: str
    name: str
    connections: int
    requests: int
    seconds: float
    errors: int
    status_errors: int  # non-2xx/3xx answers: expected for the blocked path (404)
    p50_ms: float
    p99_ms: float
    load: str  # 1-minute load average when the run started
    batching: str = ""  # "on" / "off" in the auto-batching table

    @property
    def rps(self) -> float:
        return self.requests / self.seconds

    @property
    def label(self) -> str:
        return f"{self.name} [batching {self.batching}]" if self.batching else self.name


def wrk_path() -> str | None:
    return shutil.which("wrk")


def have_wrk() -> bool:
    return wrk_path() is not None


def run_wrk(case: WrkCase, base: str, seconds: int, seed: int, workdir: Path) -> WrkResult:
    bodies = ", ".join("[[" + b + "]]" for b in case.bodies)
    extra = ", ".join(f'["{name}"] = "{fmt}"' for name, fmt in case.headers)
    script = WRK_SCRIPT.format(
        seed=seed, bodies=bodies, extra=extra, method=case.method, path_fmt=case.path_fmt,
        n=case.n,
    )  # fmt: skip
    path = workdir / f"wrk-{abs(hash(case.name))}.lua"
    path.write_text(script)
    load = f"{os.getloadavg()[0]:.2f}"
    cmd = ["wrk", "-t1", f"-c{case.connections}", f"-d{seconds}s", "-s", str(path), base]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60, check=True)
    line = next(x for x in out.stdout.splitlines() if x.startswith("WRKJSON "))
    data = json.loads(line.removeprefix("WRKJSON "))
    return WrkResult(
        case.key,
        case.name,
        case.connections,
        data["requests"],
        data["duration_us"] / 1e6,
        data["errors"],
        data["status_errors"],
        data["p50_us"] / 1000,
        data["p99_us"] / 1000,
        load,
    )


# -- a small async HTTP/1.1 client --------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    kind: str
    status: int
    seconds: float


async def _worker(
    host: str, port: int, next_request: Callable[[], tuple[str, str] | None], out: list[Sample]
) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        while (req := next_request()) is not None:
            kind, path = req
            t0 = time.perf_counter()
            writer.write(f"GET {path} HTTP/1.1\r\nHost: bench\r\n\r\n".encode())
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head[9:12])
            length = 0
            for line in head.split(b"\r\n"):
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            await reader.readexactly(length)
            out.append(Sample(kind, status, time.perf_counter() - t0))
    finally:
        writer.close()


async def _load(port: int, requests: list[tuple[str, str]], concurrency: int) -> list[Sample]:
    it = iter(requests)
    out: list[Sample] = []
    await asyncio.gather(
        *(_worker("127.0.0.1", port, lambda: next(it, None), out) for _ in range(concurrency))
    )
    return out


def http_load(port: int, requests: list[tuple[str, str]], concurrency: int) -> list[Sample]:
    """Send `(kind, path)` GETs over `concurrency` keep-alive connections; one sample each."""
    try:
        import uvloop

        return uvloop.run(_load(port, requests, concurrency))
    except ImportError:  # pragma: no cover - uvloop comes with uvicorn[standard]
        return asyncio.run(_load(port, requests, concurrency))


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def temp_workdir() -> tempfile.TemporaryDirectory[str]:
    return tempfile.TemporaryDirectory(prefix="guard-perf-")


def interleaved_latency(
    ports: tuple[int, int], path_fmt: str, n: int, blocks: int, per_block: int, seed: int = 1
) -> tuple[list[float], list[float]]:
    """Seconds per request at one connection to each of two services, taken in turns.

    `blocks` turns of `per_block` sequential keep-alive GETs each, the first service first on
    even turns and second on odd ones: what drifts on the machine meanwhile (load, CPU clock,
    what ran just before) falls on both alike, which separate runs a few seconds apart cannot
    promise for a p99 under a millisecond.
    """
    rng = random.Random(seed)
    conns = [http.client.HTTPConnection("127.0.0.1", port, timeout=10) for port in ports]
    out: tuple[list[float], list[float]] = ([], [])
    try:
        for block in range(blocks):
            for side in (0, 1) if block % 2 == 0 else (1, 0):
                conn = conns[side]
                for _ in range(per_block):
                    path = path_fmt % rng.randint(1, n)
                    t0 = time.perf_counter()
                    conn.request("GET", path)
                    conn.getresponse().read()
                    out[side].append(time.perf_counter() - t0)
    finally:
        for conn in conns:
            conn.close()
    return out
