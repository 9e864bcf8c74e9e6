"""`python -m bench gateway`: the guard as nginx's authorisation hop (docs/gateway.md), measured
with wrk through real nginx, every comparison in the same run, its two sides taken in turns.

(a) Blocked requests per second: nginx running deploy/nginx/gateway.conf (a sub-request to the
    guard per request) against nginx answering the same 404 itself.
(b) What the guard hop adds to a present key: nginx + guard -> backend against nginx ->
    backend directly, p50 and p99 at moderate load (wrk, a few connections) and at one
    sequential connection.
(c) The gateway route's own rate (wrk straight at /authz/nginx) against a bare ASGI app
    answering 204, served by uvicorn with the same flags.

The guard is the service as it ships (the default rule: /records/{key}, its SQLite table),
one uvicorn worker; nginx keeps its connections to the guard and the backend open
(``keepalive 32`` in gateway.conf).
"""

from __future__ import annotations

import os
import statistics
import subprocess
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from bench import perf_http
from bench.markdown import table
from bench.suite import Target
from devkit.gateways import Nginx, start_backend, start_nginx, start_nginx_gateway
from devkit.processes import HttpProcess, free_port
from guard.connect import connect_async

ROWS = 10_000  # demo records user-1 .. user-N: the present keys


@dataclass(frozen=True)
class Scale:
    seconds: int  # per wrk run
    rounds: int  # each case this many times, in alternating order
    busy: int  # wrk connections for the throughput cases
    moderate: int  # ... for the latency case
    sequential: int  # requests per side at one connection, in blocks of 100


QUICK = Scale(seconds=1, rounds=3, busy=32, moderate=4, sequential=1_000)
FULL = Scale(seconds=10, rounds=3, busy=32, moderate=4, sequential=10_000)


def _answering_204(before: Callable[[], Awaitable[Any]] | None = None) -> Any:
    """An ASGI app answering 204 for anything (200 at /health, for the readiness probe), no
    framework, after awaiting ``before()`` when given."""
    no_content: dict[str, Any] = {"type": "http.response.start", "status": 204, "headers": []}
    ok: dict[str, Any] = {"type": "http.response.start", "status": 200, "headers": []}
    body: dict[str, Any] = {"type": "http.response.body", "body": b""}

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            if before is not None:
                await before()
            await send(ok if scope["path"] == "/health" else no_content)
            await send(body)

    return app


def bare_app() -> Any:
    """`uvicorn bench.gateway:bare_app --factory`: the least an authorisation hop on uvicorn
    can cost."""
    return _answering_204()


def redis_app() -> Any:
    """`uvicorn bench.gateway:redis_app --factory`: as `bare_app`, after one Redis GET per
    request (redis-py's asyncio client, as the guard uses it; GUARD_REDIS_URL): the least an
    authorisation hop that asks Redis costs, before it looks anything up."""
    redis = connect_async(os.environ["GUARD_REDIS_URL"])
    return _answering_204(partial(redis.get, "bench:gateway:nothing"))


def nginx_alone(workdir: Path) -> Nginx:
    """nginx answering the gateway's blocked 404 itself, no sub-request."""
    port = free_port()
    http = (
        f"server {{\n    listen 127.0.0.1:{port};\n"
        "    location = / { return 200; }\n"
        "    location / {\n        default_type application/json;\n"
        "        add_header X-Guard blocked always;\n"
        '        return 404 \'{"detail":"Not Found"}\';\n    }\n}\n'
    )
    return start_nginx(workdir, http, port)


def nginx_direct(workdir: Path, backend: Nginx) -> Nginx:
    """nginx proxying to the backend as gateway.conf does, without asking the guard."""
    port = free_port()
    http = (
        f"upstream backend {{\n    server 127.0.0.1:{backend.port};\n    keepalive 32;\n}}\n"
        f"server {{\n    listen 127.0.0.1:{port};\n    location / {{\n"
        '        proxy_http_version 1.1;\n        proxy_set_header Connection "";\n'
        "        proxy_pass http://backend;\n    }\n}\n"
    )
    return start_nginx(workdir, http, port)


def case(key: str, name: str, server: str, path: str, connections: int, **kw: Any) -> Any:
    return perf_http.WrkCase(key, name, server, path, ROWS, connections, **kw)


def cases(s: Scale) -> list[perf_http.WrkCase]:
    absent, present = "/records/absent-%d", "/records/user-%d"
    asked = (("X-Original-URI", present), ("X-Original-Method", "GET"))
    asked_absent = (("X-Original-URI", absent), ("X-Original-Method", "GET"))
    return [
        case("a-guard", "blocked: nginx + guard", "gateway", absent, s.busy),
        case("a-alone", "blocked: nginx answering 404 itself", "alone", absent, s.busy),
        case("b-guard", "present: nginx + guard -> backend", "gateway", present, s.moderate),
        case("b-direct", "present: nginx -> backend", "direct", present, s.moderate),
        case("b-bare", "present: nginx + bare hop -> backend", "barehop", present, s.moderate),
        case("c-route", "route, present key", "guard", "/authz/nginx", s.busy, headers=asked),
        case(
            "c-absent", "route, absent key", "guard", "/authz/nginx", s.busy, headers=asked_absent
        ),
        case("c-bare", "bare ASGI app, 204", "bare", "/authz/nginx", s.busy),
        case("c-redis", "bare ASGI app, one Redis GET, 204", "redis", "/authz/nginx", s.busy),
    ]


