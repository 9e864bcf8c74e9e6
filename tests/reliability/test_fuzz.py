"""Fuzz the HTTP API from its own OpenAPI schema (schemathesis): documented answers, no 500."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import hypothesis
import pytest
import redis
import schemathesis
from schemathesis.specs.openapi.checks import status_code_conformance

from tests.redis_server import RedisProcess
from tests.reliability.service import AUTH, Uvicorn

pytestmark = pytest.mark.realredis

PREFIX = "rel:"  # Uvicorn's GUARD_KEY_PREFIX


class Fuzzed:
    def __init__(self, tmp: Path) -> None:
        self.redis = RedisProcess.start()
        self.app = Uvicorn.start(
            tmp, self.redis.url, max_capacity="100000", max_body_bytes="65536"
        )  # small limits: a generated capacity must not allocate gigabytes
        self.statuses: dict[int, int] = {}


@pytest.fixture(scope="module")
def fuzzed() -> Iterator[Fuzzed]:
    with tempfile.TemporaryDirectory(prefix="guard-fuzz-") as tmp:
        f = Fuzzed(Path(tmp))
        try:
            yield f
            # Whatever was sent, every key written is under the service's prefix.
            client = redis.Redis(port=f.redis.port)
            stray = [k for k in client.scan_iter(count=1000) if not k.startswith(PREFIX.encode())]
            client.close()
            assert stray == []
        finally:
            f.app.stop()
            f.redis.stop()


@pytest.fixture(scope="module")
def api_schema(fuzzed: Fuzzed) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(f"{fuzzed.app.url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@hypothesis.settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=list(hypothesis.HealthCheck),
    derandomize=True,
)
def test_every_answer_is_documented(case: schemathesis.Case, fuzzed: Fuzzed) -> None:
    """Authorized and anonymous requests alike: a documented status, never a 5xx but 503/507."""
    headers = AUTH if case.operation.method.upper() != "GET" else {}
    response = case.call(headers=headers, timeout=10)
    fuzzed.statuses[response.status_code] = fuzzed.statuses.get(response.status_code, 0) + 1
    assert response.status_code < 500 or response.status_code == 507, (
        response.status_code,
        response.text[:300],
    )
    case.validate_response(response, checks=[status_code_conformance])


class TestHostileBodies:
    """Bodies FastAPI cannot even decode get the same 422 shape as every other bad input."""

    @pytest.mark.parametrize("body", [b'{"items": ["\xff\xfe"]}', b"\xc3\x28", b"\x80" * 100])
    def test_invalid_utf8_is_422(self, fuzzed: Fuzzed, body: bytes) -> None:
        import httpx

        r = httpx.post(
            f"{fuzzed.app.url}/filters/x/check", content=body,
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        assert r.status_code == 422, r.text
        assert r.json()["detail"][0]["loc"] == ["body"] and "UTF-8" in r.text
