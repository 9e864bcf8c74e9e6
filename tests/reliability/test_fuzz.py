"""Fuzz the HTTP API from its own OpenAPI schema (schemathesis): documented answers, no 500."""

from __future__ import annotations

import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote_to_bytes

import httpx
import hypothesis
import pytest
import redis
import schemathesis
from schemathesis import GenerationMode
from schemathesis.core.parameters import ParameterLocation
from schemathesis.specs.openapi.checks import (
    negative_data_rejection,
    positive_data_acceptance,
    status_code_conformance,
)

from devkit.redis_server import RedisProcess
from devkit.service import AUTH, KEY_PREFIX, start_service

pytestmark = pytest.mark.realredis


MAX_ITEM_BYTES = 64


class Fuzzed:
    def __init__(self, tmp: Path) -> None:
        self.redis = RedisProcess.start()
        # Small limits: a generated capacity must not allocate gigabytes, and generated items
        # and batches reach their limits.
        self.app = start_service(
            tmp, self.redis.url, max_capacity="100000", max_body_bytes="65536",
            max_item_bytes=str(MAX_ITEM_BYTES), max_batch="50",
        )  # fmt: skip
        self.statuses: dict[int, int] = {}


@pytest.fixture(scope="module")
def fuzzed() -> Iterator[Fuzzed]:
    with tempfile.TemporaryDirectory(prefix="guard-fuzz-") as tmp:
        f = Fuzzed(Path(tmp))
        try:
            yield f
            # Whatever was sent, every key written is under the service's prefix.
            client = redis.Redis(port=f.redis.port)
            stray = [
                k for k in client.scan_iter(count=1000) if not k.startswith(KEY_PREFIX.encode())
            ]
            client.close()
            assert stray == []
        finally:
            f.app.stop()
            f.redis.stop()


@pytest.fixture(scope="module")
def api_schema(fuzzed: Fuzzed) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(f"{fuzzed.app.url}/openapi.json")


def _only(mode: GenerationMode, fuzzed: Fuzzed) -> schemathesis.BaseSchema:
    loaded = schemathesis.openapi.from_url(f"{fuzzed.app.url}/openapi.json")
    loaded.config.generation.update(modes=[mode])
    # The coverage phase sends each limit's edge values (maxItems + 1, the longest name...).
    loaded.config.phases.update(phases=["examples", "coverage", "fuzzing"])
    return loaded


@pytest.fixture(scope="module")
def positive_schema(fuzzed: Fuzzed) -> schemathesis.BaseSchema:
    """Only inputs the schema allows."""
    return _only(GenerationMode.POSITIVE, fuzzed)


@pytest.fixture(scope="module")
def negative_schema(fuzzed: Fuzzed) -> schemathesis.BaseSchema:
    """Only inputs that break the schema: wrong types, out-of-range numbers, extra fields."""
    return _only(GenerationMode.NEGATIVE, fuzzed)


schema = schemathesis.pytest.from_fixture("api_schema")
positive = schemathesis.pytest.from_fixture("positive_schema")
# The routes with something to break: a body, or a filter name with a pattern. (The others
# take no input, or any string: there is no negative case to generate for them.)
negative = schemathesis.pytest.from_fixture("negative_schema").include(
    name_regex=r"^\w+ /filters/\{name\}|^PUT /records/"
)

# Every route that takes input: a filter name, an item or record key, a body.
with_input = schemathesis.pytest.from_fixture("negative_schema").include(
    name_regex=r"/filters/\{name\}|/records/\{key\}"
)


FUZZ = hypothesis.settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=list(hypothesis.HealthCheck),
    derandomize=True,
)


def call_and_check(case: schemathesis.Case, fuzzed: Fuzzed) -> None:
    """Authorized and anonymous requests alike: a documented status, never a 5xx but 503/507."""
    headers = AUTH if case.operation.method.upper() != "GET" else {}
    response = case.call(headers=headers, timeout=10)
    fuzzed.statuses[response.status_code] = fuzzed.statuses.get(response.status_code, 0) + 1
    assert response.status_code < 500 or response.status_code == 507, (
        response.status_code,
        response.text[:300],
    )
    case.validate_response(response, checks=[status_code_conformance])


@schema.parametrize()
@FUZZ
def test_every_answer_is_documented(case: schemathesis.Case, fuzzed: Fuzzed) -> None:
    call_and_check(case, fuzzed)


@negative.parametrize()
@FUZZ
def test_wrong_input_is_never_a_5xx(case: schemathesis.Case, fuzzed: Fuzzed) -> None:
    call_and_check(case, fuzzed)


def _fits_in_bytes(case: schemathesis.Case, sent_path: str) -> bool:
    """Whether the part of ``case`` that breaks the schema is items (a path's item or record
    key, a body's items) that the API's real limit, 1-MAX_ITEM_BYTES bytes of UTF-8, takes.

    JSON Schema counts characters, not bytes: the schema states the limit by cases that
    always fit (app/openapi.py: utf8_text), so an item mixing wide and narrow characters can
    fit without matching one. That is the one place the schema is stricter than the API.
    A path parameter of another type than a string breaks nothing the server can see: a path
    is text, and the value arrives as the text it was sent as (`sent_path`, the last segment).
    """
    assert case.meta is not None
    broken = case.meta.phase.data
    if broken.parameter_location == ParameterLocation.PATH and broken.parameter in ("item", "key"):
        value = case.path_parameters[broken.parameter]
        if not isinstance(value, str):
            value = sent_path.split("?")[0].rsplit("/", 1)[1]
        sizes = [len(unquote_to_bytes(value))]  # sent percent-encoded: the server's bytes
    elif broken.parameter_location == ParameterLocation.BODY and "/items/items" in str(
        broken.description
    ):
        items = case.body.get("items") if isinstance(case.body, dict) else None
        if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
            return False
        sizes = [len(x.encode("utf-8", "surrogatepass")) for x in items]
    else:
        return False
    return all(1 <= size <= MAX_ITEM_BYTES for size in sizes)


