"""Route rules: which requests are guarded, where their key is, which filter answers for it.

One rules file drives the ASGI middleware (guard/middleware.py) and the service's gateway
route (app/gateway.py), so a Python app and an nginx in front of a Go service share one
configuration. A rule, as written in the file (TOML here; the service also reads YAML)::

    [[rules]]
    name = "users"                 # in errors and in the X-Guard-Rule answer header
    path = "/api/users/{id}"       # {name}: one path segment; {name:path}: the rest
    methods = ["GET", "HEAD"]      # the default
    key = { path = "id" }          # or { query = "id" } or { header = "X-User-Id" }
    normalize = ["strip", "lower"] # optional, applied in this order
    filter = "users"
    fail_open = true               # the default is the caller's (GUARD_FAIL_OPEN)
    source = "table"               # the filter follows a table...
    table = "users"
    key_column = "id"
    # source = "api"               # ...or is fed through the filter API

The first rule whose methods and path match a request decides it. A request it cannot read a
single key from for sure (no such query parameter, two of them, bytes that are not UTF-8) is
not guarded: the guard only says "absent" for a key it was asked about.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote_to_bytes

from guard.names import NAME_PATTERN, NAME_RULE

KEY_KINDS = ("path", "query", "header")
SOURCES = ("table", "api")
NORMALIZERS: dict[str, Callable[[str], str]] = {"lower": str.lower, "strip": str.strip}
DEFAULT_METHODS = ("GET", "HEAD")
FIELDS = (
    "name", "path", "methods", "key", "normalize", "filter", "fail_open", "source", "table",
    "key_column",
)  # fmt: skip
RULE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:-]{0,63}")
METHOD = re.compile(r"[A-Z]{1,20}")
HEADER_NAME = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]{1,100}")
PLACEHOLDER = re.compile(r"\{([^{}]*)\}")
PARAM = re.compile(r"([A-Za-z_][A-Za-z0-9_]{0,31})(:path)?")


class RulesError(ValueError):
    """A rules file the guard cannot use; the message is one line naming the rule and field."""

    def __init__(self, message: str, rule: str | None = None, field: str | None = None):
        where = "" if rule is None else f"rule {rule}: "
        where += "" if field is None else f"{field}: "
        super().__init__(where + message)
        self.rule = rule
        self.field = field


@dataclass(frozen=True)
class KeySource:
    """Where a guarded request's key is: a path parameter, a query parameter or a header."""

    kind: str  # one of KEY_KINDS
    name: str  # the parameter's name; a header's in lower case

    def __str__(self) -> str:
        return f"{self.kind} {self.name!r}"


@dataclass(frozen=True)
class Rule:
    name: str
    path: str  # the pattern as written
    filter: str
    source: str  # "table" or "api"
    methods: frozenset[str] = frozenset(DEFAULT_METHODS)
    key: KeySource = KeySource("path", "key")
    normalize: tuple[str, ...] = ()
    fail_open: bool = True
    table: str | None = None
    key_column: str | None = None
    # Compiled from `path`, unless given (GuardMiddleware's `paths=` regexes).
    regex: re.Pattern[str] = field(default=None, repr=False, compare=False)  # type: ignore[arg-type]

    def __post_init__(self) -> None:
        if self.regex is None:
            object.__setattr__(self, "regex", path_regex(self.path))

    @property
    def follows_table(self) -> bool:
        return self.source == "table"

    def describe(self) -> str:
        """What the rule guards, in one line (``guard rules check``)."""
        norm = f", {'+'.join(self.normalize)}" if self.normalize else ""
        fed = (
            f"follows table {self.table}.{self.key_column}"
            if self.follows_table
            else "fed through the filter API"
        )
        policy = "fail open" if self.fail_open else "fail closed"
        methods = ",".join(sorted(self.methods))
        return (
            f"{self.name}: {methods} {self.path} -> key from {self.key}{norm} -> filter "
            f"{self.filter!r} ({fed}); {policy}"
        )


@dataclass(frozen=True)
class Match:
    """A request a rule matched: its key, or why no key could be read for sure."""

    rule: Rule
    key: str | None
    problem: str | None = None  # set when the key is ambiguous or unreadable


