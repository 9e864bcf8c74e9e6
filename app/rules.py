"""The service's route rules: GUARD_RULES (YAML or TOML, guard/rules.py says the format), or
the one built-in rule that guards /records when it is unset.

A table-backed rule names the table its filter follows, in GUARD_DATABASE_URL's database. The
service runs one records subsystem per table the rules name (app/records.py: the filter, its
change feed, watchdog, rebuilds, caches), each from a view of the settings with that table,
key column and filter. The first table-backed rule's table is the records table: it stands
for GUARD_RECORDS_TABLE, GUARD_RECORDS_KEY_COLUMN and GUARD_RECORDS_FILTER, its feed is named
GUARD_FEED_PREFIX, and the /records routes read and write it; every other table's feed is
named GUARD_FEED_PREFIX_<table>.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from app.db.base import IDENTIFIER
from app.settings import Settings
from guard.rules import Rule, Rules, RulesError, load_toml, parse

RECORDS_PATH = "/records/{key}"
# The store's settings a table-backed rule stands for: rule field -> setting.
STORE_SETTINGS = {"table": "records_table", "key_column": "records_key_column",
                  "filter": "records_filter"}  # fmt: skip


def default_rules(settings: Settings) -> Rules:
    """Today's guard as a rule: GET/HEAD /records/{key}, the records filter, its table."""
    return Rules(
        [
            Rule(
                name="records",
                path=RECORDS_PATH,
                filter=settings.records_filter,
                source="table",
                fail_open=settings.fail_open,
                table=settings.records_table,
                key_column=settings.records_key_column,
            )
        ]
    )


def read_rules(path: str | Path, *, fail_open: bool = True) -> Rules:
    """A rules file by its extension (.yaml, .yml or .toml), checked as the service checks it;
    RulesError (one line, naming the file, rule and field) when it cannot be used."""
    path = Path(path)
    try:
        if path.suffix.lower() == ".toml":
            rules = load_toml(path, fail_open=fail_open)
        elif path.suffix.lower() in (".yaml", ".yml"):
            rules = parse(_yaml(path), fail_open=fail_open)
        else:
            raise RulesError("a rules file is .yaml, .yml or .toml")
        check_for_service(rules)
    except RulesError as exc:
        raise RulesError(f"{path}: {exc}") from None
    except OSError as exc:
        raise RulesError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    return rules


def _yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise RulesError(f"not valid YAML ({' '.join(str(exc).split())})") from None


def check_for_service(rules: Rules) -> None:
    """What the service needs beyond the format (which gives a filter one source): plain SQL
    names, and one filter and one key column per table."""
    by_table: dict[str | None, Rule] = {}
    for rule in rules:
        if not rule.follows_table:
            continue
        for field in ("table", "key_column"):
            value = getattr(rule, field)
            if not IDENTIFIER.fullmatch(value or ""):
                raise RulesError(
                    f"a plain SQL name (letters, digits, _; 63 at most), got {value!r}",
                    rule.name,
                    field,
                )
        first = by_table.setdefault(rule.table, rule)
        for field in ("key_column", "filter"):
            if getattr(first, field) != getattr(rule, field):
                raise RulesError(
                    f"{getattr(rule, field)!r}, but rule {first.name} follows table "
                    f"{rule.table} with {field} {getattr(first, field)!r}: a table has one "
                    "key column and one filter",
                    rule.name,
                    field,
                )


@dataclass(frozen=True)
class ServiceRules:
    """The rules a service runs, and a view of the settings for each table the rules follow,
    the records table's first."""

    rules: Rules
    tables: tuple[Settings, ...]

    @classmethod
    def builtin(cls, settings: Settings) -> ServiceRules:
        """The built-in rule, on the settings' records table."""
        return cls(default_rules(settings), (settings,))

    @property
    def settings(self) -> Settings:
        """The service's settings: the records table's view."""
        return self.tables[0]

    @property
    def table_rule(self) -> Rule | None:
        return next((r for r in self.rules if r.follows_table), None)


def service_rules(settings: Settings) -> ServiceRules:
    """GUARD_RULES read and checked, or the built-in rule; RulesError names the setting."""
    if not settings.rules:
        return ServiceRules.builtin(settings)
    try:
        rules = read_rules(settings.rules, fail_open=settings.fail_open)
        store = _store_settings(rules, settings)
    except RulesError as exc:
        raise RulesError(f"GUARD_RULES: {exc}") from None
    return ServiceRules(rules, _table_views(rules, store))


def _table_views(rules: Rules, store: Settings) -> tuple[Settings, ...]:
    """The records table's settings, then a view for every other table a rule follows."""
    views = [store]
    seen: set[str | None] = {store.records_table}
    for rule in rules:
        if rule.follows_table and rule.table not in seen:
            seen.add(rule.table)
            views.append(
                store.model_copy(
                    update={
                        "records_table": rule.table,
                        "records_key_column": rule.key_column,
                        "records_filter": rule.filter,
                        "records_columns": "",
                        "feed_prefix": f"{store.feed_prefix}_{rule.table}",
                        "demo_records": 0,
                    }
                )
            )
    return tuple(views)


def _store_settings(rules: Rules, settings: Settings) -> Settings:
    rule = next((r for r in rules if r.follows_table), None)
    if rule is None:
        # The records store still follows its table with GUARD_RECORDS_FILTER: an API-fed
        # rule may not feed that filter too (the API refuses to change it).
        fed = next((r for r in rules if r.filter == settings.records_filter), None)
        if fed is not None:
            raise RulesError(
                f"{settings.rules}: rule {fed.name}: filter: {fed.filter!r} follows the "
                "records table (GUARD_RECORDS_FILTER): a filter fed through the API needs "
                "another name"
            )
        return settings
    update: Mapping[str, Any] = {
        setting: getattr(rule, field) for field, setting in STORE_SETTINGS.items()
    }
    for setting, value in update.items():
        # Set both ways, differently: the file would silently win over the environment.
        if setting in settings.model_fields_set and getattr(settings, setting) != value:
            raise RulesError(
                f"{settings.rules}: rule {rule.name} stands for {_setting(setting)}={value!r} "
                f"but the environment sets {_setting(setting)}={getattr(settings, setting)!r} "
                "(unset it: with GUARD_RULES the rules file says it)",
            )
    return settings.model_copy(update=update)


def _setting(name: str) -> str:
    return f"GUARD_{name.upper()}"


def rules_or_problem(settings: Settings) -> tuple[ServiceRules, str | None]:
    """`service_rules`, or the built-in rule and the one line that stops the start-up."""
    try:
        return service_rules(settings), None
    except RulesError as exc:
        return ServiceRules.builtin(settings), str(exc)


def rule_filter(scope: Any) -> Any:
    """The filter handle of the rule in ``scope["guard.rule"]``, from the lifespan state
    (None before start-up: the guard then lets everything through)."""
    filters = scope.get("state", {}).get("rule_filters")
    return None if filters is None else filters.get(scope["guard.rule"].name)


def rule_stale(scope: Any) -> bool:
    """Whether the watchdog of the table behind the rule's filter finds it stale."""
    rule = scope["guard.rule"]
    tables = scope.get("state", {}).get("tables") if rule.follows_table else None
    store = None if tables is None else tables.of_table(rule.table)
    return store is not None and store.watchdog is not None and bool(store.watchdog.stale)


__all__ = [
    "ServiceRules",
    "check_for_service",
    "default_rules",
    "read_rules",
    "rule_filter",
    "rule_stale",
    "rules_or_problem",
    "service_rules",
]
