"""Input refused before any route parses it: bodies over the size limit (413), paths and
queries that are not UTF-8 (422). Pure ASGI: middleware answers for itself (its exceptions
never reach the app's handlers, but one raised from inside the app does), and runs before
routing."""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import unquote_to_bytes

from starlette.exceptions import HTTPException
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import invalid, json_response


class BodyLimitMiddleware:
    """413 for a request body over `max_bytes`, before the app parses any of it.

    A declared Content-Length over the limit is answered at once. Otherwise the body is
    counted as the app reads it, and the read that passes the limit raises the 413 (an
    HTTPException, which FastAPI hands to the app's handler before parsing anything): an
    over-long chunked body gets a clean 413 too. Never read here in advance: a route answers
    what needs no body (401 for a missing key, app/routing.py) at once, whether the body
    comes or not.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.detail = f"request body is over the limit of {max_bytes} bytes"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            response = json_response(413, {"detail": self.detail})
            await response(scope, receive, send)
            return
        size = 0

        async def counted() -> Message:
            nonlocal size
            message = await receive()
            if message["type"] == "http.request":
                size += len(message.get("body", b""))
                if size > self.max_bytes:
                    raise HTTPException(413, detail=self.detail)
            return message

        await self.app(scope, counted, send)


def _utf8(raw: bytes) -> bool:
    try:
        unquote_to_bytes(raw).decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _plain_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
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
                await invalid(loc, self.MSG)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _bad(self, scope: Scope) -> list[str | int] | None:
        raw_path: bytes = scope.get("raw_path") or scope["path"].encode()
        raw_path = raw_path.partition(b"?")[0]  # some servers and test clients keep the query
        query: bytes = scope.get("query_string", b"")
        if b"%" not in raw_path and b"%" not in query and _plain_utf8(raw_path + query):
            # Nothing percent-encoded and all of it UTF-8: so is every part the loops below
            # would decode ("/", "&", "=", "+" are never inside a UTF-8 character). Every
            # request passes here: this answers the usual one without splitting it.
            return None
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
