"""app/env.py reads what a filter command needs without pydantic: it must read each value as
Settings does, and leave to Settings (which words the refusal) whatever it does not take."""

from __future__ import annotations

import os
from dataclasses import fields

import pytest
from pydantic import ValidationError

from app import env
from app.cli.common import quick_settings
from app.settings import Settings

FIELDS = [f.name for f in fields(env.EnvSettings)]

# Values each reader takes; the quick reader must agree with Settings on all of them.
PLAIN = {
    "GUARD_REDIS_URL": ["redis://h:6379/2", "unix:///tmp/r.sock", "memory://", ""],
    "GUARD_REDIS_CLUSTER": ["true", "0", "FALSE"],
    "GUARD_REDIS_TIMEOUT": ["0.5", "3", "1e-2"],
    "GUARD_DATA_DIR": ["/srv/guard"],
    "GUARD_EMBEDDED_REDIS_FILE": ["/srv/redis.rdb"],
    "GUARD_KEY_PREFIX": ["app:", ""],
    "GUARD_RECORDS_FILTER": ["users.v2"],
    "GUARD_RECORDS_ERROR_RATE": ["0.0001", "0.001"],
    "GUARD_RECORDS_HEADROOM": ["1", "3.5"],
    "GUARD_RECORDS_MIN_CAPACITY": ["1", "5000"],
}
# Values Settings refuses: the quick reader must not take them either.
BAD = {
    "GUARD_REDIS_URL": ["foo://bar", "localhost:6379"],
    "GUARD_REDIS_CLUSTER": ["maybe"],
    "GUARD_REDIS_TIMEOUT": ["0", "-1", "soon"],
    "GUARD_RECORDS_FILTER": ["a:b", ""],
    "GUARD_RECORDS_ERROR_RATE": ["0.01", "0"],
    "GUARD_RECORDS_HEADROOM": ["0.5"],
    "GUARD_RECORDS_MIN_CAPACITY": ["0", "1.5"],
}


@pytest.fixture(autouse=True)
def no_guard_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.upper().startswith("GUARD_"):
            monkeypatch.delenv(name)


def same(quick: env.EnvSettings, full: Settings) -> None:
    assert {f: getattr(quick, f) for f in FIELDS} == {f: getattr(full, f) for f in FIELDS}


def test_defaults_are_the_settings_defaults() -> None:
    same(env.read(), Settings())
    assert env.read().capacity_for(10_000) == Settings().capacity_for(10_000)


@pytest.mark.parametrize(("name", "value"), [(n, v) for n, vs in PLAIN.items() for v in vs])
def test_reads_a_value_as_settings_does(
    name: str, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(name, value)
    same(env.read(), Settings())


def test_variable_names_in_any_case(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("guard_key_prefix", "lower:")
    same(env.read(), Settings())
    assert env.read().key_prefix == "lower:"


@pytest.mark.parametrize(("name", "value"), [(n, v) for n, vs in BAD.items() for v in vs])
def test_leaves_what_settings_refuses_to_settings(
    name: str, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValidationError):
        Settings()
    with pytest.raises(env.NotPlain):
        env.read()
    with pytest.raises(ValueError, match=rf"^invalid setting {name}: "):
        quick_settings()


def test_options_over_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GUARD_KEY_PREFIX", "env:")
    assert quick_settings(key_prefix="option:", redis_url=None).key_prefix == "option:"
    with pytest.raises(ValueError, match=r"^invalid setting --redis-url: got 'x'"):
        quick_settings(redis_url="x")
