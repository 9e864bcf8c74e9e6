"""The OpenAPI schema states the limits the API enforces: FilterParams' and GUARD_* settings'."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import pytest

from guard.params import FIELDS, min_error_rate
from tests.app.conftest import AUTH, Service, StartService


async def schemas(svc: Service) -> dict[str, Any]:
    spec = (await svc.client.get("/openapi.json")).json()
    return dict(spec["components"]["schemas"])


class TestReserveBody:
    async def test_fields_state_the_library_limits(self, svc: Service) -> None:
        props = (await schemas(svc))["ReserveIn"]["properties"]
        assert set(props) == set(FIELDS) - {"seed"}  # the service draws the seed
        assert props["bucket_size"]["enum"] == list(FIELDS["bucket_size"].limit.choices)
        assert (props["max_kicks"]["minimum"], props["max_kicks"]["maximum"]) == (0, 4000)
        assert (props["expansion"]["minimum"], props["expansion"]["maximum"]) == (0, 16)
        fp = props["fingerprint_bits"]
        assert (fp["minimum"], fp["maximum"]) == (4, 32)
        rate = props["error_rate"]
        assert (rate["exclusiveMinimum"], rate["exclusiveMaximum"]) == (0, 1)

    async def test_capacity_states_the_setting(self, start: StartService) -> None:
        svc = await start(max_capacity=1000)
        capacity = (await schemas(svc))["ReserveIn"]["properties"]["capacity"]
        assert (capacity["minimum"], capacity["maximum"]) == (1, 1000)
        assert "x-guard-limit" not in capacity

    async def test_lowest_error_rate_is_stated_and_exact(self, svc: Service) -> None:
        rules = (await schemas(svc))["ReserveIn"]["allOf"]
        minima = {
            rule["then"]["properties"]["error_rate"]["anyOf"][1]["minimum"]
            for rule in rules
            if "then" in rule
        }
        assert minima == {min_error_rate(b, g) for b in (1, 2, 4, 8) for g in (False, True)}
        lowest = min_error_rate(2, False)
        for rate, status in ((lowest, 201), (lowest * 0.999, 422)):
            body = {"capacity": 10, "error_rate": rate, "bucket_size": 2, "expansion": 0}
            r = await svc.client.put(f"/filters/r{status}", json=body, headers=AUTH)
            assert r.status_code == status, r.text

    async def test_whole_numbers_written_as_floats_are_integers(self, svc: Service) -> None:
        r = await svc.client.put("/filters/w", json={"capacity": 100.0, "bucket_size": 2.0},
                                 headers=AUTH)  # fmt: skip
        assert r.status_code == 201, r.text
        assert (r.json()["capacity"], r.json()["bucket_size"]) == (100, 2)
        r = await svc.client.put("/filters/w2", json={"capacity": 100.5}, headers=AUTH)
        assert r.status_code == 422

    async def test_a_library_limit_names_the_field(self, svc: Service) -> None:
        r = await svc.client.put("/filters/u", json={"capacity": 10, "expansion": 99},
                                 headers=AUTH)  # fmt: skip
        assert r.status_code == 422
        (entry,) = r.json()["detail"]
        assert entry["loc"] == ["body", "expansion"]
        assert entry["msg"] == "expansion must be an integer from 0 to 16, got 99"


def edges(schema: dict[str, Any]) -> list[tuple[Any, bool]]:
    """The values at a property's stated limits (accepted) and just past them (refused)."""
    if "enum" in schema:
        choices = schema["enum"]
        return [(c, True) for c in choices] + [(min(choices) - 1, False), (max(choices) + 1, False)]
    out: list[tuple[Any, bool]] = []
    if "minimum" in schema:
        out += [(int(schema["minimum"]), True), (int(schema["minimum"]) - 1, False)]
    if "maximum" in schema:
        out += [(int(schema["maximum"]), True), (int(schema["maximum"]) + 1, False)]
    for bound in ("exclusiveMinimum", "exclusiveMaximum"):
        if bound in schema:
            out.append((schema[bound], False))
    return out


