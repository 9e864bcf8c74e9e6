"""Bad input on every route is a 422 naming the field, and changes nothing (issue #13 §3).

Python's json module reads `NaN`, `Infinity` and `-Infinity` (and `1e400` overflows to
infinity), so the service sees non-finite floats no JSON answer can carry."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from tests.app.conftest import AUTH, Service
from tests.app.test_filters_api import create, field_error

NON_FINITE = ["NaN", "Infinity", "-Infinity", "1e400"]
WRONG_TYPES = ['"text"', "true", "null", "[1]", '{"a": 1}', "1.5"]
MARK = "__RAW__"

# Every route with a JSON body: (method, path, a valid body).
RESERVE = ("PUT", "/filters/fresh", {"capacity": 1000})
ITEMS = [
    ("POST", "/filters/users/add", {"items": ["a"]}),
    ("POST", "/filters/users/check", {"items": ["a"]}),
    ("POST", "/filters/users/delete", {"items": ["a"]}),
]
RECORD = ("PUT", "/records/k", {"value": 1})

# (route, field path in the body): every field of every body.
FIELDS = [
    *[(RESERVE, (f,)) for f in ("capacity", "error_rate", "fingerprint_bits", "bucket_size",
                                 "max_kicks", "expansion")],
    *[(route, ("items",)) for route in ITEMS],
    *[(route, ("items", 0)) for route in ITEMS],
]  # fmt: skip


def with_raw(body: dict[str, Any], path: tuple[str | int, ...], raw: str) -> bytes:
    """`body` as JSON text with the value at `path` replaced by the raw token `raw`."""
    doc = copy.deepcopy(body)
    target: Any = doc
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = MARK
    return json.dumps(doc).replace(f'"{MARK}"', raw).encode()


async def send(svc: Service, route: tuple[str, str, dict[str, Any]], content: bytes) -> Any:
    method, url, _ = route
    headers = {**AUTH, "Content-Type": "application/json"}
    return await svc.client.request(method, url, content=content, headers=headers)


def wrong_types(path: tuple[str | int, ...]) -> list[str]:
    # A float is right for error_rate; a number where a string goes is wrong for items.
    name = path[0]
    if name == "error_rate":
        return [t for t in WRONG_TYPES if t not in ("1.5", "null")]
    if path == ("items", 0):
        return [t for t in WRONG_TYPES if t != '"text"'] + ["1"]
    if path == ("items",):
        return [t for t in WRONG_TYPES if t != "[1]"]  # [1] is wrong at items.0 (above)
    return [t for t in WRONG_TYPES if t != "null"]


CASES = [
    pytest.param(route, path, raw, id=f"{route[0]} {route[1]} {'.'.join(map(str, path))}={raw}")
    for route, path in FIELDS
    for raw in NON_FINITE + wrong_types(path)
]


class TestEveryFieldAnswers422:
    @pytest.mark.parametrize(("route", "path", "raw"), CASES)
    async def test_bad_value_is_422_naming_the_field(
        self,
        svc: Service,
        route: tuple[str, str, dict[str, Any]],
        path: tuple[str | int, ...],
        raw: str,
    ) -> None:
        await create(svc)
        r = await send(svc, route, with_raw(route[2], path, raw))
        assert r.status_code == 422, r.text
        field_error(r, "body", *path)
        # Nothing was written: no filter created, no item added.
        assert (await svc.client.get("/filters/fresh")).status_code == 404
        assert (await svc.client.get("/filters/users")).json()["items"] == 0


class TestRecordValuesAreFinite:
    """`PUT /records/{key}` with a non-finite number: 422, and neither row nor filter changes."""

    @pytest.mark.parametrize(
        "value", ["NaN", "Infinity", "-Infinity", "1e400", '{"a": [1, NaN]}', "[-Infinity]"]
    )
    async def test_new_key_is_refused_and_nothing_is_written(
        self, svc: Service, value: str
    ) -> None:
        info = (await svc.client.get("/filters/records")).json()
        r = await send(svc, RECORD, f'{{"value": {value}}}'.encode())
        assert r.status_code == 422, r.text
        assert "finite" in field_error(r, "body", "value")
        assert await svc.db.get("k") is None
        assert (await svc.client.get("/filters/records")).json()["items"] == info["items"]
        r = await svc.client.get("/records/k")
        assert r.status_code == 404 and r.headers["x-guard"] == "blocked"

    async def test_existing_row_keeps_its_value(self, svc: Service) -> None:
        r = await svc.client.put("/records/user-1", content=b'{"value": NaN}', headers=AUTH)
        assert r.status_code == 422
        r = await svc.client.get("/records/user-1")
        assert r.json() == {"key": "user-1", "value": "value-1"}

    async def test_store_refuses_non_finite_before_writing(self, svc: Service) -> None:
        """The store itself, whoever calls it: no row, no fingerprint."""
        info = (await svc.client.get("/filters/records")).json()
        with pytest.raises(ValueError):
            await svc.records.put("k", float("nan"))
        assert await svc.db.get("k") is None
        assert (await svc.client.get("/filters/records")).json()["items"] == info["items"]


# Not UTF-8 once percent-decoded: a stray byte, an overlong "/", a UTF-16 surrogate, a lone
# continuation byte, a truncated sequence. The server would decode each to U+FFFD.
NOT_UTF8 = ["%FF", "%FE", "%C0%AF", "%ED%A0%80", "a%80b", "%E2%82"]


def path_params(spec: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(method, path, parameter) for every path parameter of every route in the schema."""
    return [
        (method.upper(), path, p["name"])
        for path, ops in spec["paths"].items()
        for method, op in ops.items()
        for p in op.get("parameters", [])
        if p["in"] == "path"
    ]


class TestPathsAreUtf8:
    """Invalid UTF-8 in a path or query is a 422 naming the parameter, on every route (issue
    #13 §3): otherwise `/records/%FF` and `/records/%FE` are one key."""

    @pytest.mark.parametrize("bad", NOT_UTF8)
    async def test_every_path_parameter(self, svc: Service, bad: str) -> None:
        await create(svc)
        params = path_params((await svc.client.get("/openapi.json")).json())
        assert len(params) >= 10
        for method, path, name in params:
            values = {"name": "users", "item": "x", "key": "user-1", name: bad}
            url = path.format(**values)
            body = {"items": ["x"]} if method == "POST" else {"value": 1}
            r = await svc.client.request(method, url, json=body, headers=AUTH)
            assert r.status_code == 422, (method, url, r.status_code, r.text)
            assert "UTF-8" in field_error(r, "path", name), (method, url)

    async def test_two_bad_keys_do_not_collapse_into_one(self, svc: Service) -> None:
        r = await svc.client.put("/records/%FF", json={"value": 1}, headers=AUTH)
        assert r.status_code == 422
        assert await svc.db.get("\ufffd") is None
        r = await svc.client.get("/records/%FE")
        assert r.status_code == 422 and "x-guard" not in r.headers

    @pytest.mark.parametrize("query", ["x=%FF", "%C0%AF=1", "a=1&b=%ED%A0%80"])
    async def test_query(self, svc: Service, query: str) -> None:
        r = await svc.client.get(f"/filters?{query}")
        assert r.status_code == 422, r.text
        assert r.json()["detail"][0]["loc"][0] == "query"

    async def test_valid_utf8_still_works(self, svc: Service) -> None:
        r = await svc.client.put("/records/caf%C3%A9", json={"value": 1}, headers=AUTH)
        assert r.status_code == 201
        assert (await svc.client.get("/records/café")).json() == {"key": "café", "value": 1}
