"""Items that URL clients rewrite ('.', '..', '%2E', dot segments with '/' encoded or not),
sent to the item routes by curl, httpx and a raw socket to a real server: no request meant for
one item drops a filter or changes anything, and each answer is what docs/service.md ("Items
in a path") says."""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from devkit.keys import delete_prefixed_at
from devkit.processes import HttpProcess
from devkit.service import API_KEY, AUTH, start_service
from tests import raw_http

pytestmark = pytest.mark.realredis

# As typed after /filters/f/items/: each is either rewritten by some client or a dot segment
# that arrives intact.
VALUES = ["..", ".", "%2E%2E", "%2e.", "%2E", "a%2F..", "..%2F..%2Fg", "a/..", "../../g"]
METHODS = ["GET", "PUT", "DELETE"]
ITEMS = {"f": ["..", ".", "a/..", "a", "x"], "g": ["..", "y"]}


@dataclass(frozen=True)
class Answer:
    client: str
    method: str
    value: str
    status: int
    body: Any


def curl(url: str, method: str) -> tuple[int, bytes]:
    run = subprocess.run(
        ["curl", "-sS", "-X", method, "-H", f"Authorization: Bearer {API_KEY}",
         "-w", "\n%{http_code}", url],
        capture_output=True, timeout=30, check=True,
    )  # fmt: skip
    body, _, code = run.stdout.rpartition(b"\n")
    return int(code), body


def send(app: HttpProcess, client: str, method: str, value: str) -> Answer:
    path = f"/filters/f/items/{value}"
    if client == "curl":
        status, body = curl(app.url + path, method)
    elif client == "httpx":
        r = httpx.request(method, app.url + path, headers=AUTH, timeout=30)
        status, body = r.status_code, r.content
    else:
        head = f"{method} {path} HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {API_KEY}"
        raw = raw_http.request(app.port, head + "\r\nConnection: close")
        status, body = raw.status, raw.body
    return Answer(client, method, value, status, json.loads(body) if body else None)


@pytest.fixture(scope="module")
def app(real_redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpProcess]:
    url, prefix = real_redis_url, f"test:items:{uuid.uuid4().hex[:12]}:"
    server = start_service(tmp_path_factory.mktemp("svc"), url, key_prefix=prefix)
    try:
        for name, items in ITEMS.items():
            httpx.put(f"{server.url}/filters/{name}", json={"capacity": 100}, headers=AUTH)
            httpx.post(f"{server.url}/filters/{name}/add", json={"items": items}, headers=AUTH)
        yield server
    finally:
        server.stop()
        delete_prefixed_at(url, prefix)


def state(app: HttpProcess) -> dict[str, Any]:
    """Each filter's item count and its items' answers, by the batch route."""
    out = {}
    for name, items in ITEMS.items():
        info = httpx.get(f"{app.url}/filters/{name}", timeout=10).json()
        check = httpx.post(f"{app.url}/filters/{name}/check", json={"items": items}, timeout=10)
        out[name] = (info.get("items"), check.json().get("results"))  # None: no such filter
    return out


class TestRewrittenItems:
    """Every client, method and value: refused, or a read of the filter the path names."""

    @pytest.mark.parametrize("client", ["curl", "httpx", "raw"])
    def test_nothing_changes(self, app: HttpProcess, client: str) -> None:
        before = state(app)
        answers = [send(app, client, m, v) for m in METHODS for v in VALUES]
        assert state(app) == before  # no filter dropped, no item added or deleted
        for a in answers:
            if a.status == 200:  # what httpx and curl make of '..', '../../g' for a GET
                assert a.method == "GET" and client != "raw" and "capacity" in a.body, a
            else:
                assert a.status in (404, 422), a
        refused = {(a.method, a.value): a for a in answers}
        if client == "raw":  # every value arrives on the item route, intact: 422, named
            for a in answers:
                assert a.status == 422 and a.body["detail"][0]["loc"] == ["path", "item"], a
        if client == "httpx":  # DELETE /filters/f/items/.. leaves DELETE /filters/f
            drop = refused["DELETE", ".."]
            assert drop.status == 422 and drop.body["detail"][0]["loc"] == ["query", "confirm"]
        if client == "curl":  # ... and curl leaves DELETE /filters/f/
            assert refused["DELETE", ".."].status == 404
            assert "POST /filters/{name}/add" in refused["DELETE", ".."].body["detail"]

    def test_batch_routes_take_them(self, app: HttpProcess) -> None:
        """What the refusals point to: any item goes in a body."""
        items = {"items": ["..", ".", "a/.."]}
        r = httpx.post(f"{app.url}/filters/f/check", json=items, timeout=10)
        assert r.json() == {"results": [True, True, True]}
