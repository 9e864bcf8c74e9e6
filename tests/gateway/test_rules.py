"""Route rules: the file format, its one-line errors, matching, and the same rules driving the
ASGI middleware and the service."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.rules import default_rules, read_rules, service_rules
from app.settings import Settings
from devkit.gateways import RULES
from devkit.processes import free_port
from guard.middleware import GuardMiddleware
from guard.rules import KeySource, Rule, Rules, RulesError, load_toml, parse
from tests.guard_process import clean_env, run_module

USERS = {"name": "users", "path": "/api/users/{id}", "filter": "users", "source": "table",
         "table": "users", "key_column": "id"}  # fmt: skip
ORDERS = {"name": "orders", "path": "/api/orders/{id}", "filter": "orders", "source": "api"}


def one(**fields: Any) -> Rule:
    (rule,) = parse({"rules": [fields]})
    return rule


def error(data: object) -> str:
    with pytest.raises(RulesError) as caught:
        parse(data)
    message = str(caught.value)
    assert "\n" not in message
    return message


class TestFormat:
    """What a rule may say, and its defaults."""

    def test_defaults(self) -> None:
        rule = one(**ORDERS)
        assert rule.methods == {"GET", "HEAD"}
        assert rule.key == KeySource("path", "id")  # the path's only parameter
        assert rule.normalize == () and rule.fail_open is True
        assert not rule.follows_table and rule.table is None

    def test_fail_open_default_is_the_callers(self) -> None:
        (rule,) = parse({"rules": [ORDERS]}, fail_open=False)
        assert rule.fail_open is False
        (rule,) = parse({"rules": [{**ORDERS, "fail_open": True}]}, fail_open=False)
        assert rule.fail_open is True

    def test_every_field(self) -> None:
        rule = one(
            name="s", path="/api/{tenant}/session", methods=["get", "DELETE"],
            key={"header": "X-Session-Id"}, normalize=["strip", "lower"], filter="sessions",
            fail_open=False, source="api",
        )  # fmt: skip
        assert rule.methods == {"GET", "DELETE"}
        assert rule.key == KeySource("header", "x-session-id")
        assert rule.normalize == ("strip", "lower") and rule.fail_open is False

    def test_toml_and_yaml_say_the_same(self, tmp_path: Path) -> None:
        toml = tmp_path / "rules.toml"
        toml.write_text(
            '[[rules]]\nname = "users"\npath = "/api/users/{id}"\nfilter = "users"\n'
            'source = "table"\ntable = "users"\nkey_column = "id"\n\n'
            '[[rules]]\nname = "orders"\npath = "/api/orders/{id}"\nfilter = "orders"\n'
            'source = "api"\n'
        )
        yaml_file = tmp_path / "rules.yml"
        yaml_file.write_text(
            "rules:\n"
            "  - {name: users, path: '/api/users/{id}', filter: users, source: table,\n"
            "     table: users, key_column: id}\n"
            "  - {name: orders, path: '/api/orders/{id}', filter: orders, source: api}\n"
        )
        assert (
            list(load_toml(toml))
            == list(read_rules(yaml_file))
            == list(parse({"rules": [USERS, ORDERS]}))
        )

    def test_the_deploy_rules_file_reads(self) -> None:
        """deploy/rules.yaml (compose's, the gateway tests'): one table, several API filters."""
        rules = read_rules(RULES)
        assert {r.filter for r in rules if not r.follows_table} == {"orders", "coupons", "sessions"}
        assert {(r.table, r.key_column) for r in rules if r.follows_table} == {("users", "id")}


class TestErrors:
    """A bad file: one line naming the rule and the field."""

    @pytest.mark.parametrize(
        ("fields", "expected"),
        [
            ({"path": "api/x/{id}"}, "rule #1 (orders): path: a path pattern starting with '/'"),
            ({"path": "/x/{id-x}"}, "rule #1 (orders): path: {id-x} is no parameter"),
            ({"path": "/x/{a}/{a}"}, "rule #1 (orders): path: parameters must differ"),
            ({"path": "/x/{a}/{b}"}, "rule #1 (orders): key: say which path parameter"),
            ({"key": {"path": "nope"}}, "rule #1 (orders): key: the path has no parameter {nope}"),
            ({"key": {"cookie": "s"}}, "rule #1 (orders): key: one of {path: NAME}"),
            ({"key": {"header": "a b"}}, "rule #1 (orders): key: a header name"),
            ({"methods": ["GET", 1]}, "rule #1 (orders): methods: a list of HTTP methods"),
            ({"normalize": ["upper"]}, "rule #1 (orders): normalize: a list of lower, strip"),
            ({"filter": "a:b"}, "rule #1 (orders): filter: a filter name"),
            ({"fail_open": "yes"}, "rule #1 (orders): fail_open: true or false (got 'yes')"),
            ({"source": "feed"}, "rule #1 (orders): source: 'table' (the filter follows"),
            ({"table": "users"}, "rule #1 (orders): table: only a rule with source 'table'"),
            ({"fail-open": False}, "rule #1 (orders): fail-open: no such field"),
            ({"name": "a b"}, "rule #1: name: 1-64 of"),
        ],
    )
    def test_field(self, fields: dict[str, Any], expected: str) -> None:
        assert error({"rules": [{**ORDERS, **fields}]}).startswith(expected)

    def test_table_rule_names_its_table_and_column(self) -> None:
        fields = {k: v for k, v in USERS.items() if k != "key_column"}
        assert error({"rules": [fields]}).startswith("rule #1 (users): key_column: a rule with")

    def test_the_second_rule_is_named(self) -> None:
        assert error({"rules": [USERS, {**ORDERS, "source": None}]}).startswith(
            "rule #2 (orders): source:"
        )

    def test_names_once_and_one_source_per_filter(self) -> None:
        assert error({"rules": [ORDERS, ORDERS]}) == "rule orders: name: two rules have this name"
        message = error({"rules": [USERS, {**ORDERS, "filter": "users"}]})
        assert message.startswith("rule orders: filter: filter 'users' is fed by rule users")

    @pytest.mark.parametrize("data", [[], {"rules": []}, {"rule": [ORDERS]}, {"rules": [1]}])
    def test_the_file_itself(self, data: object) -> None:
        error(data)

    def test_files(self, tmp_path: Path) -> None:
        bad = tmp_path / "r.yaml"
        bad.write_text("rules: [\n")
        with pytest.raises(RulesError, match=r"r\.yaml: not valid YAML \(") as caught:
            read_rules(bad)
        assert "\n" not in str(caught.value)
        (tmp_path / "r.toml").write_text("[[rules]\n")
        with pytest.raises(RulesError, match=r"r\.toml: not valid TOML"):
            read_rules(tmp_path / "r.toml")
        with pytest.raises(RulesError, match=r"r\.json: a rules file is \.yaml, \.yml or \.toml"):
            read_rules(tmp_path / "r.json")
        with pytest.raises(RulesError, match=r"none\.yaml: cannot read it"):
            read_rules(tmp_path / "none.yaml")

    def test_several_tables_one_filter_and_key_column_each(self, tmp_path: Path) -> None:
        path = tmp_path / "rules.yaml"
        orders = {**USERS, "name": "orders", "filter": "orders", "table": "orders"}
        path.write_text(f"rules: [{USERS!r}, {orders!r}]".replace("'", '"'))
        assert [r.table for r in read_rules(path)] == ["users", "orders"]
        for clash, line in (
            ({"filter": "again"}, "filter: 'again', but rule users follows table users with "
             "filter 'users': a table has one key column and one filter"),
            ({"filter": "again", "key_column": "email"}, "key_column: 'email', but rule users "
             "follows table users with key_column 'id': a table has one key column and one "
             "filter"),
        ):  # fmt: skip
            again = {**USERS, "name": "again", **clash}
            path.write_text(f"rules: [{USERS!r}, {again!r}]".replace("'", '"'))
            with pytest.raises(RulesError) as caught:
                read_rules(path)
            assert str(caught.value) == f"{path}: rule again: {line}"

    def test_table_names_are_plain_sql(self, tmp_path: Path) -> None:
        path = tmp_path / "rules.yaml"
        path.write_text(f"rules: [{ {**USERS, 'table': 'users; drop'}!r}]".replace("'", '"'))
        with pytest.raises(RulesError, match="rule users: table: a plain SQL name"):
            read_rules(path)


class TestMatch:
    """The first rule whose methods and path match decides; its key, normalised."""

    rules = parse(
        {
            "rules": [
                {**USERS, "normalize": ["strip", "lower"]},
                {**ORDERS, "methods": ["GET", "DELETE"]},
                {"name": "q", "path": "/api/coupons", "key": {"query": "code"},
                 "filter": "coupons", "source": "api"},
                {"name": "h", "path": "/api/session", "key": {"header": "X-Session"},
                 "filter": "sessions", "source": "api"},
                {"name": "files", "path": "/files/{key:path}", "filter": "files",
                 "source": "api"},
            ]
        }
    )  # fmt: skip

    def match(self, method: str, path: str, query: bytes = b"", headers: Any = ()) -> Any:
        found = self.rules.match(method, path, query, headers)
        return None if found is None else (found.rule.name, found.key, found.problem)

    def test_path_parameters(self) -> None:
        assert self.match("GET", "/api/users/ Alice ") == ("users", "alice", None)
        assert self.match("HEAD", "/api/users/42") == ("users", "42", None)
        assert self.match("POST", "/api/users/42") is None  # not its method
        assert self.match("DELETE", "/api/orders/7") == ("orders", "7", None)
        assert self.match("GET", "/api/users/42/orders") is None  # the whole path
        assert self.match("GET", "/files/a/b/c") == ("files", "a/b/c", None)

    def test_query_parameters(self) -> None:
        assert self.match("GET", "/api/coupons", b"x=1&code=SAVE%2010") == ("q", "SAVE 10", None)
        assert self.match("GET", "/api/coupons", b"code=a+b") == ("q", "a b", None)
        assert self.match("GET", "/api/coupons", b"x=1") == ("q", None, None)  # nothing to ask
        assert self.match("GET", "/api/coupons", b"code=") == ("q", None, None)
        assert self.match("GET", "/api/coupons", b"code=a&code=b") == (
            "q", None, "2 values of query 'code'",
        )  # fmt: skip
        assert self.match("GET", "/api/coupons", b"code=%FF") == (
            "q", None, "query 'code' is not UTF-8",
        )  # fmt: skip

    def test_headers(self) -> None:
        assert self.match("GET", "/api/session", headers=[(b"x-session", b"s1")]) == (
            "h", "s1", None,
        )  # fmt: skip
        two = [(b"x-session", b"s1"), (b"x-session", b"s2")]
        assert self.match("GET", "/api/session", headers=two)[2] == "2 values of header 'x-session'"
        assert self.match("GET", "/api/session") == ("h", None, None)

    def test_strip_leaves_nothing(self) -> None:
        assert self.match("GET", "/api/users/%20".replace("%20", " ")) == ("users", None, None)


def client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


class Downstream:
    def __init__(self) -> None:
        self.calls: list[str] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.calls.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


class Filters:
    """Two filters by name, each counting its lookups."""

    def __init__(self, **present: set[str]) -> None:
        self.present = present
        self.lookups: list[tuple[str, str]] = []

    def of(self, scope: Any) -> Any:
        name = scope["guard.rule"].filter
        outer = self

        class Handle:
            async def lookup(self, item: str) -> bool:
                outer.lookups.append((name, item))
                return item in outer.present[name]

        return Handle()


class TestMiddleware:
    """GuardMiddleware driven by rules: several rules, several filters."""

    async def test_rules_pick_their_filters(self) -> None:
        down = Downstream()
        filters = Filters(users={"alice"}, sessions={"s1"})
        rules = parse(
            {"rules": [{**USERS, "normalize": ["lower"]},
                       {"name": "h", "path": "/api/session", "key": {"header": "X-Session"},
                        "filter": "sessions", "source": "api"}]}
        )  # fmt: skip
        app = GuardMiddleware(down, filter=filters.of, rules=rules)
        async with client(app) as c:
            assert (await c.get("/api/users/ALICE")).headers["x-guard"] == "passed"
            r = await c.get("/api/users/bob")
            assert r.status_code == 404 and r.headers["x-guard"] == "blocked"
            assert (await c.get("/api/session", headers={"X-Session": "s1"})).status_code == 200
            assert (await c.get("/api/session", headers={"X-Session": "s2"})).status_code == 404
            assert (await c.get("/api/session")).status_code == 200  # no key: not guarded
            assert (await c.post("/api/users/bob")).status_code == 200  # not its method
        assert filters.lookups == [
            ("users", "alice"), ("users", "bob"), ("sessions", "s1"), ("sessions", "s2"),
        ]  # fmt: skip
        assert down.calls == ["/api/users/ALICE", "/api/session", "/api/session", "/api/users/bob"]

    async def test_fail_open_per_rule(self) -> None:
        class Down:
            async def lookup(self, item: str) -> bool:
                raise ConnectionError("Redis is down")

        rules = parse({"rules": [USERS, {**ORDERS, "fail_open": False}]})
        app = GuardMiddleware(Downstream(), filter=Down(), rules=rules, cooldown=0)
        async with client(app) as c:
            assert (await c.get("/api/users/1")).headers["x-guard"] == "bypassed"
            r = await c.get("/api/orders/1")
            assert r.status_code == 503 and r.headers["x-guard"] == "rejected"


class TestService:
    """The service's rules: the built-in one is today's guard; GUARD_RULES replaces it."""

    def test_default_rule_is_todays_guard(self) -> None:
        settings = Settings(fail_open=False, records_filter="recs", records_table="t",
                            records_key_column="k")  # fmt: skip
        (rule,) = default_rules(settings)
        assert (rule.path, rule.methods, rule.key, rule.filter, rule.fail_open) == (
            "/records/{key}", {"GET", "HEAD"}, KeySource("path", "key"), "recs", False,
        )  # fmt: skip
        assert (rule.table, rule.key_column) == ("t", "k")
        # The regex the middleware used before rules, on the same paths:
        old = re.compile(r"/records/(?P<key>[^/]+)")
        for path in ("/records/a", "/records/a/b", "/records/", "/records/%20", "/recordsx/a"):
            found = Rules([rule]).match("GET", path)
            expected = old.fullmatch(path)
            assert (found and found.key) == (expected and expected.group("key")), path

    def test_a_table_rule_sets_the_store(self, tmp_path: Path) -> None:
        path = tmp_path / "rules.yaml"
        path.write_text(f"rules: [{USERS!r}]".replace("'", '"'))
        served = service_rules(Settings(rules=str(path)))
        s = served.settings
        assert (s.records_table, s.records_key_column, s.records_filter) == ("users", "id", "users")

    def test_an_api_rule_may_not_feed_the_records_filter(self, tmp_path: Path) -> None:
        path = tmp_path / "rules.yaml"
        path.write_text(f"rules: [{ {**ORDERS, 'filter': 'records'}!r}]".replace("'", '"'))
        with pytest.raises(RulesError) as caught:
            service_rules(Settings(rules=str(path)))
        assert str(caught.value) == (
            f"GUARD_RULES: {path}: rule orders: filter: 'records' follows the records table "
            "(GUARD_RECORDS_FILTER): a filter fed through the API needs another name"
        )
        path.write_text(f"rules: [{ORDERS!r}]".replace("'", '"'))
        assert service_rules(Settings(rules=str(path))).settings.records_filter == "records"

    def test_the_environment_may_not_disagree(self, tmp_path: Path) -> None:
        path = tmp_path / "rules.yaml"
        path.write_text(f"rules: [{USERS!r}]".replace("'", '"'))
        service_rules(Settings(rules=str(path), records_table="users"))  # agrees
        with pytest.raises(RulesError) as caught:
            service_rules(Settings(rules=str(path), records_table="accounts"))
        assert str(caught.value) == (
            f"GUARD_RULES: {path}: rule users stands for GUARD_RECORDS_TABLE='users' but the "
            "environment sets GUARD_RECORDS_TABLE='accounts' (unset it: with GUARD_RULES the "
            "rules file says it)"
        )


@pytest.mark.parametrize(
    ("text", "line"),
    [
        (
            'rules:\n  - {name: users, path: "/api/users/{id}", filter: users, source: tabel}\n',
            "GUARD_RULES: {path}: rule #1 (users): source: 'table' (the filter follows a "
            "database table) or 'api' (fed through the filter API) (got 'tabel')",
        ),
        (
            'rules:\n  - {name: a, path: "/a/{id}", filter: a, source: table, table: a, '
            "key_column: id}\n"
            '  - {name: b, path: "/b/{id}", filter: b, source: table, table: a, '
            "key_column: id}\n",
            "GUARD_RULES: {path}: rule b: filter: 'b', but rule a follows table a with filter "
            "'a': a table has one key column and one filter",
        ),
    ],
)
def test_service_refuses_a_bad_rules_file_in_one_line(tmp_path: Path, text: str, line: str) -> None:
    """`uvicorn app.main:app` with a bad GUARD_RULES: that line, no traceback, exit non-zero
    (the style of every GUARD_* error, tests/app/test_startup.py)."""
    path = tmp_path / "rules.yaml"
    path.write_text(text)
    run = run_module(
        "uvicorn", "app.main:app", "--port", str(free_port()),
        env=clean_env(GUARD_DATA_DIR=str(tmp_path), GUARD_REDIS_URL="memory://",
                      GUARD_RULES=str(path)),
    )  # fmt: skip
    assert run.returncode != 0
    assert "Traceback" not in run.stderr
    errors = [x for x in run.stderr.splitlines() if x.startswith("ERROR:")]
    expected = line.format(path=path)
    assert errors == [f"ERROR:    {expected}", "ERROR:    Application startup failed. Exiting."]


class TestCheckCommand:
    """`guard rules check FILE`."""

    def test_prints_what_each_rule_guards(self) -> None:
        run = run_module("app.cli", "rules", "check", str(RULES), env=clean_env())
        assert run.returncode == 0, run.stderr
        lines = run.stdout.splitlines()
        assert lines[0] == (
            f"{RULES}: 5 rules; follows users.id; filters fed through the API: coupons, "
            "orders, sessions"
        )
        assert lines[1:] == [
            "  users: GET,HEAD /api/users/{id} -> key from path 'id' -> filter 'users' "
            "(follows table users.id); fail open",
            "  records: GET,HEAD /records/{key} -> key from path 'key' -> filter 'users' "
            "(follows table users.id); fail open",
            "  orders: DELETE,GET,HEAD /api/orders/{id} -> key from path 'id' -> filter "
            "'orders' (fed through the filter API); fail closed",
            "  coupons: GET,HEAD /api/coupons -> key from query 'code', strip+lower -> filter "
            "'coupons' (fed through the filter API); fail open",
            "  sessions: GET,HEAD /api/session -> key from header 'x-session-id' -> filter "
            "'sessions' (fed through the filter API); fail open",
        ]

    def test_a_bad_file_is_one_line_and_exit_1(self, tmp_path: Path) -> None:
        path = tmp_path / "rules.yaml"
        path.write_text('rules:\n  - {name: a, path: "/a/{id}", filter: a, source: api, x: 1}\n')
        run = run_module("app.cli", "rules", "check", str(path), env=clean_env())
        assert run.returncode == 1 and run.stdout == ""
        assert run.stderr.splitlines() == [
            f"error: GUARD_RULES: {path}: rule #1 (a): x: no such field; a rule has name, path, "
            "methods, key, normalize, filter, fail_open, source, table, key_column (got 1)"
        ]
