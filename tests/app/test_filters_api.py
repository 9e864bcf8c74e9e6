"""The filter API: every route's happy path and errors, auth, limits, idempotency."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from pydantic import ValidationError

from app.deps import require_read_key, valid_filter_name, valid_path_item
from app.routes import filters
from app.routing import DirectRoute
from app.settings import Settings
from guard import CuckooFilter
from tests import colliding_items
from tests.app.conftest import AUTH, Service, StartService

INFO_FIELDS = {
    "name", "capacity", "items", "buckets", "bucket_size", "fingerprint_bits", "max_kicks",
    "expansion", "subfilters", "load_factor", "memory_bytes", "error_rate", "deletes",
    "missed_deletes",
}  # fmt: skip


async def create(
    svc: Service, name: str = "users", *, headers: dict[str, str] = AUTH, **body: object
) -> dict[str, object]:
    r = await svc.client.put(f"/filters/{name}", json={"capacity": 1000, **body}, headers=headers)
    assert r.status_code == 201, r.text
    return dict(r.json())


def field_error(r: object, *loc: object) -> str:
    """The message of the 422 entry whose loc is `loc`."""
    body = r.json()  # type: ignore[attr-defined]
    for entry in body["detail"]:
        if tuple(entry["loc"]) == loc:
            return str(entry["msg"])
    raise AssertionError(f"no error at {loc}: {body}")


class TestFilterLifecycle:
    """PUT / GET / list / DELETE of filters."""

    async def test_create_returns_info(self, svc: Service) -> None:
        info = await create(svc, error_rate=0.01)
        assert info.keys() >= INFO_FIELDS
        assert info["name"] == "users" and info["capacity"] == 1000 and info["items"] == 0

    async def test_create_with_fingerprint_bits(self, svc: Service) -> None:
        info = await create(svc, fingerprint_bits=12, bucket_size=2, expansion=0)
        assert (info["fingerprint_bits"], info["bucket_size"], info["expansion"]) == (12, 2, 0)

    async def test_create_existing_is_409(self, svc: Service) -> None:
        await create(svc)
        r = await svc.client.put("/filters/users", json={"capacity": 10}, headers=AUTH)
        assert r.status_code == 409
        assert "exists" in r.json()["detail"]

    async def test_get_info(self, svc: Service) -> None:
        await create(svc)
        r = await svc.client.get("/filters/users")
        assert r.status_code == 200
        assert r.json()["name"] == "users"

    async def test_get_missing_is_404(self, svc: Service) -> None:
        r = await svc.client.get("/filters/nope")
        assert r.status_code == 404
        assert "nope" in r.json()["detail"]

    async def test_list_includes_created_and_records(self, svc: Service) -> None:
        await create(svc, "a")
        await create(svc, "b")
        r = await svc.client.get("/filters")
        assert r.status_code == 200
        names = [f["name"] for f in r.json()["filters"]]
        assert names == sorted(names) and {"a", "b", "records"} <= set(names)

    async def test_delete(self, svc: Service) -> None:
        await create(svc)
        r = await svc.client.delete("/filters/users?confirm=users", headers=AUTH)
        assert r.status_code == 204 and r.content == b""
        assert (await svc.client.get("/filters/users")).status_code == 404

    async def test_delete_missing_is_404(self, svc: Service) -> None:
        r = await svc.client.delete("/filters/nope?confirm=nope", headers=AUTH)
        assert r.status_code == 404

    @pytest.mark.parametrize("query", ["", "?confirm=", "?confirm=other", "?confirm=USERS"])
    async def test_delete_needs_the_name_confirmed(self, svc: Service, query: str) -> None:
        """What a client that normalises URLs makes of DELETE /filters/users/items/.. (httpx:
        DELETE /filters/users) must not drop the filter: `?confirm=<name>` is required."""
        await create(svc)
        await svc.client.put("/filters/users/items/a", headers=AUTH)
        r = await svc.client.delete(f"/filters/users{query}", headers=AUTH)
        assert r.status_code == 422
        assert "DELETE /filters/users?confirm=users" in field_error(r, "query", "confirm")
        assert (await svc.client.get("/filters/users")).json()["items"] == 1


class TestItems:
    """Batch add/check/delete and single-item routes."""

    async def test_add_check_delete_batch(self, svc: Service) -> None:
        await create(svc)
        r = await svc.client.post("/filters/users/add", json={"items": ["a", "b"]}, headers=AUTH)
        assert r.status_code == 200 and r.json() == {"results": [True, True]}
        r = await svc.client.post("/filters/users/check", json={"items": ["a", "b", "zz"]})
        assert r.json() == {"results": [True, True, False]}
        r = await svc.client.post("/filters/users/delete", json={"items": ["a", "q"]}, headers=AUTH)
        assert r.status_code == 200 and r.json() == {"results": [True, False]}
        r = await svc.client.post("/filters/users/check", json={"items": ["a", "b"]})
        assert r.json() == {"results": [False, True]}

    async def test_add_inserts_a_copy_per_item(self, svc: Service) -> None:
        await create(svc)
        r = await svc.client.post("/filters/users/add", json={"items": ["a", "a"]}, headers=AUTH)
        assert r.json() == {"results": [True, True]}
        await svc.client.post("/filters/users/delete", json={"items": ["a"]}, headers=AUTH)
        r = await svc.client.post("/filters/users/check", json={"items": ["a"]})
        assert r.json() == {"results": [True]}  # one copy left for the second add

    async def test_unique_add_is_not_offered(self, svc: Service) -> None:
        """A "unique" add skips an item that merely collides with another: refused, by name."""
        await create(svc)
        body = {"items": ["a"], "unique": True}
        r = await svc.client.post("/filters/users/add", json=body, headers=AUTH)
        assert r.status_code == 422
        field_error(r, "body", "unique")

    async def test_add_to_full_fixed_filter_is_507_with_results(self, svc: Service) -> None:
        await create(svc, capacity=8, expansion=0, bucket_size=1, fingerprint_bits=8)
        items = [f"item-{i}" for i in range(200)]
        r = await svc.client.post("/filters/users/add", json={"items": items}, headers=AUTH)
        assert r.status_code == 507
        body = r.json()
        assert "full" in body["detail"]
        results = body["results"]
        assert len(results) == 200 and results[0] is True and results[-1] is False
        added = [item for item, ok in zip(items, results, strict=True) if ok]
        r = await svc.client.post("/filters/users/check", json={"items": added})
        assert all(r.json()["results"])

    async def test_batch_routes_on_missing_filter_are_404(self, svc: Service) -> None:
        for path, headers in (("add", AUTH), ("check", {}), ("delete", AUTH)):
            r = await svc.client.post(
                f"/filters/nope/{path}", json={"items": ["a"]}, headers=headers
            )
            assert r.status_code == 404, path

    async def test_each_put_adds_a_copy_each_delete_removes_one(self, svc: Service) -> None:
        await create(svc)
        for _ in range(2):
            r = await svc.client.put("/filters/users/items/alice", headers=AUTH)
            assert r.status_code == 201 and r.json() == {"added": True}
        assert (await svc.client.get("/filters/users")).json()["items"] == 2
        await svc.client.delete("/filters/users/items/alice", headers=AUTH)
        assert (await svc.client.get("/filters/users/items/alice")).json() == {"exists": True}
        await svc.client.delete("/filters/users/items/alice", headers=AUTH)
        assert (await svc.client.get("/filters/users/items/alice")).json() == {"exists": False}

    async def test_put_retried_with_idempotency_key_adds_once(self, svc: Service) -> None:
        await create(svc)
        headers = {**AUTH, "Idempotency-Key": "put-1"}
        for _ in range(2):
            r = await svc.client.put("/filters/users/items/alice", headers=headers)
            assert r.status_code == 201 and r.json() == {"added": True}
        assert (await svc.client.get("/filters/users")).json()["items"] == 1

    async def test_get_item(self, svc: Service) -> None:
        await create(svc)
        await svc.client.put("/filters/users/items/alice", headers=AUTH)
        assert (await svc.client.get("/filters/users/items/alice")).json() == {"exists": True}
        assert (await svc.client.get("/filters/users/items/bob")).json() == {"exists": False}

    async def test_item_with_slash_and_unicode(self, svc: Service) -> None:
        await create(svc)
        r = await svc.client.put("/filters/users/items/a/b%20c/%C3%A9", headers=AUTH)
        assert r.status_code == 201
        r = await svc.client.post("/filters/users/check", json={"items": ["a/b c/é"]})
        assert r.json() == {"results": [True]}

    async def test_delete_item(self, svc: Service) -> None:
        await create(svc)
        await svc.client.put("/filters/users/items/alice", headers=AUTH)
        r = await svc.client.delete("/filters/users/items/alice", headers=AUTH)
        assert r.status_code == 200 and r.json() == {"deleted": True}
        r = await svc.client.delete("/filters/users/items/alice", headers=AUTH)
        assert r.json() == {"deleted": False}

    async def test_item_routes_on_missing_filter_are_404(self, svc: Service) -> None:
        assert (await svc.client.put("/filters/no/items/a", headers=AUTH)).status_code == 404
        assert (await svc.client.get("/filters/no/items/a")).status_code == 404
        assert (await svc.client.delete("/filters/no/items/a", headers=AUTH)).status_code == 404

    async def test_put_item_into_full_filter_is_507(self, svc: Service) -> None:
        await create(svc, capacity=1, expansion=0, bucket_size=1, fingerprint_bits=4)
        codes = set()
        for i in range(64):
            r = await svc.client.put(f"/filters/users/items/i{i}", headers=AUTH)
            codes.add(r.status_code)
            if r.status_code == 507:
                assert r.json()["results"] == [False]
                break
        assert 507 in codes


MUTATIONS = [
    ("PUT", "/filters/users", {"capacity": 10}),
    ("DELETE", "/filters/users?confirm=users", None),
    ("POST", "/filters/users/add", {"items": ["a"]}),
    ("POST", "/filters/users/delete", {"items": ["a"]}),
    ("POST", "/filters/records/rebuild", None),
    ("PUT", "/filters/users/items/a", None),
    ("DELETE", "/filters/users/items/a", None),
    ("PUT", "/records/k", {"value": 1}),
    ("DELETE", "/records/k", None),
]


class TestItemLookup:
    """GET /filters/{name}/items/{item}: one list of checks (the route's RequestChecks), then
    get_item, called by DirectRoute; FastAPI's own handling of the route never runs."""

    async def test_checks_then_get_item(self, start: StartService) -> None:
        svc = await start(protect_reads=True)
        await create(svc)
        await svc.client.put("/filters/users/items/alice", headers=AUTH)
        # Every app serves the route object of the module's router: put back after the test.
        route = next(r for r in filters.router.routes if isinstance(r, DirectRoute))
        assert route.endpoint is filters.get_item
        assert route.checks == (require_read_key, valid_filter_name, valid_path_item)
        declared, through = route.declared, []

        async def counted(scope: Any, receive: Any, send: Any) -> None:
            through.append(scope["path"])
            await declared(scope, receive, send)

        route.declared = counted
        try:
            await self.lookups(svc)
        finally:
            route.declared = declared
        assert through == []

    async def lookups(self, svc: Service) -> None:
        get = svc.client.get
        assert (await get("/filters/users/items/alice", headers=AUTH)).json() == {"exists": True}
        assert (await get("/filters/users/items/bob", headers=AUTH)).json() == {"exists": False}
        assert (await get("/filters/nope/items/a", headers=AUTH)).status_code == 404
        r = await get("/filters/users/items/alice")
        assert r.status_code == 401 and r.json() == {"detail": "missing or invalid API key"}
        # The name's 422 is FastAPI's own, as on every other route with a {name}.
        bad_name = await get("/filters/-x/items/a", headers=AUTH)
        assert bad_name.status_code == 422
        assert bad_name.json() == (await get("/filters/-x", headers=AUTH)).json()
        long = "x" * (svc.settings.max_item_bytes + 1)
        r = await get(f"/filters/users/items/{long}", headers=AUTH)
        assert "bytes of UTF-8" in field_error(r, "path", "item")
        r = await get("/filters/users/items/%2E%2E", headers=AUTH)
        assert "POST /filters/users/add, /check or /delete" in field_error(r, "path", "item")

    def test_endpoint_takes_only_path_parameters_and_request(self) -> None:
        async def lookup(name: str, request: object, extra: int) -> None: ...

        with pytest.raises(TypeError, match="path parameters and request"):
            DirectRoute("/filters/{name}", lookup)


class TestAuth:
    """Every mutating route needs the bearer key; reads do not by default outside production."""

    async def test_mutation_without_key_is_401(self, svc: Service) -> None:
        bad_headers: list[dict[str, Any]] = [
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": "Basic dGVzdC1rZXk="},
            {"Authorization": "Bearer"},
            {"Authorization": "Bearer tést".encode("latin-1")},  # non-ASCII must not crash
        ]
        for method, path, body in MUTATIONS:
            for headers in bad_headers:
                r = await svc.client.request(method, path, json=body, headers=headers)
                assert r.status_code == 401, (method, path, headers)
                assert r.headers["www-authenticate"] == "Bearer"
        assert (await svc.client.get("/filters/users")).status_code == 404  # nothing created
        assert (await svc.client.get("/records/user-1")).status_code == 200  # nothing deleted

    async def test_reads_need_no_key(self, svc: Service) -> None:
        await create(svc)
        assert (await svc.client.get("/filters")).status_code == 200
        assert (await svc.client.get("/filters/users")).status_code == 200
        assert (
            await svc.client.post("/filters/users/check", json={"items": ["a"]})
        ).status_code == 200
        assert (await svc.client.get("/filters/users/items/a")).status_code == 200

    async def test_no_key_configured_means_open(self, start: StartService) -> None:
        svc = await start(api_key="")
        r = await svc.client.put("/filters/users", json={"capacity": 10})
        assert r.status_code == 201


STRONG_KEY = "k3y-for-the-read-auth-tests-0123456789abcdef"
STRONG = {"Authorization": f"Bearer {STRONG_KEY}"}
READS = [
    ("GET", "/filters", None),
    ("GET", "/filters/users", None),
    ("POST", "/filters/users/check", {"items": ["a"]}),
    ("GET", "/filters/users/items/a", None),
]


class TestReadAuth:
    """GUARD_PROTECT_READS: filter reads need the key (by default in production); the guarded
    /records routes stay public."""

    async def statuses(self, svc: Service, headers: dict[str, str]) -> list[int]:
        return [
            (await svc.client.request(m, p, json=body, headers=headers)).status_code
            for m, p, body in READS
        ]

    async def test_production_default_needs_the_key(self, start: StartService) -> None:
        svc = await start(env="production", api_key=STRONG_KEY)
        await create(svc, headers=STRONG)
        assert await self.statuses(svc, {}) == [401] * 4
        assert await self.statuses(svc, {"Authorization": "Bearer wrong"}) == [401] * 4
        assert await self.statuses(svc, STRONG) == [200] * 4
        r = await svc.client.get("/records/user-1")
        assert r.status_code == 200 and r.headers["x-guard"] == "passed"

    async def test_no_key_does_not_tell_a_filter_exists(self, start: StartService) -> None:
        svc = await start(protect_reads=True)
        assert (await svc.client.get("/filters/nope")).status_code == 401
        assert (await svc.client.get("/filters/nope", headers=AUTH)).status_code == 404

    async def test_production_can_open_reads(self, start: StartService) -> None:
        svc = await start(env="production", api_key=STRONG_KEY, protect_reads=False)
        await create(svc, headers=STRONG)
        assert await self.statuses(svc, {}) == [200] * 4

    async def test_development_can_close_reads(self, start: StartService) -> None:
        svc = await start(protect_reads=True)
        await create(svc)
        assert await self.statuses(svc, {}) == [401] * 4
        assert await self.statuses(svc, AUTH) == [200] * 4

    def test_protected_reads_need_a_key(self) -> None:
        with pytest.raises(ValidationError, match="GUARD_PROTECT_READS"):
            Settings(protect_reads=True, api_key="")


class TestLimits:
    """Bad input is a 4xx naming the field and the limit, never a 500."""

    @pytest.mark.parametrize("name", ["-bad", "a" * 65, "sp ace", "ü", ".dot", "a%0A"])
    async def test_bad_filter_name(self, svc: Service, name: str) -> None:
        r = await svc.client.put(f"/filters/{name}", json={"capacity": 10}, headers=AUTH)
        assert r.status_code == 422
        assert "pattern" in field_error(r, "path", "name")

    async def test_batch_over_limit(self, start: StartService) -> None:
        svc = await start(max_batch=5)
        await create(svc)
        r = await svc.client.post("/filters/users/check", json={"items": list("abcdef")})
        assert r.status_code == 422
        assert "at most 5" in field_error(r, "body", "items")

    async def test_default_batch_limit_is_10000(self, svc: Service) -> None:
        await create(svc)
        ok = await svc.client.post("/filters/users/check", json={"items": ["x"] * 10_000})
        assert ok.status_code == 200
        r = await svc.client.post("/filters/users/check", json={"items": ["x"] * 10_001})
        assert r.status_code == 422 and "10000" in field_error(r, "body", "items")

    async def test_item_too_long(self, svc: Service) -> None:
        await create(svc)
        r = await svc.client.post(
            "/filters/users/add", json={"items": ["ok", "é" * 513]}, headers=AUTH
        )
        assert r.status_code == 422
        assert "1-1024 bytes" in field_error(r, "body", "items", 1)
        r = await svc.client.put("/filters/users/items/" + "x" * 1025, headers=AUTH)
        assert "1-1024 bytes" in field_error(r, "path", "item")

    async def test_item_at_limit_is_fine(self, svc: Service) -> None:
        await create(svc)
        r = await svc.client.post("/filters/users/add", json={"items": ["x" * 1024]}, headers=AUTH)
        assert r.status_code == 200

    async def test_empty_item(self, svc: Service) -> None:
        await create(svc)
        r = await svc.client.post("/filters/users/check", json={"items": [""]})
        assert r.status_code == 422 and "1-1024" in field_error(r, "body", "items", 0)

    async def test_lone_surrogate_item(self, svc: Service) -> None:
        await create(svc)
        r = await svc.client.post(
            "/filters/users/check", content=b'{"items": ["\\ud800"]}',
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        assert r.status_code == 422 and "UTF-8" in field_error(r, "body", "items", 0)

    async def test_non_string_items(self, svc: Service) -> None:
        await create(svc)
        r = await svc.client.post("/filters/users/check", json={"items": [1, None]})
        assert r.status_code == 422
        assert field_error(r, "body", "items", 0)

    async def test_unknown_field(self, svc: Service) -> None:
        r = await svc.client.put("/filters/u", json={"capacity": 10, "capacty": 5}, headers=AUTH)
        assert r.status_code == 422 and field_error(r, "body", "capacty")

    async def test_capacity_limits(self, start: StartService) -> None:
        svc = await start(max_capacity=1000)
        r = await svc.client.put("/filters/u", json={"capacity": 1001}, headers=AUTH)
        assert r.status_code == 422 and "at most 1000" in field_error(r, "body", "capacity")
        r = await svc.client.put("/filters/u", json={"capacity": 0}, headers=AUTH)
        assert r.status_code == 422 and field_error(r, "body", "capacity")

    @pytest.mark.parametrize(
        ("body", "word"),
        [({"bucket_size": 3}, "bucket_size"), ({"expansion": 99}, "expansion"),
         ({"max_kicks": -1}, "max_kicks"), ({"fingerprint_bits": 40}, "fingerprint_bits"),
         ({"error_rate": 1e-12}, "error_rate")],
    )  # fmt: skip
    async def test_library_parameter_errors_are_422(
        self, svc: Service, body: dict[str, object], word: str
    ) -> None:
        r = await svc.client.put("/filters/u", json={"capacity": 10, **body}, headers=AUTH)
        assert r.status_code == 422
        assert word in field_error(r, "body", word)

    async def test_error_rate_and_fingerprint_bits_together(self, svc: Service) -> None:
        body = {"capacity": 10, "error_rate": 0.01, "fingerprint_bits": 8}
        r = await svc.client.put("/filters/u", json=body, headers=AUTH)
        assert r.status_code == 422 and "not both" in r.text

    async def test_body_over_limit_is_413(self, start: StartService) -> None:
        svc = await start(max_body_bytes=2048)
        await create(svc)
        big = {"items": ["x" * 100] * 30}
        r = await svc.client.post("/filters/users/check", json=big)
        assert r.status_code == 413 and "2048" in r.json()["detail"]

    async def test_chunked_body_over_limit_is_413(self, start: StartService) -> None:
        svc = await start(max_body_bytes=2048)

        async def chunks():  # type: ignore[no-untyped-def]
            for _ in range(10):
                yield b" " * 500

        r = await svc.client.post("/filters/users/check", content=chunks())
        assert r.status_code == 413

    async def test_invalid_json(self, svc: Service) -> None:
        r = await svc.client.post(
            "/filters/users/check", content=b"{nope", headers={"Content-Type": "application/json"}
        )
        assert r.status_code == 422


class TestRecordsFilterIsManaged:
    """The table-backed filter can be read and rebuilt, not changed by hand."""

    @pytest.mark.parametrize(
        ("method", "path", "body"),
        [("PUT", "/filters/records", {"capacity": 10}),
         ("DELETE", "/filters/records?confirm=records", None),
         ("POST", "/filters/records/add", {"items": ["a"]}),
         ("POST", "/filters/records/delete", {"items": ["user-1"]}),
         ("PUT", "/filters/records/items/a", None),
         ("DELETE", "/filters/records/items/user-1", None)],
    )  # fmt: skip
    async def test_mutation_is_409(
        self, svc: Service, method: str, path: str, body: object
    ) -> None:
        r = await svc.client.request(method, path, json=body, headers=AUTH)
        assert r.status_code == 409 and "records table" in r.json()["detail"]
        r = await svc.client.post("/filters/records/check", json={"items": ["user-1"]})
        assert r.json() == {"results": [True]}

    async def test_rebuild(self, svc: Service) -> None:
        r = await svc.client.post("/filters/records/rebuild", headers=AUTH)
        assert r.status_code == 200 and r.json()["items"] == 50

    async def test_rebuild_of_plain_filter_is_409(self, svc: Service) -> None:
        await create(svc)
        r = await svc.client.post("/filters/users/rebuild", headers=AUTH)
        assert r.status_code == 409 and "not backed by a table" in r.json()["detail"]

    async def test_rebuild_of_missing_filter_is_404(self, svc: Service) -> None:
        assert (await svc.client.post("/filters/nope/rebuild", headers=AUTH)).status_code == 404

    async def test_concurrent_rebuild_is_409(self, svc: Service) -> None:
        lock = svc.redis.lock(svc.records.rebuilder.lock_key, timeout=10)
        assert await lock.acquire(blocking=False)
        try:
            r = await svc.client.post("/filters/records/rebuild", headers=AUTH)
            assert r.status_code == 409 and "already running" in r.json()["detail"]
        finally:
            await lock.release()


class TestIdempotency:
    """A retried add or delete with the same Idempotency-Key runs once."""

    async def test_retried_add_inserts_once(self, svc: Service) -> None:
        await create(svc)
        headers = {**AUTH, "Idempotency-Key": "k1"}
        first = await svc.client.post("/filters/users/add", json={"items": ["a"]}, headers=headers)
        again = await svc.client.post("/filters/users/add", json={"items": ["a"]}, headers=headers)
        assert first.json() == again.json() == {"results": [True]}
        assert again.headers["idempotent-replayed"] == "true"
        assert (await svc.client.get("/filters/users")).json()["items"] == 1

    async def test_retried_delete_deletes_once(self, svc: Service) -> None:
        await create(svc)
        await svc.client.post("/filters/users/add", json={"items": ["a", "a"]}, headers=AUTH)
        headers = {**AUTH, "Idempotency-Key": "d1"}
        for _ in range(3):
            r = await svc.client.post(
                "/filters/users/delete", json={"items": ["a"]}, headers=headers
            )
            assert r.json() == {"results": [True]}
        # Two copies went in, one delete ran: one copy is left.
        assert (await svc.client.get("/filters/users/items/a")).json() == {"exists": True}

    async def test_single_item_routes_replay(self, svc: Service) -> None:
        await create(svc)
        headers = {**AUTH, "Idempotency-Key": "p1"}
        r1 = await svc.client.put("/filters/users/items/a", headers=headers)
        r2 = await svc.client.put("/filters/users/items/a", headers=headers)
        assert (r1.status_code, r2.status_code) == (201, 201)
        headers = {**AUTH, "Idempotency-Key": "p2"}
        r1 = await svc.client.delete("/filters/users/items/a", headers=headers)
        r2 = await svc.client.delete("/filters/users/items/a", headers=headers)
        assert r1.json() == r2.json() == {"deleted": True}

    async def test_key_reused_for_other_request_is_422(self, svc: Service) -> None:
        await create(svc)
        headers = {**AUTH, "Idempotency-Key": "k2"}
        await svc.client.post("/filters/users/add", json={"items": ["a"]}, headers=headers)
        r = await svc.client.post("/filters/users/add", json={"items": ["b"]}, headers=headers)
        assert r.status_code == 422 and "different request" in field_error(
            r, "header", "Idempotency-Key"
        )

    async def test_bad_key(self, svc: Service) -> None:
        await create(svc)
        headers = {**AUTH, "Idempotency-Key": "x" * 256}
        r = await svc.client.post("/filters/users/add", json={"items": ["a"]}, headers=headers)
        assert r.status_code == 422 and "1-255" in field_error(r, "header", "Idempotency-Key")

    async def test_failed_first_attempt_releases_key(self, svc: Service) -> None:
        headers = {**AUTH, "Idempotency-Key": "k3"}
        r = await svc.client.post("/filters/users/add", json={"items": ["a"]}, headers=headers)
        assert r.status_code == 404  # nothing ran, so nothing is stored
        await create(svc)
        r = await svc.client.post("/filters/users/add", json={"items": ["a"]}, headers=headers)
        assert r.status_code == 200 and "idempotent-replayed" not in r.headers

    async def test_507_is_replayed(self, svc: Service) -> None:
        await create(svc, capacity=2, expansion=0, bucket_size=1, fingerprint_bits=4)
        headers = {**AUTH, "Idempotency-Key": "k4"}
        body = {"items": [f"i{i}" for i in range(50)]}
        r1 = await svc.client.post("/filters/users/add", json=body, headers=headers)
        items = (await svc.client.get("/filters/users")).json()["items"]
        r2 = await svc.client.post("/filters/users/add", json=body, headers=headers)
        assert r1.status_code == r2.status_code == 507 and r1.json() == r2.json()
        assert (await svc.client.get("/filters/users")).json()["items"] == items

    async def test_concurrent_duplicates_run_once(self, svc: Service) -> None:
        await create(svc)
        headers = {**AUTH, "Idempotency-Key": "k5"}
        body = {"items": [f"i{i}" for i in range(2000)]}
        rs = await asyncio.gather(
            *(svc.client.post("/filters/users/add", json=body, headers=headers) for _ in range(5))
        )
        assert all(r.status_code in (200, 409) for r in rs)
        assert sum("idempotent-replayed" not in r.headers and r.status_code == 200 for r in rs) == 1
        assert (await svc.client.get("/filters/users")).json()["items"] == 2000

    async def test_claim_for_another_request_is_422(self, start: StartService) -> None:
        svc = await start(idempotency_wait=0.1)
        await create(svc)
        idem = svc.state["idempotency"]
        # The key is claimed by a still-running request that asked for something else.
        fp = "0" * 64
        await svc.redis.set(
            idem._key("users", "k6"), f'{{"state": "pending", "fp": "{fp}", "token": "t"}}'
        )
        r = await svc.client.post(
            "/filters/users/add", json={"items": ["a"]}, headers={**AUTH, "Idempotency-Key": "k6"}
        )
        # A claim for another fingerprint means the key was reused: 422 names the header.
        assert r.status_code == 422

    async def test_pending_same_request_waits_then_409(self, start: StartService) -> None:
        from app.idempotency import request_hash

        svc = await start(idempotency_wait=0.2)
        await create(svc)
        idem = svc.state["idempotency"]
        fp = request_hash("POST", "/filters/users/add", {"items": ["a"]})
        await svc.redis.set(
            idem._key("users", "k7"), f'{{"state": "pending", "fp": "{fp}", "token": "t"}}'
        )
        r = await svc.client.post(
            "/filters/users/add", json={"items": ["a"]}, headers={**AUTH, "Idempotency-Key": "k7"}
        )
        assert r.status_code == 409 and "in progress" in r.json()["detail"]
        assert (await svc.client.get("/filters/users")).json()["items"] == 0


class TestCollidingItemsAreNeverLost:
    """Two items with the same fingerprint and buckets (issue #13 §4): adding both through any
    route and deleting one must leave the other found."""

    @pytest.fixture
    async def pair(self, svc: Service) -> tuple[str, str]:
        cf = CuckooFilter(svc.redis, "users", svc.settings.key_prefix)
        await cf.reserve(colliding_items.CAPACITY, **colliding_items.PARAMS)
        return colliding_items.colliding_pair()

    async def test_put_put_delete(self, svc: Service, pair: tuple[str, str]) -> None:
        x, y = pair
        for item in (x, y):
            r = await svc.client.put(f"/filters/users/items/{item}", headers=AUTH)
            assert r.status_code == 201 and r.json() == {"added": True}, item
        r = await svc.client.delete(f"/filters/users/items/{y}", headers=AUTH)
        assert r.json() == {"deleted": True}
        assert (await svc.client.get(f"/filters/users/items/{x}")).json() == {"exists": True}

    async def test_batch_add_add_delete(self, svc: Service, pair: tuple[str, str]) -> None:
        x, y = pair
        for item in (x, y):
            r = await svc.client.post("/filters/users/add", json={"items": [item]}, headers=AUTH)
            assert r.json() == {"results": [True]}
        r = await svc.client.post("/filters/users/delete", json={"items": [y]}, headers=AUTH)
        assert r.json() == {"results": [True]}
        r = await svc.client.post("/filters/users/check", json={"items": [x]})
        assert r.json() == {"results": [True]}

    async def test_mixed_routes(self, svc: Service, pair: tuple[str, str]) -> None:
        x, y = pair
        await svc.client.post("/filters/users/add", json={"items": [x]}, headers=AUTH)
        await svc.client.put(f"/filters/users/items/{y}", headers=AUTH)
        await svc.client.post("/filters/users/delete", json={"items": [x]}, headers=AUTH)
        assert (await svc.client.get(f"/filters/users/items/{y}")).json() == {"exists": True}
