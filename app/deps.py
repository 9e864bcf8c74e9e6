"""Request dependencies: settings, clients built by the lifespan, auth, filter handles, limits."""

from __future__ import annotations

import hmac
import re
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Annotated, Any

import redis.asyncio as aioredis
from fastapi import Depends, HTTPException, Path, Request
from fastapi.exceptions import RequestValidationError
from pydantic import TypeAdapter, ValidationError
from starlette.requests import HTTPConnection

from app.db import Database
from app.errors import BadInput, Conflict
from app.idempotency import Idempotency
from app.metrics import Metrics
from app.openapi import LIMIT_KEY
from app.records import RecordStore, Tables
from app.settings import Settings
from guard import CuckooFilter
from guard.ages import Rollback
from guard.names import NAME_PATTERN as FILTER_NAME

NAME_PATTERN = FILTER_NAME.pattern  # the library's own rule, so the 422 and the library agree


def app_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


# Dependencies are `async def`: FastAPI runs plain `def` ones in a worker thread, and that
# hand-off cost a third of a lookup request's time (py-spy, docs/benchmarks.md).
async def get_settings(request: Request) -> Settings:
    return app_settings(request)


async def get_metrics(request: Request) -> Metrics:
    metrics: Metrics = request.app.state.metrics
    return metrics


def _lifespan_state(request: HTTPConnection, name: str) -> Any:
    # The scope's copy of the lifespan state, which request.state wraps (in two objects made
    # per request: this is on the item lookup's path).
    try:
        return request.scope["state"][name]
    except KeyError:  # the app was called without running its lifespan
        raise RuntimeError(f"{name} is not set up: run the app with its lifespan") from None


async def get_redis(request: Request) -> aioredis.Redis:
    redis: aioredis.Redis = _lifespan_state(request, "redis")
    return redis


async def get_db(request: Request) -> Database:
    db: Database = _lifespan_state(request, "db")
    return db


async def get_records(request: Request) -> RecordStore:
    records: RecordStore = _lifespan_state(request, "records")
    return records


async def get_tables(request: Request) -> Tables:
    tables: Tables = _lifespan_state(request, "tables")
    return tables


async def get_idempotency(request: Request) -> Idempotency:
    idem: Idempotency = _lifespan_state(request, "idempotency")
    return idem


