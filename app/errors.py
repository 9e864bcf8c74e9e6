"""The one place where errors become HTTP answers: domain and Redis errors, by type, their
fields read (never their messages parsed), and FastAPI's own 422s."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.db import RecordInputError
from guard import (
    NAME_PATTERN,
    FilterCorruptError,
    FilterExistsError,
    FilterFullError,
    FilterNotFoundError,
    GuardError,
    InvalidParameterError,
)
from guard.params import FIELDS

log = logging.getLogger(__name__)

DAMAGED_LOG_EVERY_S = 60.0


class BadInput(Exception):
    """Input the schema accepted but a limit rejects: 422 naming the field and the limit."""

    def __init__(self, loc: tuple[str | int, ...], msg: str) -> None:
        super().__init__(msg)
        self.loc = loc
        self.msg = msg


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


# ---- mapping --------------------------------------------------------------------------


def json_response(
    status: int, body: dict[str, Any], headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(body, status_code=status, headers=headers)


def invalid(loc: list[str | int], msg: str) -> JSONResponse:
    """422 in FastAPI's own shape, so clients parse one format for every bad input."""
    return json_response(422, {"detail": [{"loc": loc, "msg": msg, "type": "value_error"}]})


def damaged_filter(exc: FilterCorruptError) -> str:
    """The filter's name, as the library gives it (never a key name)."""
    return exc.filter if NAME_PATTERN.fullmatch(exc.filter) else "?"


def error_response(exc: BaseException, retry_after: int = 1) -> JSONResponse | None:
    """The HTTP answer for a domain or Redis error; None for anything else (a real bug)."""
    if isinstance(exc, BadInput | RecordInputError):
        return invalid(list(exc.loc), exc.msg)
    if isinstance(exc, InvalidParameterError):
        # A filter parameter arrives in a request body (PUT /filters/{name}): `loc` names it.
        return invalid(["body", exc.param] if exc.param in FIELDS else ["body"], str(exc))
    if isinstance(exc, FilterNotFoundError):
        return json_response(404, {"detail": str(exc)})
    if isinstance(exc, InDoubt):
        return json_response(504, {"detail": str(exc)})
    if isinstance(exc, FilterExistsError | Conflict):
        return json_response(409, {"detail": str(exc)})
    if isinstance(exc, FilterFullError):
        return json_response(507, {"detail": str(exc), "results": list(exc.results)})
    if isinstance(exc, ResponseError) and str(exc).startswith("OOM"):
        return json_response(507, {"detail": "Redis is out of memory (maxmemory)"})
    if isinstance(exc, RedisConnectionError | RedisTimeoutError | ReadOnlyError):
        headers = {"Retry-After": str(retry_after)}
        return json_response(503, {"detail": "Redis unavailable"}, headers)
    if isinstance(exc, FilterCorruptError):
        # The library's message names Redis keys: it goes to the log, not to the client.
        name = damaged_filter(exc)
        return json_response(
            500, {"detail": f"filter {name!r} is damaged in Redis; drop it or rebuild it"}
        )
    if isinstance(exc, GuardError):
        return json_response(500, {"detail": "Internal Server Error"})
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
    return json_response(422, {"detail": detail})


def install(app: FastAPI, retry_after: int) -> None:
    """Register the handlers that turn domain and Redis errors into answers."""

    damaged_logged: dict[str, float] = {}  # filter -> when its damage was last logged

    async def handle(request: Request, exc: Exception) -> JSONResponse:
        response = error_response(exc, retry_after)
        if response is None:  # an unexpected Redis reply: a bug, so a logged 500
            log.error("%s %s: %r", request.method, request.url.path, exc)
            return json_response(500, {"detail": "Internal Server Error"})
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
            return invalid(["body"], "must be a JSON document in valid UTF-8")
        return await http_exception_handler(request, exc)

    async def validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return validation_response(exc)

    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    for exc_type in (
        BadInput,
        RecordInputError,
        Conflict,
        InDoubt,
        GuardError,
        RedisConnectionError,
        RedisTimeoutError,
        ResponseError,
    ):
        app.add_exception_handler(exc_type, handle)
