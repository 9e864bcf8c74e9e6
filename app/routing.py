"""The order the app tries its routes in: lookup routes first, the documentation unchanged.

Starlette tries routes one after another until one matches, and each miss costs about a
microsecond (FastAPI's own match adds to Starlette's). The item lookup was the seventeenth
route tried; first, it serves about 6 % more requests per second (an in-process A/B of the
two orders, 9 rounds). Routes of one path keep their relative order, so a wrong method is
answered exactly as before (405 from the first route of that path).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fastapi import APIRouter, FastAPI
from starlette.routing import BaseRoute

# Busiest first: a filter's item lookup, the batch check, the guarded records.
HOT_PATHS = ("/filters/{name}/items/{item:text}", "/filters/{name}/check", "/records/{key}")


def add_routes(app: FastAPI, routers: Iterable[APIRouter]) -> None:
    """Put the routers' routes on the app's own router, hot paths first.

    Not through include_router: since FastAPI 0.137 that keeps each router as a node that every
    request scans twice (to match, then to dispatch), a fifth of a filter lookup's time
    (py-spy). The routers carry their own prefix and tags, so their routes are complete as
    they are; only app.dependency_overrides would not reach them (nothing here uses it).
    """
    documented = [route for router in routers for route in router.routes]
    hot = sorted(
        (r for r in documented if _path(r) in HOT_PATHS), key=lambda r: HOT_PATHS.index(_path(r))
    )
    # Ahead of FastAPI's own /openapi.json and /docs routes too.
    app.router.routes[:0] = hot
    app.router.routes.extend(r for r in documented if r not in hot)
    order: dict[str, int] = {}  # OpenAPI path -> its place in the documented order
    for route in documented:
        order.setdefault(getattr(route, "path_format", ""), len(order))
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()
            paths = schema.get("paths", {})
            last = len(order)
            schema["paths"] = {p: paths[p] for p in sorted(paths, key=lambda p: order.get(p, last))}
        return app.openapi_schema or {}

    app.openapi = openapi  # type: ignore[method-assign]


def _path(route: BaseRoute) -> str:
    return str(getattr(route, "path", ""))