def check_limits_agree(case: schemathesis.Case, fuzzed: Fuzzed) -> None:
    """What the schema allows is accepted, what it forbids is refused: the documented limits
    are the enforced ones."""
    assert case.meta is not None
    negative = case.meta.generation.mode.is_negative
    if "/filters/{name}/" in case.operation.path:
        # On a missing filter every item route answers 404, which proves nothing about the
        # limits: the case's filter is made first. A negative case whose name is not the part
        # it breaks gets a good one, so only the part it breaks is wrong.
        broken = case.meta.phase.data
        if negative and "name" not in {broken.parameter, *(m.parameter for m in broken.mutations)}:
            case.path_parameters = {**(case.path_parameters or {}), "name": "fuzz-limits"}
        name = (case.path_parameters or {}).get("name")
        if isinstance(name, str):  # a create with a bad name is refused, as the case will be
            url = f"{fuzzed.app.url}/filters/{quote(name, safe='')}"
            httpx.put(url, json={"capacity": 1000}, headers=AUTH, timeout=10)
    if case.operation.method.upper() == "DELETE" and case.operation.path == "/filters/{name}":
        # A drop repeats the filter's name in ?confirm=, which no schema can state: the
        # case's confirm is the name, unless confirm is the part a negative case breaks.
        broken = case.meta.phase.data
        name = (case.path_parameters or {}).get("name")
        if isinstance(name, str) and (not negative or broken.parameter != "confirm"):
            case.query = {**(case.query or {}), "confirm": name}
    headers = dict(AUTH)
    broken_parts: set[str | None] = set()
    if negative:
        broken = case.meta.phase.data
        broken_parts = {broken.parameter, *(m.parameter for m in broken.mutations)}
    if case.headers and "Idempotency-Key" in case.headers and "Idempotency-Key" not in broken_parts:
        # A key reused for another request is refused by state, not by a limit: one per case
        # (a negative case keeps its own only when the key is what it breaks).
        headers["Idempotency-Key"] = uuid.uuid4().hex
    response = case.call(headers=headers, timeout=10)
    if negative:
        if response.status_code == 413:  # over GUARD_MAX_BODY_BYTES: refused, as documented
            return
        if response.status_code < 300 and _fits_in_bytes(case, response.request.path_url):
            return
    case.validate_response(response, checks=[positive_data_acceptance, negative_data_rejection])


@positive.parametrize()
@FUZZ
def test_what_the_schema_allows_is_accepted(case: schemathesis.Case, fuzzed: Fuzzed) -> None:
    check_limits_agree(case, fuzzed)


@with_input.parametrize()
@FUZZ
def test_what_the_schema_forbids_is_refused(case: schemathesis.Case, fuzzed: Fuzzed) -> None:
    check_limits_agree(case, fuzzed)


def _body_fields(spec: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(method, path, field) for every property of every JSON request body in the schema."""
    found = []
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            body = op.get("requestBody", {}).get("content", {}).get("application/json")
            if body is None:
                continue
            name = body["schema"]["$ref"].rsplit("/", 1)[-1]
            for field in spec["components"]["schemas"][name]["properties"]:
                found.append((method.upper(), path, field))
    return found


class TestNonFiniteNumbers:
    """JSON has no NaN or Infinity, so schemathesis never sends them, but Python's parser
    reads them: every field of every body in the schema gets each one, and answers 422."""

    @pytest.mark.parametrize("raw", ["NaN", "Infinity", "-Infinity", "1e400"])
    def test_every_body_field_is_422(self, fuzzed: Fuzzed, raw: str) -> None:
        spec = httpx.get(f"{fuzzed.app.url}/openapi.json").json()
        fields = _body_fields(spec)
        assert len(fields) >= 10  # reserve (6), add/check/delete (items), records (value)
        for method, path, field in fields:
            url = fuzzed.app.url + path.format(name="fuzz-nan", item="x", key="nan-key")
            r = httpx.request(
                method, url, content=f'{{"{field}": {raw}}}'.encode(),
                headers={**AUTH, "Content-Type": "application/json"},
            )  # fmt: skip
            assert r.status_code == 422, (method, path, field, r.status_code, r.text[:300])
            assert any(e["loc"][:2] == ["body", field] for e in r.json()["detail"]), r.text


class TestHostileBodies:
    """Bodies FastAPI cannot even decode get the same 422 shape as every other bad input."""

    @pytest.mark.parametrize("body", [b'{"items": ["\xff\xfe"]}', b"\xc3\x28", b"\x80" * 100])
    def test_invalid_utf8_is_422(self, fuzzed: Fuzzed, body: bytes) -> None:
        r = httpx.post(
            f"{fuzzed.app.url}/filters/x/check", content=body,
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        assert r.status_code == 422, r.text
        assert r.json()["detail"][0]["loc"] == ["body"] and "UTF-8" in r.text

    @pytest.mark.parametrize(
        "path", ["/records/%FF", "/filters/%C0%AF", "/filters/x/items/%ED%A0%80"]
    )
    def test_path_not_utf8_is_422(self, fuzzed: Fuzzed, path: str) -> None:
        """Through a real server (uvicorn's raw_path), not only the test transport."""
        r = httpx.get(f"{fuzzed.app.url}{path}")
        assert r.status_code == 422, r.text
        assert r.json()["detail"][0]["loc"][0] == "path" and "UTF-8" in r.text
