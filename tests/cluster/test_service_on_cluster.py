"""The service on a Redis Cluster: a redis-cluster:// URL, or GUARD_REDIS_CLUSTER with a
redis:// URL of one node."""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx
import pytest
from asgi_lifespan import LifespanManager
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import RedisCluster

from app.main import create_app
from app.settings import Settings
from devkit.cluster import LocalCluster
from devkit.keys import delete_prefixed

AUTH = {"Authorization": "Bearer test-key"}


@pytest.mark.parametrize("how", ["url", "switch"])
async def test_service_runs_on_a_cluster(
    cluster: LocalCluster, sync_redis: RedisCluster, tmp_path: Path, how: str
) -> None:
    prefix = f"test:app:{uuid.uuid4().hex[:12]}:"
    url = cluster.url if how == "url" else f"redis://127.0.0.1:{cluster.ports[1]}/0"
    settings = Settings(
        redis_url=url,
        redis_cluster=how == "switch",
        key_prefix=prefix,
        database_url=f"sqlite:///{tmp_path / 'records.db'}",
        api_key="test-key",
        demo_records=50,
    )
    try:
        async with LifespanManager(create_app(settings)) as manager:
            assert isinstance(manager._state["redis"], AsyncRedisCluster)
            transport = httpx.ASGITransport(app=manager.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                assert (await client.get("/health")).status_code == 200
                made = await client.put("/filters/sessions", json={"capacity": 1000}, headers=AUTH)
                assert made.status_code == 201
                added = await client.post(
                    "/filters/sessions/add", json={"items": ["s-1", "s-2"]}, headers=AUTH
                )
                assert added.json() == {"results": [True, True]}
                checked = await client.post(
                    "/filters/sessions/check", json={"items": ["s-1", "s-404"]}
                )
                assert checked.json() == {"results": [True, False]}
                listed = (await client.get("/filters")).json()
                assert "sessions" in str(listed)
                put = await client.put(
                    "/records/order-1", json={"value": {"total": 42}}, headers=AUTH
                )
                assert put.status_code == 201
                assert (await client.get("/records/order-1")).status_code == 200
                blocked = await client.get("/records/no-such-key")
                assert (blocked.status_code, blocked.headers["X-Guard"]) == (404, "blocked")
    finally:
        delete_prefixed(sync_redis, prefix)