class Rules:
    """Rules in order; `match` finds the one that decides a request."""

    def __init__(self, rules: Iterable[Rule]) -> None:
        self.rules = tuple(rules)

    def __iter__(self) -> Iterator[Rule]:
        return iter(self.rules)

    def __len__(self) -> int:
        return len(self.rules)

    def match(
        self,
        method: str,
        path: str,
        query: bytes = b"",
        headers: Sequence[tuple[bytes, bytes]] = (),
    ) -> Match | None:
        """The first rule for ``method`` whose pattern matches the whole (decoded) ``path``,
        with the key it reads; None when no rule does."""
        for rule in self.rules:
            if method not in rule.methods:
                continue
            found = rule.regex.fullmatch(path)
            if found is not None:
                return _keyed(rule, found, query, headers)
        return None


def _keyed(
    rule: Rule, found: re.Match[str], query: bytes, headers: Sequence[tuple[bytes, bytes]]
) -> Match:
    source = rule.key
    if source.kind == "path":
        raw: str | None = found.group(source.name)
    else:
        values = (
            query_values(query, source.name)
            if source.kind == "query"
            else ([v for k, v in headers if k.lower() == source.name.encode()])
        )
        if len(values) > 1:
            return Match(rule, None, f"{len(values)} values of {source}")
        if not values:
            return Match(rule, None)
        try:
            raw = values[0].decode("utf-8")
        except UnicodeDecodeError:
            return Match(rule, None, f"{source} is not UTF-8")
    for step in rule.normalize:
        raw = NORMALIZERS[step](raw) if raw is not None else None
    return Match(rule, raw or None)


def query_values(query: bytes, name: str) -> list[bytes]:
    """The percent-decoded values of every ``name`` parameter in a raw query string."""
    out = []
    wanted = name.encode()
    for pair in query.split(b"&"):
        key, _, value = pair.replace(b"+", b" ").partition(b"=")
        if unquote_to_bytes(key) == wanted:
            out.append(unquote_to_bytes(value))
    return out


def path_regex(path: str) -> re.Pattern[str]:
    """``/api/users/{id}`` as a regex: ``{name}`` is one segment, ``{name:path}`` the rest."""
    parts: list[str] = []
    at = 0
    for found in PLACEHOLDER.finditer(path):
        parts.append(re.escape(path[at : found.start()]))
        param = PARAM.fullmatch(found.group(1))
        if param is None:
            raise ValueError(
                f"{{{found.group(1)}}} is no parameter: {{name}} or {{name:path}}, name a "
                "plain identifier"
            )
        parts.append(f"(?P<{param.group(1)}>{'.+' if param.group(2) else '[^/]+'})")
        at = found.end()
    rest = path[at:]
    if "{" in rest or "}" in rest:
        raise ValueError("a brace outside a {name} parameter")
    parts.append(re.escape(rest))
    try:
        return re.compile("".join(parts))
    except re.error as exc:  # a parameter named twice
        raise ValueError(f"parameters must differ ({exc})") from None


# -- reading a rules file -------------------------------------------------------------------


def load_toml(path: str | Path, *, fail_open: bool = True) -> Rules:
    """A TOML rules file (``[[rules]]`` tables)."""
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise RulesError(f"not valid TOML ({exc})") from None
    return parse(data, fail_open=fail_open)


def parse(data: object, *, fail_open: bool = True) -> Rules:
    """Rules from a file's data (``{"rules": [{...}, ...]}``); RulesError names the rule and
    field of the first problem. ``fail_open`` is a rule's default."""
    if not isinstance(data, Mapping) or set(data) != {"rules"}:
        got = sorted(data) if isinstance(data, Mapping) else type(data).__name__
        raise RulesError(f"the file holds one list, 'rules' (got {got})")
    items = data["rules"]
    if not isinstance(items, list) or not items:
        raise RulesError("'rules' must be a list of at least one rule")
    rules = [_rule(i, item, fail_open) for i, item in enumerate(items, 1)]
    _check_together(rules)
    return Rules(rules)