def measure(target: Target, quick: bool) -> dict[str, Any]:
    s = QUICK if quick else FULL
    nginx = subprocess.run(["nginx", "-v"], capture_output=True, text=True).stderr.strip()
    target.env["nginx"] = nginx.removeprefix("nginx version: ")
    target.env["wrk"] = perf_http.wrk_path() or "missing"
    with perf_http.temp_workdir() as tmp:
        work = Path(tmp)
        env = {
            "GUARD_REDIS_URL": target.url,
            "GUARD_KEY_PREFIX": f"{target.prefix}gw:",
            "GUARD_DATABASE_URL": f"sqlite:///{work / 'records.db'}",
            "GUARD_DEMO_RECORDS": str(ROWS),
            "GUARD_API_KEY": "",
            "GUARD_LOG_LEVEL": "WARNING",
        }
        stop: list[Any] = []
        try:
            guard = perf_http.start_uvicorn("guard", "app.main:create_app", env, "/health", work)
            stop.append(guard)
            bare = perf_http.start_uvicorn("bare", "bench.gateway:bare_app", {}, "/health", work)
            stop.append(bare)
            redis_hop = perf_http.start_uvicorn(
                "redis", "bench.gateway:redis_app", {"GUARD_REDIS_URL": target.url}, "/health",
                work,
            )  # fmt: skip
            stop.append(redis_hop)
            backend = start_backend(work / "backend")
            stop.append(backend)
            servers: dict[str, HttpProcess | Nginx] = {
                "guard": guard,
                "bare": bare,
                "redis": redis_hop,
                "gateway": start_nginx_gateway(
                    work / "gateway", f"127.0.0.1:{guard.port}", f"127.0.0.1:{backend.port}"
                ),
                "barehop": start_nginx_gateway(
                    work / "barehop", f"127.0.0.1:{bare.port}", f"127.0.0.1:{backend.port}"
                ),
                "alone": nginx_alone(work / "alone"),
                "direct": nginx_direct(work / "direct", backend),
            }
            stop += [servers[k] for k in ("gateway", "barehop", "alone", "direct")]
            return {
                "wrk": _wrk_rounds(s, servers, work),
                "sequential": _sequential(s, servers),
                "scale": s,
            }
        finally:
            for server in reversed(stop):
                server.stop()


