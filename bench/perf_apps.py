"""The ASGI apps `python -m bench perf` serves with uvicorn: the service and two baselines.

Each is a factory (`uvicorn bench.perf_apps:service --factory`), configured by environment:

* `service`: `app.main.create_app()` as it ships. `PERF_GUARD=0` removes the guard middleware
  (every read goes to cache and database: the "without the guard" run of the attack test);
  `PERF_COALESCE=0` builds every filter handle without auto-batching, for as long as the
  service has no setting of its own for it (see `bench.perf_http.batching_env`).
* `baseline`: a bare FastAPI app with the routes the issue compares against, served the same
  way: `GET /get/{key}` does one Redis `GET`; `GET /cf/{key}` does one `CF.EXISTS` when
  RedisBloom is loaded, else one `GET` (the issue's fallback).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from guard.connect import connect_async


def _off(name: str) -> bool:
    return os.environ.get(name, "1").lower() in ("0", "false", "no", "off")


def service() -> Any:
    if _off("PERF_COALESCE"):
        from guard import filter as gf

        # Only when the handle has the switch; an older guard has no batching to turn off.
        defaults = gf.CuckooFilter.__init__.__kwdefaults__ or {}
        if "coalesce" in defaults:
            defaults["coalesce"] = False
    from app.main import create_app
    from guard.middleware import GuardMiddleware

    app = create_app()
    if _off("PERF_GUARD"):
        # The middleware stack is built on the first request, so this removes the guard fully.
        app.user_middleware = [m for m in app.user_middleware if m.cls is not GuardMiddleware]
    return app


def baseline() -> FastAPI:
    url = os.environ["PERF_REDIS_URL"]
    prefix = os.environ.get("PERF_PREFIX", "bench:perf:")
    cf_key = os.environ.get("PERF_CF_KEY", "")  # set only when RedisBloom is loaded
    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Packed by hiredis, as the service's own client is: the same client on both sides.
        state["r"] = connect_async(url, socket_timeout=1.0)
        yield
        await state["r"].aclose()

    app = FastAPI(lifespan=lifespan)

    @app.get("/get/{key}")
    async def get(key: str) -> dict[str, Any]:
        value = await state["r"].get(prefix + key)
        return {"key": key, "exists": value is not None}

    @app.get("/cf/{key}")
    async def cf_exists(key: str) -> dict[str, Any]:
        if cf_key:
            found = await state["r"].execute_command("CF.EXISTS", cf_key, key)
        else:
            found = await state["r"].get(prefix + key) is not None
        return {"key": key, "exists": bool(found)}

    return app


def coalesce_switch() -> bool:
    """True when the library's async handle can turn auto-batching off."""
    from guard import filter as gf

    return "coalesce" in inspect.signature(gf.CuckooFilter.__init__).parameters
