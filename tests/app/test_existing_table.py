"""The service fronting a table it did not create (GUARD_RECORDS_TABLE and friends), on
SQLite and PostgreSQL: integer keys as text, records as objects of columns, 422s."""

from __future__ import annotations

import pytest

from tests.app.conftest import AUTH, Service, StartService
from tests.app.dbs import Other

USERS = "CREATE TABLE users (id bigint PRIMARY KEY, email text NOT NULL, name text)"


@pytest.fixture
async def users(db_url: str, other: Other, start: StartService) -> Service:
    # The database first: set up before the service, dropped after it stopped.
    await other(USERS)
    await other("INSERT INTO users VALUES (1, 'a@example.com', 'Ann'), (2, 'b@example.com', 'Bob')")
    return await start(
        database_url=db_url,
        records_table="users",
        records_key_column="id",
        records_columns="id,email,name",
        demo_records=50,
    )


class TestExistingTable:
    """Reads, writes and errors through HTTP."""

    async def test_reads(self, users: Service) -> None:
        r = await users.client.get("/records/1")
        assert r.status_code == 200
        assert r.json() == {"key": "1", "value": {"id": 1, "email": "a@example.com", "name": "Ann"}}
        for absent in ("3", "01", "abc"):
            r = await users.client.get(f"/records/{absent}")
            assert r.status_code == 404 and r.headers["X-Guard"] == "blocked"
        assert await users.db.count() == 2  # never seeded with demo rows

    async def test_writes(self, users: Service) -> None:
        body = {"value": {"email": "c@example.com", "name": "Cy"}}
        r = await users.client.put("/records/3", json=body, headers=AUTH)
        assert r.status_code == 201
        r = await users.client.get("/records/3")
        assert r.json()["value"] == {"id": 3, "email": "c@example.com", "name": "Cy"}
        r = await users.client.put("/records/3", json={"value": {"name": "Di"}}, headers=AUTH)
        assert r.status_code == 200
        assert (await users.client.get("/records/3")).json()["value"]["name"] == "Di"
        assert (await users.client.delete("/records/3", headers=AUTH)).status_code == 204
        r = await users.client.get("/records/3")
        assert r.status_code == 404

    @pytest.mark.parametrize(
        ("key", "value", "loc"),
        [
            ("4", {"nickname": "x"}, ["body", "value", "nickname"]),
            ("4", {"id": 5, "name": "x"}, ["body", "value", "id"]),
            ("4", "just text", ["body", "value"]),
            ("4", {"name": "no email"}, ["body", "value"]),  # NOT NULL
            ("four", {"name": "x"}, ["path", "key"]),
        ],
    )
    async def test_bad_writes_are_422_naming_the_field(
        self, users: Service, key: str, value: object, loc: list[str]
    ) -> None:
        r = await users.client.put(f"/records/{key}", json={"value": value}, headers=AUTH)
        assert r.status_code == 422
        assert r.json()["detail"][0]["loc"][: len(loc)] == loc
        assert await users.db.count() == 2


class TestOwnTable:
    """The service's own records table, on each database: the demo rows, writes, a rebuild."""

    async def test_records_round_trip(self, db_url: str, start: StartService) -> None:
        svc = await start(database_url=db_url, demo_records=50)
        assert (await svc.client.get("/records/user-7")).json()["value"] == "value-7"
        r = await svc.client.put("/records/new", json={"value": {"a": [1]}}, headers=AUTH)
        assert r.status_code == 201
        assert (await svc.client.get("/records/new")).json()["value"] == {"a": [1]}
        assert (await svc.client.delete("/records/user-7", headers=AUTH)).status_code == 204
        await svc.records.rebuild()
        assert (await svc.client.get("/records/new")).status_code == 200
        r = await svc.client.get("/records/user-7")
        assert r.status_code == 404 and r.headers["X-Guard"] == "blocked"
        assert await svc.db.newest_change() == 50 + 2
