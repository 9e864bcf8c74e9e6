"""Deletes that find nothing (the one way a cuckoo filter loses a key) are visible: in the
filter's info and as a Prometheus gauge per filter; the records path never makes one."""

from __future__ import annotations

import re

import pytest

from devkit.service import AUTH
from tests.reliability.conftest import StartApp

pytestmark = pytest.mark.realredis


def gauge(metrics: str, name: str, filter_name: str) -> float | None:
    match = re.search(rf'^{name}{{filter="{re.escape(filter_name)}"}} (\S+)$', metrics, re.M)
    return None if match is None else float(match.group(1))


class TestMissedDeletes:
    async def test_counted_in_info_and_metrics(self, start_app: StartApp) -> None:
        svc = await start_app()
        c = svc.client
        await c.put("/filters/f", json={"capacity": 100}, headers=AUTH)
        await c.post("/filters/f/add", json={"items": ["a", "b"]}, headers=AUTH)
        metrics = (await c.get("/metrics")).text
        assert gauge(metrics, "guard_filter_missed_deletes", "f") == 0
        # Two deletes of items never inserted, one of an item that is there.
        r = await c.post("/filters/f/delete", json={"items": ["never-1", "a"]}, headers=AUTH)
        assert r.json() == {"results": [False, True]}
        assert (await c.delete("/filters/f/items/never-2", headers=AUTH)).json() == {
            "deleted": False
        }
        info = (await c.get("/filters/f")).json()
        assert (info["missed_deletes"], info["deletes"], info["items"]) == (2, 1, 1)
        metrics = (await c.get("/metrics")).text
        assert gauge(metrics, "guard_filter_missed_deletes", "f") == 2
        assert "# HELP guard_filter_missed_deletes" in metrics
        # A dropped filter stops being reported.
        await c.delete("/filters/f?confirm=f", headers=AUTH)
        assert gauge((await c.get("/metrics")).text, "guard_filter_missed_deletes", "f") is None

    async def test_records_path_never_misses(self, start_app: StartApp) -> None:
        """Deletes reach the filter only after the database removed a row."""
        svc = await start_app()
        c = svc.client
        for n in range(1, 21):
            assert (await c.delete(f"/records/user-{n}", headers=AUTH)).status_code == 204
            assert (await c.delete(f"/records/user-{n}", headers=AUTH)).status_code == 404
        assert (await c.delete("/records/never-there", headers=AUTH)).status_code == 404
        info = (await c.get("/filters/records")).json()
        assert (info["deletes"], info["missed_deletes"], info["items"]) == (20, 0, 30)
        metrics = (await c.get("/metrics")).text
        assert gauge(metrics, "guard_filter_missed_deletes", "records") == 0
