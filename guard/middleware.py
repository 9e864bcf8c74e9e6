"""Pure-ASGI middleware: answer 404 at once for keys the filter has never seen; `Guard`, the
decision it shares with the service's gateway route."""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any, Protocol

from guard.breaker import RedisBreaker
from guard.errors import FilterCorruptError, FilterNotFoundError, RedisUnreachable
from guard.rules import Match, Rule, Rules

log = logging.getLogger("guard.middleware")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class Lookup(Protocol):
    """Anything with an async membership test; a `guard.CuckooFilter` is one."""

    async def lookup(self, item: str) -> bool: ...


FilterSource = Lookup | Callable[[Scope], Lookup | None]
KeyExtractor = Callable[[Scope, re.Match[str]], str | None]

BLOCKED, PASSED, BYPASSED, REJECTED = "blocked", "passed", "bypassed", "rejected"
# Why a lookup failed (or was not made), as given to `on_failure`.
UNREACHABLE, DAMAGED, ERROR, STALE = "unreachable", "damaged", "error", "stale"


def key_from_match(scope: Scope, match: re.Match[str]) -> str | None:
    """Default extractor: the pattern's `key` group, else its first group."""
    if "key" in match.re.groupindex:
        return match.group("key")
    return match.group(1) if match.re.groups else None


class Guard:
    """The decision on one guarded key: what GuardMiddleware and the service's gateway route
    (app/gateway.py) share, so both answer a request alike.

    The caller puts the matched rule in ``scope["guard.rule"]`` first: ``filter(scope)`` and
    ``stale(scope)`` may read it to pick the rule's filter. A failed lookup (Redis down, the
    filter damaged) is "bypassed" under a fail-open rule (the filter only saves work), else
    "rejected". A missing filter is always bypassed: nothing says a key is absent. After Redis
    failed, it is left alone for `cooldown` seconds (through `breaker`, which the app may
    share); a damaged filter does not trip the breaker, for Redis answers. A failure is logged
    once per incident (and when it clears); each failed lookup is reported to `on_failure`
    with its reason: "unreachable", "damaged" or "error".

    While `stale(scope)` says the filter is behind the data it guards (it missed changes, was
    rolled back), it is not asked, for its "absent" could be a row it never got: the request
    is bypassed or rejected as for a failed lookup, and reported as "stale" (whoever decides
    staleness logs its incidents).
    """

    def __init__(
        self,
        *,
        filter: FilterSource,
        cooldown: float = 1.0,
        breaker: RedisBreaker | None = None,
        on_decision: Callable[[str], None] | None = None,
        missing: tuple[type[BaseException], ...] | None = None,
        on_failure: Callable[[str], None] | None = None,
        stale: Callable[[Scope], bool] | None = None,
    ) -> None:
        # A handle, or a function of the request that gives one: decided once, not per request.
        self._filter_of: Callable[[Scope], Lookup | None] = (
            (lambda scope: filter) if hasattr(filter, "lookup") else filter  # type: ignore[assignment,return-value]
        )
        self.breaker = breaker if breaker is not None else RedisBreaker(cooldown)
        self.on_decision = on_decision if on_decision is not None else (lambda decision: None)
        self.on_failure = on_failure if on_failure is not None else (lambda reason: None)
        self.missing = (FilterNotFoundError,) if missing is None else missing
        self.stale = stale
        self._incident_since: float | None = None
        self._incident_reason: str | None = None

    async def decide(self, scope: Scope, key: str, fail_open: bool) -> str:
        """blocked, passed, bypassed or rejected; reported to `on_decision`."""
        decision = await self._decide(scope, key, fail_open)
        self.on_decision(decision)
        return decision

    async def _decide(self, scope: Scope, key: str, fail_open: bool) -> str:
        cf = self._filter_of(scope)
        if cf is None:
            return BYPASSED
        if self.breaker.open:
            return BYPASSED if fail_open else REJECTED
        if self.stale is not None and self.stale(scope):
            self.on_failure(STALE)
            return BYPASSED if fail_open else REJECTED
        try:
            present = await cf.lookup(key)
        except self.missing:
            self._recovered()  # Redis answered; there is just no filter to ask
            return BYPASSED
        except Exception as exc:  # any failure: the guard must never turn a read into a 500
            self._failed(exc, fail_open)
            return BYPASSED if fail_open else REJECTED
        self._recovered()
        return PASSED if present else BLOCKED

    def _failed(self, exc: Exception, fail_open: bool) -> None:
        if isinstance(exc, FilterCorruptError):
            reason = DAMAGED  # Redis answered: its other users need not skip it
        else:
            reason = UNREACHABLE if isinstance(exc, RedisUnreachable) else ERROR
            self.breaker.trip()
        self.on_failure(reason)
        if reason != self._incident_reason:  # a new incident, or another cause for it
            if self._incident_since is None:
                self._incident_since = time.monotonic()
            self._incident_reason = reason
            policy = "failing open" if fail_open else "failing closed (503)"
            log.warning("guard filter unavailable (%s), %s: %r", reason, policy, exc)

    def _recovered(self) -> None:
        if self._incident_since is not None:
            since = time.monotonic() - self._incident_since
            log.warning("guard filter reachable again after %.1f s", since)
            self._incident_since = self._incident_reason = None


