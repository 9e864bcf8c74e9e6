"""The service never answers "absent" from a filter older than one it already read.

The filter's keys are replaced by an older copy of themselves (DUMP taken earlier, RESTORE),
as Redis restarted from an older RDB or a failover to a lagging replica leaves them; the
first request after that meets the rollback in its own lookup (guard/ages.py), before any
watchdog check: every row or item written since is found, the rollback is counted in
/metrics, /health says degraded, and the records filter's watchdog repairs it.
"""

from __future__ import annotations

from app.watchdog import ROLLED_BACK
from tests.app.conftest import AUTH, Service, StartService
from tests.test_rollback import arestore as restore
from tests.test_rollback import asnapshot as snapshot

SINCE = [f"since-{i}" for i in range(30)]


async def rollbacks_metric(svc: Service, name: str) -> float:
    text = (await svc.client.get("/metrics")).text
    line = f'guard_filter_rollbacks_total{{filter="{name}"}} '
    found = [x for x in text.splitlines() if x.startswith(line)]
    return float(found[0].split()[-1]) if found else 0.0


async def test_records_written_since_are_never_blocked(start: StartService) -> None:
    # No feed loop and a watchdog that checks once a minute: nothing but the request's own
    # lookup can notice the older copy before the requests below are answered.
    svc = await start(feed=False, watchdog_interval=60.0, audit_interval=0)
    cf = svc.records.filter
    pattern = f"{svc.settings.key_prefix}{{{cf.name}}}*"
    saved = await snapshot(svc.redis, pattern)
    for key in SINCE:
        r = await svc.client.put(f"/records/{key}", json={"value": key}, headers=AUTH)
        assert r.status_code == 201
    assert (await svc.client.get(f"/records/{SINCE[-1]}")).status_code == 200
    await restore(svc.redis, pattern, saved)
    for key in SINCE:
        r = await svc.client.get(f"/records/{key}")
        assert r.status_code == 200, (key, r.status_code, r.headers.get("x-guard"))
    assert cf.rollbacks == 1
    assert await rollbacks_metric(svc, cf.name) == 1.0
    watchdog = svc.records.watchdog
    assert watchdog is not None and watchdog.incident is not None
    assert watchdog.incident.reason == ROLLED_BACK
    health = (await svc.client.get("/health")).json()
    assert health["status"] == "degraded" and health["reason"] == ROLLED_BACK
    # The watchdog's repair (a replay of the feed) makes the filter whole and trusted again.
    await watchdog.tick()
    assert watchdog.incident is None
    assert (await svc.client.get("/health")).json()["status"] == "ok"
    assert await cf.lookup_many(SINCE) == [True] * len(SINCE)
    assert not cf.rolled_back  # that lookup read the filter whole again
    r = await svc.client.get("/records/never-written-0")
    assert r.status_code == 404


async def test_api_items_added_since_are_never_absent(svc: Service) -> None:
    r = await svc.client.put("/filters/users", json={"capacity": 1000}, headers=AUTH)
    assert r.status_code == 201
    await svc.client.post("/filters/users/add", json={"items": ["first"]}, headers=AUTH)
    pattern = f"{svc.settings.key_prefix}{{users}}*"
    saved = await snapshot(svc.redis, pattern)
    r = await svc.client.post("/filters/users/add", json={"items": SINCE}, headers=AUTH)
    assert r.json() == {"results": [True] * len(SINCE)}
    assert (await svc.client.get(f"/filters/users/items/{SINCE[0]}")).json() == {"exists": True}
    await restore(svc.redis, pattern, saved)
    for item in SINCE:
        r = await svc.client.get(f"/filters/users/items/{item}")
        assert r.json() == {"exists": True}, item
    r = await svc.client.post("/filters/users/check", json={"items": SINCE})
    assert r.json() == {"results": [True] * len(SINCE)}
    assert await rollbacks_metric(svc, "users") == 1.0
    health = (await svc.client.get("/health")).json()
    assert health == {
        "status": "degraded",
        "redis": "ok",
        "filter": "stale",
        "reason": ROLLED_BACK,
        "name": "users",
    }
    # Re-created (a new filter, not an older copy): trusted, and no rollback counted.
    assert (
        await svc.client.delete("/filters/users?confirm=users", headers=AUTH)
    ).status_code == 204
    r = await svc.client.put("/filters/users", json={"capacity": 1000}, headers=AUTH)
    assert r.status_code == 201
    await svc.client.post("/filters/users/add", json={"items": ["first"]}, headers=AUTH)
    r = await svc.client.post("/filters/users/check", json={"items": ["first", *SINCE]})
    assert r.json()["results"][0] is True and sum(r.json()["results"]) < len(SINCE) // 2
    assert (await svc.client.get("/health")).json()["status"] == "ok"
    assert await rollbacks_metric(svc, "users") == 1.0
