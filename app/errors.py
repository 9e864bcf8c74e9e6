"""The one place where errors become HTTP answers (and where oversized bodies get their 413)."""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import unquote_to_bytes

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from guard import (
    FilterCorruptError,
    FilterExistsError,
    FilterFullError,
    FilterNotFoundError,
    GuardError,
    InvalidParameterError,
)

log = logging.getLogger(__name__)

DAMAGED_LOG_EVERY_S = 60.0


class BadInput(Exception):
    """Input the schema accepted but a limit rejects: 422 naming the field and the limit."""

    def __init__(self, loc: tuple[str | int, ...], msg: str) -> None:
        super().__init__(msg)
        self.loc = loc
        self.msg = msg


RESERVE_FIELDS = frozenset(
    {"capacity", "error_rate", "fingerprint_bits", "bucket_size", "max_kicks", "expansion"}
)


class Conflict(Exception):
    """The request clashes with the resource's state: 409."""


class InDoubt(Exception):
    """Redis took a command but did not answer in time, so it may have run: 504, never a
    "failed" answer (a client retrying a create that happened would believe it lost)."""


@asynccontextmanager
async def in_doubt_on_timeout(what: str, outcome: str) -> AsyncIterator[None]:
    """Turn a Redis timeout inside the block into InDoubt: "<what>: ... <outcome>"."""
    try:
        yield
    except RedisTimeoutError as exc:
        raise InDoubt(
            f"{what}: Redis did not answer in time, so it may have happened; {outcome}"
        ) from exc


# ---- response bodies, for OpenAPI ---------------------------------------------------------


class ErrorBody(BaseModel):
    detail: str


class FullBody(BaseModel):
    detail: str
    results: list[bool]


class FieldError(BaseModel):
    loc: list[str | int]
    msg: str
    type: str


class ValidationBody(BaseModel):
    detail: list[FieldError]


Responses = dict[int | str, dict[str, Any]]


def _doc(status: int, model: type[BaseModel], description: str) -> Responses:
    return {status: {"model": model, "description": description}}


UNAUTHORIZED = _doc(401, ErrorBody, "Missing or wrong `Authorization: Bearer <GUARD_API_KEY>`")
NOT_FOUND = _doc(404, ErrorBody, "No such filter")
CONFLICT = _doc(409, ErrorBody, "Conflicts with the current state")
TOO_LARGE = _doc(413, ErrorBody, "Request body over GUARD_MAX_BODY_BYTES")
INVALID = _doc(422, ValidationBody, "Bad input; `loc` names the field, `msg` the limit")
FULL = _doc(507, FullBody, "Fixed-size filter is full; `results` says which items were added")
UNAVAILABLE = _doc(503, ErrorBody, "Redis unreachable; retry after `Retry-After` seconds")
IN_DOUBT = _doc(
    504,
    ErrorBody,
    "Redis did not answer in time: the operation may have taken effect (the message says how"
    " to check; a retry is safe)",
)
DAMAGED = _doc(
    500,
    ErrorBody,
    "The filter's data in Redis is damaged (truncated, overwritten, or a key of another type):"
    " drop it, or rebuild it; retrying does not help",
)
COMMON: Responses = {**INVALID, **UNAVAILABLE, **DAMAGED}


# ---- mapping --------------------------------------------------------------------------