class TestEdges:
    """Every limit the schema states, read from the schema: the value at it is accepted, the
    one past it refused with a 422 naming the field."""

    async def test_reserve_fields(self, start: StartService) -> None:
        svc = await start(max_capacity=1000)
        props = (await schemas(svc))["ReserveIn"]["properties"]
        tried = 0
        for field, schema in props.items():
            for value, accepted in edges(schema):
                r = await svc.client.put(
                    f"/filters/edge{tried}", json={"capacity": 10, field: value}, headers=AUTH
                )
                tried += 1
                assert r.status_code == (201 if accepted else 422), (field, value, r.text)
                if not accepted:
                    assert [e["loc"] for e in r.json()["detail"]] == [["body", field]], r.text
        assert tried == 4 * 4 + 2 + 6  # 4 ranges, 2 exclusive bounds, 4 choices and 2 past

    async def test_batch_size(self, start: StartService) -> None:
        svc = await start(max_batch=7)
        most = (await schemas(svc))["ItemsIn"]["properties"]["items"]["maxItems"]
        await svc.client.put("/filters/b", json={"capacity": 10}, headers=AUTH)
        for route in ("add", "check", "delete"):
            for n, status in ((most, 200), (most + 1, 422)):
                body = {"items": [f"i{k}" for k in range(n)]}
                r = await svc.client.post(f"/filters/b/{route}", json=body, headers=AUTH)
                assert r.status_code == status, (route, n, r.text)
            assert r.json()["detail"][0]["loc"] == ["body", "items"]


class TestItems:
    async def test_batch_and_item_limits_state_the_settings(self, start: StartService) -> None:
        svc = await start(max_batch=7, max_item_bytes=40)
        items = (await schemas(svc))["ItemsIn"]["properties"]["items"]
        assert items["maxItems"] == 7
        tiers = [(t["maxLength"], t.get("pattern")) for t in items["items"]["anyOf"]]
        assert tiers == [(40, r"^[\x00-\x7f]*$"), (20, r"^[\x00-\u07ff]*$"), (10, None)]

    @pytest.mark.parametrize("item", ["a" * 40, "é" * 20, "😀" * 10])
    async def test_the_longest_item_of_each_tier_is_accepted(
        self, start: StartService, item: str
    ) -> None:
        svc = await start(max_item_bytes=40)
        await svc.client.put("/filters/t", json={"capacity": 10}, headers=AUTH)
        r = await svc.client.post("/filters/t/check", json={"items": [item]})
        assert r.status_code == 200, r.text
        r = await svc.client.post("/filters/t/check", json={"items": [item + "a"]})
        assert r.status_code == 422

    @pytest.mark.parametrize("item", ["a\n", "a\nb", "\n", "a/\r\n"])
    async def test_a_path_item_is_the_whole_item_newlines_too(
        self, svc: Service, item: str
    ) -> None:
        """The schema allows any text: a newline in the path is part of the item, not dropped
        (served as another item, /check would miss it) nor a 404."""
        await svc.client.put("/filters/nl", json={"capacity": 10}, headers=AUTH)
        path = "/filters/nl/items/" + quote(item, safe="/")
        assert (await svc.client.put(path, headers=AUTH)).status_code == 201
        r = await svc.client.post("/filters/nl/check", json={"items": [item]})
        assert r.json() == {"results": [True]}
        assert (await svc.client.get(path)).json() == {"exists": True}
        assert (await svc.client.delete(path, headers=AUTH)).json() == {"deleted": True}
        r = await svc.client.post("/filters/nl/check", json={"items": [item]})
        assert r.json() == {"results": [False]}

    async def test_path_items_and_record_keys_state_the_limit(self, svc: Service) -> None:
        spec = (await svc.client.get("/openapi.json")).json()
        for path, name in (("/filters/{name}/items/{item}", "item"), ("/records/{key}", "key")):
            for op in spec["paths"][path].values():
                (param,) = [p for p in op["parameters"] if p["name"] == name]
                assert [t["maxLength"] for t in param["schema"]["anyOf"]] == [1024, 512, 256]