def _wrk_rounds(s: Scale, servers: dict[str, Any], work: Path) -> dict[str, perf_http.WrkResult]:
    flat = cases(s)
    for c in flat:  # warm-up: connections, the middleware stack, the filter's layout
        perf_http.run_wrk(c, servers[c.server].url, 1, 1, work)
    rounds: list[dict[str, perf_http.WrkResult]] = []
    for k in range(s.rounds):
        order = flat if k % 2 == 0 else flat[::-1]  # no case always after the same one
        rounds.append({c.key: perf_http.run_wrk(c, servers[c.server].url, s.seconds, k + 1,
                                                work) for c in order})  # fmt: skip
    out = {}
    for c in flat:
        runs = sorted((r[c.key] for r in rounds), key=lambda w: w.rps)
        out[c.key] = replace(
            runs[len(runs) // 2],
            p50_ms=statistics.median(w.p50_ms for w in runs),
            p99_ms=statistics.median(w.p99_ms for w in runs),
        )
    return out


def _sequential(s: Scale, servers: dict[str, Any]) -> dict[str, list[float]]:
    blocks = max(2, s.sequential // 100)
    guarded, direct = perf_http.interleaved_latency(
        (servers["gateway"].port, servers["direct"].port), "/records/user-%d", ROWS,
        blocks=blocks, per_block=100,
    )  # fmt: skip
    bare, direct_again = perf_http.interleaved_latency(
        (servers["barehop"].port, servers["direct"].port), "/records/user-%d", ROWS,
        blocks=blocks, per_block=100,
    )  # fmt: skip
    return {"guard": guarded, "direct": direct, "bare": bare, "direct_again": direct_again}


# -- the report -------------------------------------------------------------------------------


def _ms(x: float) -> str:
    return f"{x:.2f}"


def report(m: dict[str, Any]) -> str:
    w: dict[str, perf_http.WrkResult] = m["wrk"]
    s: Scale = m["scale"]
    seq = {k: [x * 1000 for x in v] for k, v in m["sequential"].items()}
    p = perf_http.percentile
    blocked = w["a-guard"].rps / w["a-alone"].rps
    added50 = w["b-guard"].p50_ms - w["b-direct"].p50_ms
    added99 = w["b-guard"].p99_ms - w["b-direct"].p99_ms
    seq50 = p(seq["guard"], 50) - p(seq["direct"], 50)
    seq99 = p(seq["guard"], 99) - p(seq["direct"], 99)
    bare50 = w["b-bare"].p50_ms - w["b-direct"].p50_ms
    bare99 = w["b-bare"].p99_ms - w["b-direct"].p99_ms
    bare_seq99 = p(seq["bare"], 99) - p(seq["direct_again"], 99)
    route = w["c-route"].rps / w["c-bare"].rps
    redis_floor = w["c-redis"].rps / w["c-bare"].rps
    head = ["case", "connections", "requests/s", "p50 ms", "p99 ms", "non-2xx"]

    def row(key: str) -> list[str]:
        r = w[key]
        return [r.name, str(r.connections), f"{r.rps:,.0f}", _ms(r.p50_ms), _ms(r.p99_ms),
                str(r.status_errors)]  # fmt: skip

    lines = [
        "The guard as nginx's `auth_request` hop (deploy/nginx/gateway.conf), measured with wrk "
        f"(one thread, {s.seconds} s per run, {s.rounds} round(s), the cases in alternating "
        "order; a row is the median round). The guard: `app.main:create_app`, one uvicorn "
        "worker (uvloop, httptools), the default rule (`/records/{key}`), "
        f"{ROWS:,} keys; nginx 1 worker, keepalive 32 to the guard and to the backend (a "
        "second nginx answering 200 itself).",
        "",
        "## Summary",
        "",
        table(
            ["measure", "result", "goal"],
            [
                [
                    "(a) blocked requests/s, nginx + guard / nginx alone",
                    f"{blocked:.2f}x",
                    "report",
                ],
                [
                    f"(b) p50 added by the guard hop, present key, {s.moderate} connections",
                    f"{added50:+.2f} ms",
                    "",
                ],
                [
                    f"(b) p99 added by the guard hop, present key, {s.moderate} connections",
                    f"{added99:+.2f} ms",
                    "<= 1 ms",
                ],
                [
                    "(b) p50 / p99 added, one sequential connection",
                    f"{seq50:+.2f} / {seq99:+.2f} ms",
                    "<= 1 ms p99",
                ],
                [
                    f"(b) for scale: p50 / p99 added by a bare ASGI hop (204, no lookup), "
                    f"{s.moderate} connections; p99 at one sequential connection",
                    f"{bare50:+.2f} / {bare99:+.2f} ms; {bare_seq99:+.2f} ms",
                    "",
                ],
                ["(c) /authz/nginx requests/s / bare ASGI 204", f"{route:.2f}x", ">= 0.5x"],
                [
                    "(c) for scale: bare ASGI app after one Redis GET / bare ASGI 204",
                    f"{redis_floor:.2f}x",
                    "",
                ],
            ],
        ),
        "",
        "## (a) Blocked requests",
        "",
        table(head, [row("a-guard"), row("a-alone")]),
        "",
        "Every answer is the client's 404 (non-2xx counts it); the guard's is nginx's 403 "
        "turned into that 404 by `error_page 403 = @blocked`.",
        "",
        "## (b) Present keys: what the guard hop adds",
        "",
        table(head, [row("b-guard"), row("b-direct"), row("b-bare")]),
        "",
        table(
            ["one sequential connection", "requests", "p50 ms", "p99 ms"],
            [
                [name, str(len(v)), _ms(p(v, 50)), _ms(p(v, 99))]
                for name, v in (
                    ("nginx + guard -> backend", seq["guard"]),
                    ("nginx -> backend", seq["direct"]),
                    ("nginx + bare ASGI hop -> backend", seq["bare"]),
                    ("nginx -> backend (taken in turns with the bare hop)", seq["direct_again"]),
                )
            ],
        ),
        "",
        "The sequential requests alternate between the two in blocks of 100, so what drifts "
        "on the machine falls on both. The bare ASGI hop is `bench.gateway:bare_app` (204 "
        "for anything) behind the same nginx config as the guard: what any hop on uvicorn "
        "adds before it does any work.",
        "",
        "## (c) The authorisation route against a bare ASGI app",
        "",
        table(head, [row("c-route"), row("c-absent"), row("c-bare"), row("c-redis")]),
        "",
        "wrk straight at the guard's `/authz/nginx` with `X-Original-URI` and "
        "`X-Original-Method` (one filter lookup, coalesced with the concurrent ones; the "
        "absent key's answer is 403), against `bench.gateway:bare_app` answering 204 on "
        "uvicorn with the same flags, and `bench.gateway:redis_app`: the same after one "
        "Redis GET per request (redis-py's asyncio client, not coalesced), the least a hop "
        "that asks Redis pays before it looks anything up.",
    ]
    return "\n".join(lines)
