"""The gateway route: nginx, Caddy, Traefik and Envoy ask it whether a request may pass.

Each gateway sends a sub-request per incoming request, naming the original in its own way:

- ``GET /authz/nginx``: nginx ``auth_request`` with ``X-Original-Method`` and
  ``X-Original-URI`` (the config sets them). nginx accepts only 2xx, 401 and 403 from it: a
  blocked key is 403 (the config answers the client 404), a fail-closed refusal 401 (503).
- ``/authz/forward``: Caddy ``forward_auth`` and Traefik ``forwardAuth``, with
  ``X-Forwarded-Method`` and ``X-Forwarded-Uri``. They hand a non-2xx answer to the client as
  it is: blocked is 404, refused 503 with Retry-After.
- ``/authz/envoy<original path>``: Envoy ``ext_authz`` in HTTP mode, which appends the
  original path and query to a path prefix and keeps the original method. Answers as
  ``forward``: Envoy passes on only 200, hands a 404 to the client, and takes a 503 for a
  failure of the guard (its ``status_on_error``).

Every pass is 200 with an empty body. ``X-Guard`` says why: ``passed`` (the filter may hold
the key), ``blocked``, ``bypassed`` (a failed lookup under a fail-open rule, or a request it
cannot read for sure, with ``X-Guard-Reason``), ``rejected``, or ``unguarded`` (no rule
matches). ``X-Guard-Rule`` and ``X-Guard-Key`` (percent-encoded UTF-8; empty past 1 KiB)
name what was looked up. It never reads a request body, never asks the database, and makes
one filter lookup, through the rule's coalescing handle. The decision itself is the
middleware's (`guard.middleware.Guard`), so a gateway and the app answer a key alike.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import quote, unquote_to_bytes, urlsplit

from fastapi import FastAPI
from starlette.types import Receive, Scope, Send

from guard.middleware import BLOCKED, BYPASSED, PASSED, REJECTED, Guard
from guard.rules import Rules

log = logging.getLogger("app.gateway")

PREFIX = "/authz"
ENVOY = PREFIX + "/envoy"
UNGUARDED = "unguarded"
PLAIN_KEY = re.compile(r"[A-Za-z0-9_.~-]*")  # what percent-encoding leaves as it is
MAX_ECHOED_KEY = 1024  # X-Guard-Key is left empty for longer (percent-encoded) keys
NOT_FOUND = b'{"detail":"Not Found"}'
UNAVAILABLE = b'{"detail":"Guard filter unavailable"}'


@dataclass(frozen=True)
class Convention:
    """How one kind of gateway names the original request, and which statuses it wants."""

    route: str  # the metrics label
    # The headers naming the original method and URI; None: the sub-request's own method,
    # and its path after ENVOY (Envoy).
    headers: tuple[bytes, bytes] | None
    blocked: tuple[int, bytes]  # status, body
    rejected: tuple[int, bytes]


NGINX = Convention(
    "/authz/nginx", (b"x-original-method", b"x-original-uri"), (403, b""), (401, b"")
)
FORWARD = Convention(
    "/authz/forward",
    (b"x-forwarded-method", b"x-forwarded-uri"),
    (404, NOT_FOUND),
    (503, UNAVAILABLE),
)
ENVOY_HTTP = Convention(ENVOY, None, (404, NOT_FOUND), (503, UNAVAILABLE))
CONVENTIONS = {c.route: c for c in (NGINX, FORWARD)}  # by path; Envoy's is a prefix


class Unreadable(Exception):
    """The original request cannot be told for sure: the guard lets it pass."""


class GuardApp(FastAPI):
    """The service's FastAPI app, whose gateway route (once set) answers ``/authz/...``
    before FastAPI and Starlette do anything: their layers (FastAPI's telemetry check, the
    error middleware, the start-up gate) cost about 15 µs of CPU per request, a sixth of the
    whole hop. The route raises nothing (the guard turns every failure into an answer), so
    it needs no error middleware."""

    gateway: GatewayRoute | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.gateway is not None:
            convention = convention_of(scope)
            if convention is not None:
                return await self.gateway(scope, send, convention)
        await super().__call__(scope, receive, send)


def convention_of(scope: Scope) -> Convention | None:
    """The gateway convention of an ``/authz/...`` request; None for any other."""
    if scope["type"] != "http":
        return None
    path: str = scope["path"]
    convention = CONVENTIONS.get(path)
    if convention is None and path.startswith(ENVOY + "/"):
        return ENVOY_HTTP
    return convention


class GatewayRoute:
    """Answers a gateway's ``/authz/...`` sub-request (no routing, no dependencies: it is
    every proxied request's hop); `GuardApp` sends it those requests."""

    def __init__(
        self,
        *,
        rules: Rules,
        guard: Guard,
        retry_after: int = 1,
        on_request: Callable[[str, str, int, float], None] | None = None,
    ) -> None:
        self.rules = rules
        self.guard = guard
        self.retry_after = str(retry_after).encode()
        self.on_request = on_request
        self._warned: set[str] = set()

    async def __call__(self, scope: Scope, send: Send, convention: Convention) -> None:
        """Answer; the request's body, if any, is never read."""
        start = time.perf_counter()
        status, headers, body = await self._answer(scope, convention)
        if body:
            headers.append((b"content-type", b"application/json"))
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        body = b"" if scope["method"] == "HEAD" else body
        await send({"type": "http.response.body", "body": body})
        if self.on_request is not None:
            self.on_request(convention.route, scope["method"], status, time.perf_counter() - start)

    async def _answer(
        self, scope: Scope, convention: Convention
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        try:
            method, path, query = original(scope, convention)
        except Unreadable as exc:
            self._warn(str(exc))
            return _passing(BYPASSED, reason=str(exc))
        found = self.rules.match(method, path, query, scope["headers"])
        if found is None:
            return _passing(UNGUARDED)
        rule = found.rule.name
        if found.key is None:  # no such query parameter (nothing to look up), or two
            return _passing(BYPASSED if found.problem else UNGUARDED, rule, reason=found.problem)
        scope["guard.rule"] = found.rule
        decision = await self.guard.decide(scope, found.key, found.rule.fail_open)
        key = found.key if PLAIN_KEY.fullmatch(found.key) else quote(found.key, safe="")
        if len(key) > MAX_ECHOED_KEY:
            key = ""  # nginx reads an answer's headers into 4 KiB: it would fail the request
        if decision in (PASSED, BYPASSED):
            return _passing(decision, rule, key)
        headers = _named(decision, rule, key)
        if decision == BLOCKED:
            status, body = convention.blocked
        else:
            assert decision == REJECTED, decision
            status, body = convention.rejected
            headers.append((b"retry-after", self.retry_after))
        return status, headers, body

    def _warn(self, problem: str) -> None:
        """Logged once per kind of problem: a gateway config that sends no X-Original-URI
        would otherwise log every request."""
        kind = problem.split(":")[0]
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning("gateway request not checked (passed): %s", problem)


def original(scope: Scope, convention: Convention) -> tuple[str, str, bytes]:
    """(method, decoded path, raw query) of the request the gateway asks about; Unreadable
    when it cannot be told for sure."""
    if convention.headers is None:
        method = scope["method"]
        raw_path: bytes = scope.get("raw_path") or scope["path"].encode()
        uri = raw_path[len(ENVOY) :]
        query = scope.get("query_string", b"")
        if query:
            uri += b"?" + query
        return method, *split_uri(uri, "path")
    method_header, uri_header = convention.headers
    named: bytes | None = None
    target: bytes | None = None
    for name, value in scope["headers"]:  # one pass: this runs for every proxied request
        if name == method_header:
            named = _once(scope, name, named, value)
        elif name == uri_header:
            target = _once(scope, name, target, value)
    if named is None or target is None:
        raise Unreadable(f"{(method_header if named is None else uri_header).decode()}: missing")
    verb = named.strip()
    if not verb.isalpha():
        raise Unreadable(f"{method_header.decode()}: not an HTTP method")
    return verb.decode("ascii").upper(), *split_uri(target.strip(), uri_header.decode())


def _once(scope: Scope, name: bytes, seen: bytes | None, value: bytes) -> bytes:
    """``value``, unless the header came before: a request named twice is not read."""
    if seen is not None:
        count = sum(1 for k, _ in scope["headers"] if k == name)
        raise Unreadable(f"{name.decode()}: {count} values")
    return value


def split_uri(uri: bytes, where: str) -> tuple[str, bytes]:
    """The path decoded as the gateway routes on it (percent-escapes decoded, so ``%2F`` is a
    ``/``; ``.`` and ``..`` segments resolved), and the raw query; ``where`` names the
    header in an Unreadable."""
    if uri.startswith((b"http://", b"https://")):  # absolute-form: keep path and query
        parts = urlsplit(uri)
        uri = (parts.path or b"/") + (b"?" + parts.query if parts.query else b"")
    raw_path, _, query = uri.partition(b"?")
    raw_path = raw_path.partition(b"#")[0]
    if not raw_path.startswith(b"/"):
        raise Unreadable(f"{where}: not a path starting with /")
    try:
        if b"%" in raw_path:
            raw_path = unquote_to_bytes(raw_path)
        path = raw_path.decode("utf-8")
    except UnicodeDecodeError:
        raise Unreadable(f"{where}: not UTF-8 once percent-decoded") from None
    return remove_dot_segments(path), query


def remove_dot_segments(path: str) -> str:
    """RFC 3986 5.2.4: ``/a/./b/../c`` is ``/a/c``; a ``..`` at the root stays at the root."""
    if "." not in path:
        return path
    out: list[str] = []
    segments = path.split("/")
    for segment in segments[1:]:
        if segment == "..":
            if out:
                out.pop()
        elif segment != ".":
            out.append(segment)
    if segments[-1] in (".", ".."):
        out.append("")  # "/a/b/.." is "/a/", a directory
    return "/" + "/".join(out)


def _named(decision: str, rule: str, key: str) -> list[tuple[bytes, bytes]]:
    return [(b"x-guard", decision.encode()), (b"x-guard-rule", rule.encode()),
            (b"x-guard-key", key.encode())]  # fmt: skip


def _passing(
    decision: str, rule: str = "", key: str = "", reason: str | None = None
) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """A 200. Its X-Guard-Rule and X-Guard-Key are there even when empty: a gateway that
    copies them upstream (Caddy's copy_headers) then sets them, rather than passing on its
    placeholder text (Caddy before 2.9) or a header the client forged."""
    headers = _named(decision, rule, key)
    if reason is not None:
        headers.append((b"x-guard-reason", _ascii(reason)))
    return 200, headers, b""


def _ascii(text: str) -> bytes:
    return text.encode("ascii", "backslashreplace")


__all__ = [
    "GatewayRoute",
    "GuardApp",
    "convention_of",
    "original",
    "remove_dot_segments",
    "split_uri",
]