def _json(status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(body, status_code=status, headers=headers)


def _invalid(loc: list[str | int], msg: str) -> JSONResponse:
    """422 in FastAPI's own shape, so clients parse one format for every bad input."""
    return _json(422, {"detail": [{"loc": loc, "msg": msg, "type": "value_error"}]})


_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")


def damaged_filter(exc: FilterCorruptError) -> str:
    """The filter's name, as the library gives it (never a key name)."""
    return exc.filter if _NAME.fullmatch(exc.filter) else "?"


def error_response(exc: BaseException, retry_after: int = 1) -> JSONResponse | None:
    """The HTTP answer for a domain or Redis error; None for anything else (a real bug)."""
    if isinstance(exc, BadInput):
        return _invalid(list(exc.loc), exc.msg)
    if isinstance(exc, InvalidParameterError):
        # The library's messages start with the parameter's name: point `loc` at it.
        name = str(exc).split(" ", 1)[0]
        return _invalid(["body", name] if name in RESERVE_FIELDS else ["body"], str(exc))
    if isinstance(exc, FilterNotFoundError):
        return _json(404, {"detail": str(exc)})
    if isinstance(exc, InDoubt):
        return _json(504, {"detail": str(exc)})
    if isinstance(exc, FilterExistsError | Conflict):
        return _json(409, {"detail": str(exc)})
    if isinstance(exc, FilterFullError):
        return _json(507, {"detail": str(exc), "results": list(exc.results)})
    if isinstance(exc, ResponseError) and str(exc).startswith("OOM"):
        return _json(507, {"detail": "Redis is out of memory (maxmemory)"})
    if isinstance(exc, RedisConnectionError | RedisTimeoutError | ReadOnlyError):
        headers = {"Retry-After": str(retry_after)}
        return _json(503, {"detail": "Redis unavailable"}, headers)
    if isinstance(exc, FilterCorruptError):
        # The library's message names Redis keys: it goes to the log, not to the client.
        name = damaged_filter(exc)
        return _json(500, {"detail": f"filter {name!r} is damaged in Redis; drop it or rebuild it"})
    if isinstance(exc, GuardError):
        return _json(500, {"detail": "Internal Server Error"})
    return None


def finite_json(value: Any) -> bool:
    """Whether `value` is JSON: no NaN or Infinity, nothing of another type."""
    try:
        json.dumps(value, allow_nan=False)
    except (ValueError, TypeError):
        return False
    return True


def validation_response(exc: RequestValidationError) -> JSONResponse:
    """FastAPI's 422, minus any echoed `input`/`ctx` that JSON cannot carry: a NaN or Infinity
    the request sent made the default handler's own rendering fail, turning a 422 into a 500."""
    detail = []
    for entry in jsonable_encoder(exc.errors()):
        for extra in ("input", "ctx"):
            if extra in entry and not finite_json(entry[extra]):
                del entry[extra]
        detail.append(entry)
    return _json(422, {"detail": detail})


def install(app: FastAPI, retry_after: int) -> None:
    """Register the handlers that turn domain and Redis errors into answers."""

    damaged_logged: dict[str, float] = {}  # filter -> when its damage was last logged

    async def handle(request: Request, exc: Exception) -> JSONResponse:
        response = error_response(exc, retry_after)
        if response is None:  # an unexpected Redis reply: a bug, so a logged 500
            log.error("%s %s: %r", request.method, request.url.path, exc)
            return _json(500, {"detail": "Internal Server Error"})
        if response.status_code in (503, 504):
            request.app.state.metrics.redis_error("api")
            if response.status_code == 504:
                log.warning("%s %s: %s", request.method, request.url.path, exc)
        elif isinstance(exc, FilterCorruptError):
            # Every request on a damaged filter fails the same way until someone repairs it:
            # log the details once per filter and minute, not once per request.
            request.app.state.metrics.filter_failure("api", "damaged")
            name, now = damaged_filter(exc), time.monotonic()
            if now - damaged_logged.get(name, -DAMAGED_LOG_EVERY_S) >= DAMAGED_LOG_EVERY_S:
                damaged_logged[name] = now
                log.error("filter %r is damaged in Redis (%s %s): %s", name,
                          request.method, request.url.path, exc)  # fmt: skip
        elif response.status_code == 500:  # 507 (full) is an expected answer, not a fault
            log.error("%s %s: %r", request.method, request.url.path, exc)
        return response

    async def http_error(request: Request, exc: Exception) -> Any:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 400:  # FastAPI could not decode the body (e.g. invalid UTF-8)
            return _invalid(["body"], "must be a JSON document in valid UTF-8")
        return await http_exception_handler(request, exc)

    async def invalid(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return validation_response(exc)

    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, invalid)
    for exc_type in (
        BadInput,
        Conflict,
        InDoubt,
        GuardError,
        RedisConnectionError,
        RedisTimeoutError,
        ResponseError,
    ):
        app.add_exception_handler(exc_type, handle)


# ---- body size ----------------------------------------------------------------------------


class BodyLimitMiddleware:
    """413 for a request body over `max_bytes`, checked before the app parses anything.

    The body is read here (it is read whole by the app anyway) so an over-long chunked body
    gets a clean 413 too, instead of an error half-way through parsing.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break  # client went away; let the app see the disconnect
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._too_large(send)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                message = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return message
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, send: Send) -> None:
        response = _json(
            413, {"detail": f"request body is over the limit of {self.max_bytes} bytes"}
        )
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": response.raw_headers,
            }
        )
        await send({"type": "http.response.body", "body": bytes(response.body)})


# ---- URL encoding -------------------------------------------------------------------------


def _utf8(raw: bytes) -> bool:
    try:
        unquote_to_bytes(raw).decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _path_param(routes: Sequence[BaseRoute], scope: Scope, index: int) -> list[str | int]:
    """`loc` of the path segment at `index`: ["path", <parameter>] when a route names it."""
    for route in routes:
        match, _ = route.matches(scope)
        if match == Match.NONE:
            continue
        for i, part in enumerate(str(getattr(route, "path", "")).split("/")):
            if part.startswith("{") and part.endswith("}"):
                name, _, kind = part[1:-1].partition(":")
                if i == index or (kind == "path" and i < index):
                    return ["path", name]
        break
    return ["path"]


class Utf8Middleware:
    """422 for a path or query that is not UTF-8 once percent-decoded (`%FF`, `%C0%AF`, an
    encoded surrogate `%ED%A0%80`). The server decodes those to U+FFFD, so `/records/%FF` and
    `/records/%FE` would be one and the same key."""

    MSG = "must be valid UTF-8 once percent-decoded"

    def __init__(self, app: ASGIApp, routes: Sequence[BaseRoute]) -> None:
        self.app = app
        self.routes = routes  # the app's own list, read per bad request to name the parameter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            loc = self._bad(scope)
            if loc is not None:
                await _invalid(loc, self.MSG)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _bad(self, scope: Scope) -> list[str | int] | None:
        raw_path: bytes = scope.get("raw_path") or scope["path"].encode()
        raw_path = raw_path.partition(b"?")[0]  # some servers and test clients keep the query
        for index, segment in enumerate(raw_path.split(b"/")):
            if not _utf8(segment):
                return _path_param(self.routes, scope, index)
        for pair in scope.get("query_string", b"").split(b"&"):
            key, _, value = pair.replace(b"+", b" ").partition(b"=")
            if not _utf8(key):
                return ["query"]
            if not _utf8(value):
                return ["query", unquote_to_bytes(key).decode()]
        return None