class GuardMiddleware:
    """Guards the requests `rules` match (guard/rules.py), or GET/HEAD requests whose path
    matches one of the regexes in `paths` (their key given by `key`).

    The filter says absent → 404 `{"detail": "Not Found"}` with `X-Guard: blocked`, and the
    app is never called. Otherwise the request goes on with `X-Guard: passed`; the decision is
    left in `scope["guard.decision"]` (and the rule in `scope["guard.rule"]`) so the app can
    count false positives. A failed lookup: `X-Guard: bypassed` under a fail-open rule, else
    503 with Retry-After (`Guard` says when). The other arguments are `Guard`'s, or a `guard`
    the app shares with its gateway route.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        filter: FilterSource | None = None,
        rules: Iterable[Rule] | None = None,
        paths: Iterable[str | re.Pattern[str]] = (),
        key: KeyExtractor = key_from_match,
        methods: Iterable[str] = ("GET", "HEAD"),
        fail_open: bool = True,
        cooldown: float = 1.0,
        breaker: RedisBreaker | None = None,
        retry_after: int = 1,
        on_decision: Callable[[str], None] | None = None,
        missing: tuple[type[BaseException], ...] | None = None,
        on_failure: Callable[[str], None] | None = None,
        stale: Callable[[Scope], bool] | None = None,
        guard: Guard | None = None,
    ) -> None:
        self.app = app
        if guard is None:
            if filter is None:
                raise TypeError("GuardMiddleware needs a filter (or a guard)")
            guard = Guard(
                filter=filter, cooldown=cooldown, breaker=breaker, on_decision=on_decision,
                missing=missing, on_failure=on_failure, stale=stale,
            )  # fmt: skip
        self.guard = guard
        self.breaker = guard.breaker
        # `paths=` regexes are rules of their own, their key found by `key`.
        self._key = None if rules is not None else key
        self.rules = Rules(rules if rules is not None else _path_rules(paths, methods, fail_open))
        self.retry_after = retry_after
        self._answers = {
            BLOCKED: _answer(404, "Not Found", BLOCKED),
            REJECTED: _answer(503, "Guard filter unavailable", REJECTED, retry_after),
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        found = self._guarded(scope) if scope["type"] == "http" else None
        if found is None or found.key is None:
            return await self.app(scope, receive, send)
        # Set on the scope itself rather than a copy, so outer middleware (metrics) sees it,
        # as it sees what the router adds.
        scope["guard.rule"] = found.rule
        decision = await self.guard.decide(scope, found.key, found.rule.fail_open)
        scope["guard.decision"] = decision
        answer = self._answers.get(decision)
        if answer is None:
            return await self.app(scope, receive, _tagged(send, decision))
        # Sent by hand: exceptions raised in middleware never reach the app's handlers.
        status, headers, payload = answer
        await send({"type": "http.response.start", "status": status, "headers": list(headers)})
        body = b"" if scope["method"] == "HEAD" else payload
        await send({"type": "http.response.body", "body": body})

    def _guarded(self, scope: Scope) -> Match | None:
        if self._key is None:
            return self.rules.match(
                scope["method"], scope["path"], scope.get("query_string", b""), scope["headers"]
            )
        for rule in self.rules:
            if scope["method"] in rule.methods:
                match = rule.regex.fullmatch(scope["path"])
                if match is not None:
                    return Match(rule, self._key(scope, match) or None)
        return None


def _path_rules(
    paths: Iterable[str | re.Pattern[str]], methods: Iterable[str], fail_open: bool
) -> list[Rule]:
    """`paths=` regexes as rules (their filter is the middleware's `filter`)."""
    verbs = frozenset(m.upper() for m in methods)
    out = []
    for i, path in enumerate(paths):
        regex = re.compile(path) if isinstance(path, str) else path
        out.append(
            Rule(f"paths[{i}]", regex.pattern, "", "api", verbs, fail_open=fail_open, regex=regex)
        )
    return out


def _answer(
    status: int, detail: str, decision: str, retry_after: int | None = None
) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """A response the guard sends itself, encoded once: a blocked request is the busiest path."""
    payload = json.dumps({"detail": detail}, separators=(",", ":")).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
        (b"x-guard", decision.encode()),
    ]
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    return status, headers, payload


def _tagged(send: Send, decision: str) -> Send:
    """Wrap `send` so the response carries `X-Guard: <decision>`."""

    async def wrapper(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {
                **message,
                "headers": [*message.get("headers", []), (b"x-guard", decision.encode())],
            }
        await send(message)

    return wrapper