SettingsDep = Annotated[Settings, Depends(get_settings)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
RedisDep = Annotated[aioredis.Redis, Depends(get_redis)]
DbDep = Annotated[Database, Depends(get_db)]
RecordsDep = Annotated[RecordStore, Depends(get_records)]
TablesDep = Annotated[Tables, Depends(get_tables)]
IdempotencyDep = Annotated[Idempotency, Depends(get_idempotency)]
FilterName = Annotated[str, Path(pattern=NAME_PATTERN, description="Filter name")]
# A record key in the path; check_item enforces what the schema states.
ItemPath = Annotated[str, Path(json_schema_extra={LIMIT_KEY: "item"})]


class FilterHandles:
    """Filter handles kept between requests: a handle caches its filter's layout, so a fresh
    one would spend an extra round trip learning it on every request."""

    MAX = 1024

    def __init__(
        self,
        redis: aioredis.Redis,
        prefix: str,
        preset: list[CuckooFilter],
        coalesce: bool = True,
        on_rollback: Callable[[Rollback], None] | None = None,
    ) -> None:
        self.redis = redis
        self.prefix = prefix
        self.coalesce = coalesce
        # Told of each rollback a lookup meets (guard/ages.py). A handle dropped from the
        # cache forgets the ages it read: the next one trusts what it reads first.
        self.on_rollback = on_rollback
        self._handles: OrderedDict[str, CuckooFilter] = OrderedDict()
        self._pinned = {cf.name: cf for cf in preset}
        for cf in preset:
            cf.on_rollback = on_rollback

    def get(self, name: str) -> CuckooFilter:
        if name in self._pinned:
            return self._pinned[name]
        handle = self._handles.pop(name, None)
        if handle is None:
            handle = CuckooFilter(self.redis, name, self.prefix, coalesce=self.coalesce)
            handle.on_rollback = self.on_rollback
        self._handles[name] = handle  # most recently used last
        if len(self._handles) > self.MAX:
            self._handles.popitem(last=False)
        return handle

    def pin(self, name: str) -> CuckooFilter:
        """`get`, kept for the service's life: a rule's filter, whose handle the guard holds,
        so the API and /health (`rolled_back`) never use another one for it."""
        handle = self.get(name)
        self._handles.pop(name, None)
        self._pinned[name] = handle
        return handle

    def rolled_back(self) -> list[str]:
        """The filters whose lookups answer "maybe present" since a rollback (guard/ages.py)."""
        handles = [*self._pinned.values(), *self._handles.values()]
        return [cf.name for cf in handles if cf.rolled_back]


async def get_filter_handles(request: Request) -> FilterHandles:
    handles: FilterHandles = _lifespan_state(request, "filters")
    return handles


FiltersDep = Annotated[FilterHandles, Depends(get_filter_handles)]


def filter_handle(request: HTTPConnection, name: str) -> CuckooFilter:
    handles: FilterHandles = _lifespan_state(request, "filters")
    return handles.get(name)


# Not through FiltersDep: FastAPI spends about 10 µs on every dependency it solves.
async def get_filter(name: FilterName, request: Request) -> CuckooFilter:
    return filter_handle(request, name)


FilterDep = Annotated[CuckooFilter, Depends(get_filter)]


async def get_writable_filter(cf: FilterDep, request: Request) -> CuckooFilter:
    """A filter the API may change: not one that follows a table (that would break its
    one-fingerprint-per-row bookkeeping; a deleted fingerprint is a false negative)."""
    tables: Tables = _lifespan_state(request, "tables")
    store = tables.of_filter(cf.name)
    if store is not None:
        raise Conflict(
            f"filter {cf.name!r} follows the {store.settings.records_table} table: change its "
            "rows, or rebuild it"
        )
    return cf


WritableFilterDep = Annotated[CuckooFilter, Depends(get_writable_filter)]


async def get_admin_filter(cf: WritableFilterDep, request: Request) -> CuckooFilter:
    """A writable filter on the admin client (GUARD_REDIS_ADMIN_TIMEOUT), for operations that
    write a whole filter: creating or dropping one."""
    admin: aioredis.Redis = _lifespan_state(request, "admin_redis")
    return CuckooFilter(admin, cf.name, cf.prefix)


AdminFilterDep = Annotated[CuckooFilter, Depends(get_admin_filter)]


def api_key_ok(headers: Mapping[str, str], settings: Settings) -> bool:
    """Whether ``headers`` carry `Authorization: Bearer <GUARD_API_KEY>`."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    expected = settings.api_key.get_secret_value().encode()
    # compare_digest on bytes: constant time, and no crash on non-ASCII input.
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), expected)


def check_api_key(request: HTTPConnection, settings: Settings) -> None:
    """401 unless the request carries `Authorization: Bearer <GUARD_API_KEY>`."""
    if not api_key_ok(request.headers, settings):
        raise HTTPException(
            status_code=401,
            detail="missing or invalid API key",
            headers={"WWW-Authenticate": "Bearer"},
        )


# ---- request checks -----------------------------------------------------------------------


class RequestCheck:
    """A check of what a request says before its body (request line, path parameters,
    headers): it raises the answer (401, 422, ...) or returns.

    Declared as a route dependency (``dependencies=[Auth]``). A route of the CheckedRoute
    class (app/routing.py) runs its checks itself, in the order declared, before FastAPI
    reads the body: FastAPI reads a body before it solves any dependency, so a request
    without the key whose declared body never comes would wait for it, unanswered. On any
    other route a check runs as an ordinary dependency.
    """

    def __init__(self, check: Callable[[HTTPConnection, Settings], None]) -> None:
        self.check = check

    async def __call__(self, request: Request) -> None:
        self.check(request, app_settings(request))


@RequestCheck
def require_api_key(request: HTTPConnection, settings: Settings) -> None:
    """Mutating routes: `Authorization: Bearer <GUARD_API_KEY>` when a key is configured."""
    if settings.auth_enabled:
        check_api_key(request, settings)


@RequestCheck
def require_read_key(request: HTTPConnection, settings: Settings) -> None:
    """Filter reads (listing, info, lookups, checks): the API key too when GUARD_PROTECT_READS
    is on (by default in production)."""
    if settings.reads_need_key:
        check_api_key(request, settings)


_FILTER_NAME = TypeAdapter(FilterName)


@RequestCheck
def valid_filter_name(request: HTTPConnection, settings: Settings) -> None:
    """The path's filter name, checked as FastAPI checks FilterName: the same 422."""
    try:
        _FILTER_NAME.validate_python(request.path_params["name"])
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        raise RequestValidationError([{**e, "loc": ("path", "name")} for e in errors]) from None


# What a client that normalises URL paths (curl, browsers, httpx: RFC 3986 "remove dot
# segments") does to an item sent in a path: '.' and '..' segments go, '..' with the segment
# before it, so the request reaches another path. Such items travel in a body instead.
BATCH_ROUTES = "send it in the body of POST /filters/{name}/add, /check or /delete instead"
DOT_SEGMENT = re.compile(r"(?:^|/)\.\.?(?:/|$)")


@RequestCheck
def valid_path_item(request: HTTPConnection, settings: Settings) -> None:
    """The item of /filters/{name}/items/{item}: 1-GUARD_MAX_ITEM_BYTES bytes of UTF-8, and
    no '.' or '..' segment (between slashes), which URL-normalising clients remove."""
    item: str = request.path_params["item"]
    if not item:
        raise BadInput(
            ("path", "item"),
            f"must be 1-{settings.max_item_bytes} bytes of UTF-8 (got 0); an item '.' is"
            f" removed from the path by clients that normalise URLs: {_batch(request)}",
        )
    check_item(item, settings, ("path", "item"))
    if "." in item and DOT_SEGMENT.search(item):
        raise BadInput(
            ("path", "item"),
            "must not be '.' or '..' or have such a segment between slashes: clients that"
            " normalise URLs (curl, browsers, httpx) rewrite it to another path;"
            f" {_batch(request)}",
        )


def _batch(request: HTTPConnection) -> str:
    return BATCH_ROUTES.format(name=request.path_params["name"])


@RequestCheck
def drop_confirmed(request: HTTPConnection, settings: Settings) -> None:
    """DELETE /filters/{name} drops a whole filter only with `?confirm=<name>`: no request
    for one item can become that, whatever a client does to the item's path."""
    name = request.path_params["name"]
    if request.query_params.get("confirm") != name:
        raise BadInput(
            ("query", "confirm"),
            f"must be the filter's name, to drop it and everything in it:"
            f" DELETE /filters/{name}?confirm={name}. (If one item was meant: an item '..'"
            f" is removed from the path by clients that normalise URLs, leaving this request;"
            f" delete it with POST /filters/{name}/delete.)",
        )


# The item of /filters/{name}/items/{item}; valid_path_item enforces what the schema states.
FilterItem = Annotated[
    str,
    Path(
        description="One item, '/' sent as %2F. Not '.' or '..' nor with such a segment between"
        " slashes: clients that normalise URLs remove those, so such items go in the body of"
        " POST /filters/{name}/add, /check or /delete",
        json_schema_extra={LIMIT_KEY: "item", "not": {"pattern": DOT_SEGMENT.pattern}},
    ),
]

Auth = Depends(require_api_key)
ReadAuth = Depends(require_read_key)
ValidName = Depends(valid_filter_name)
ValidPathItem = Depends(valid_path_item)
DropConfirmed = Depends(drop_confirmed)


def check_item(item: str, settings: Settings, loc: tuple[str | int, ...]) -> None:
    try:
        size = len(item.encode("utf-8"))
    except UnicodeEncodeError:  # a lone surrogate from a JSON "\ud800" escape
        raise BadInput(loc, "must be valid UTF-8 text") from None
    if not 1 <= size <= settings.max_item_bytes:
        raise BadInput(loc, f"must be 1-{settings.max_item_bytes} bytes of UTF-8 (got {size})")


def check_items(items: list[str], settings: Settings) -> None:
    if len(items) > settings.max_batch:
        raise BadInput(
            ("body", "items"), f"at most {settings.max_batch} items per request (got {len(items)})"
        )
    for i, item in enumerate(items):
        check_item(item, settings, ("body", "items", i))
