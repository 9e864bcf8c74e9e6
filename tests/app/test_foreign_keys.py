"""Keys under the prefix that are not filters (another type, a name that is not valid UTF-8
or not a filter name, bytes that are not a filter) never break the listing routes:
GET /filters, /metrics, /dashboard.json and /health answer 200 with every readable filter
and report what they could not read."""

from __future__ import annotations

import pytest

from tests.app.conftest import AUTH, Service

FOREIGN = {
    b"{\xff\xfe}": "string",  # not valid UTF-8
    b"{hash}": "hash",  # a valid filter name, another type
    b"{list:0}": "list",  # a shard's name, another type
    b"{junk}": "string",  # a valid name, bytes that are no filter
    b"{not a name!}": "string",
}


async def _plant(svc: Service) -> None:
    prefix = svc.settings.key_prefix.encode()
    for tag, kind in FOREIGN.items():
        key = prefix + tag
        if kind == "hash":
            await svc.redis.hset(key, "field", "value")
        elif kind == "list":
            await svc.redis.rpush(key, "x")
        else:
            await svc.redis.set(key, b"not a filter at all")


@pytest.fixture
async def planted(svc: Service) -> Service:
    assert (
        await svc.client.put("/filters/good", json={"capacity": 100}, headers=AUTH)
    ).status_code == 201
    await _plant(svc)
    return svc


@pytest.mark.parametrize("path", ["/filters", "/dashboard.json"])
async def test_listings_report_unreadable_keys(planted: Service, path: str) -> None:
    r = await planted.client.get(path)
    assert r.status_code == 200, r.text
    body = r.json()
    assert sorted(f["name"] for f in body["filters"]) == ["good", "records"]
    assert body["damaged"] == ["hash", "junk"]


async def test_metrics_keep_every_readable_gauge(planted: Service) -> None:
    r = await planted.client.get("/metrics")
    assert r.status_code == 200, r.text
    assert 'guard_filter_items{filter="good"} 0.0' in r.text
    assert 'guard_filter_items{filter="records"} 50.0' in r.text
    assert 'guard_filter_damaged{filter="hash"} 1.0' in r.text
    assert 'guard_filter_damaged{filter="junk"} 1.0' in r.text


async def test_health_answers(planted: Service) -> None:
    r = await planted.client.get("/health")
    assert (r.status_code, r.json()) == (200, {"status": "ok", "redis": "ok"})