def _rule(index: int, item: object, fail_open: bool) -> Rule:
    label = f"#{index}"
    if not isinstance(item, Mapping):
        raise RulesError(f"must be a table of fields (got {type(item).__name__})", label)
    rule_name = item.get("name")
    if not (isinstance(rule_name, str) and RULE_NAME.fullmatch(rule_name)):
        raise RulesError(f"1-64 of A-Z a-z 0-9 _ . : - (got {rule_name!r})", label, "name")
    label = f"#{index} ({rule_name})"

    def bad(name: str, message: str, value: object = None) -> RulesError:
        return RulesError(f"{message} (got {value!r})", label, name)

    for unknown in sorted(set(item) - set(FIELDS)):
        raise bad(unknown, f"no such field; a rule has {', '.join(FIELDS)}", item[unknown])
    path = item.get("path")
    if not isinstance(path, str) or not path.startswith("/"):
        raise bad("path", "a path pattern starting with '/', e.g. /api/users/{id}", path)
    try:
        params = path_regex(path).groupindex
    except ValueError as exc:
        raise bad("path", str(exc), path) from None
    methods = item.get("methods", list(DEFAULT_METHODS))
    if isinstance(methods, str):
        methods = [methods]
    if (
        not isinstance(methods, list)
        or not methods
        or not all(isinstance(m, str) and METHOD.fullmatch(m.upper()) for m in methods)
    ):
        raise bad("methods", "a list of HTTP methods such as [GET, HEAD]", methods)
    key = _key_source(item.get("key"), list(params), bad)
    normalize = item.get("normalize", [])
    if isinstance(normalize, str):
        normalize = [normalize]
    if not isinstance(normalize, list) or not all(n in NORMALIZERS for n in normalize):
        raise bad("normalize", f"a list of {', '.join(NORMALIZERS)}", normalize)
    filter_name = item.get("filter")
    if not isinstance(filter_name, str) or not NAME_PATTERN.fullmatch(filter_name):
        raise bad("filter", f"a filter name, {NAME_RULE}", filter_name)
    rule_fail_open = item.get("fail_open", fail_open)
    if not isinstance(rule_fail_open, bool):
        raise bad("fail_open", "true or false", rule_fail_open)
    source = item.get("source")
    if source not in SOURCES:
        raise bad(
            "source",
            "'table' (the filter follows a database table) or 'api' (fed through the filter API)",
            source,
        )
    table, key_column = item.get("table"), item.get("key_column")
    for name, value in (("table", table), ("key_column", key_column)):
        if source == "api" and value is not None:
            raise bad(name, "only a rule with source 'table' names a table", value)
        if source == "table" and not (isinstance(value, str) and value):
            raise bad(name, "a rule with source 'table' names its table and key column", value)
    return Rule(
        name=rule_name,
        path=path,
        filter=filter_name,
        source=source,
        methods=frozenset(m.upper() for m in methods),
        key=key,
        normalize=tuple(normalize),
        fail_open=rule_fail_open,
        table=table,
        key_column=key_column,
    )


def _key_source(
    raw: object, params: list[str], bad: Callable[[str, str, object], RulesError]
) -> KeySource:
    if raw is None:  # the path's only parameter, or the one named key
        if len(params) == 1 or "key" in params:
            return KeySource("path", params[0] if len(params) == 1 else "key")
        raise bad("key", "say which path parameter, query parameter or header is the key", raw)
    if not isinstance(raw, Mapping) or len(raw) != 1:
        raise bad("key", "one of {path: NAME}, {query: NAME}, {header: NAME}", raw)
    ((kind, name),) = raw.items()
    if kind not in KEY_KINDS or not isinstance(name, str) or not name:
        raise bad("key", "one of {path: NAME}, {query: NAME}, {header: NAME}", raw)
    if kind == "path" and name not in params:
        raise bad("key", f"the path has no parameter {{{name}}}", raw)
    if kind == "header":
        if not HEADER_NAME.fullmatch(name):
            raise bad("key", "a header name (letters, digits, - and the like)", raw)
        name = name.lower()
    return KeySource(kind, name)


def _check_together(rules: list[Rule]) -> None:
    """What no rule shows alone: names twice, a filter both fed and following a table, or
    following two columns."""
    seen: dict[str, Rule] = {}
    by_filter: dict[str, Rule] = {}
    for rule in rules:
        if rule.name in seen:
            raise RulesError("two rules have this name", rule.name, "name")
        seen[rule.name] = rule
        other = by_filter.setdefault(rule.filter, rule)
        if (other.source, other.table, other.key_column) != (
            rule.source,
            rule.table,
            rule.key_column,
        ):
            raise RulesError(
                f"filter {rule.filter!r} is fed by rule {other.name} differently "
                f"({_feed(other)}, here {_feed(rule)}): one filter has one source",
                rule.name,
                "filter",
            )


def _feed(rule: Rule) -> str:
    return f"table {rule.table}.{rule.key_column}" if rule.follows_table else "the filter API"


__all__ = [
    "KeySource",
    "Match",
    "Rule",
    "Rules",
    "RulesError",
    "load_toml",
    "parse",
    "path_regex",
    "query_values",
]
