"""Idempotency-Key support: a retried add or delete replays its first answer, never runs twice."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from contextlib import suppress
from typing import Any

import redis.asyncio as aioredis
from fastapi.responses import JSONResponse

from app.errors import BadInput, Conflict, InDoubt, error_response, in_doubt_on_timeout
from app.redis_conn import FlushSafeScript
from guard.errors import RedisUnreachable

HEADER = "Idempotency-Key"
KEY_PATTERN = re.compile(r"^[\x21-\x7e]{1,255}$")  # printable ASCII, no spaces
# A request runs far shorter than this; a claim still pending after it belongs to a request
# that died (process killed, task cancelled) after it may have changed the filter.
IN_DOUBT_AFTER_S = 60.0
_POLL_S = 0.05

# Answers worth replaying: the mutation ran (fully, or partly for 507). Any other error but
# an unknown outcome (Redis unreachable mid-call) changed nothing, so the claim is released
# and a retry runs.
_STORED = frozenset({200, 201, 507})

# KEYS[1] the claim; ARGV[1] the claim as we wrote it. Reply: 1 released, 0 not ours (any more).
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def request_hash(method: str, path: str, body: Any) -> str:
    """Hash of what the request asks for: a key reused for another request is an error."""
    canonical = json.dumps([method, path, body], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


class Idempotency:
    """Claim a key with SET NX before mutating, store the answer after, replay it on retries."""

    def __init__(self, redis: aioredis.Redis, prefix: str, ttl_s: int, wait_s: float) -> None:
        self.redis = redis
        self.prefix = prefix
        self.ttl_ms = ttl_s * 1000
        self.wait_s = wait_s
        self._release = FlushSafeScript(redis, _RELEASE)

    def _key(self, filter_name: str, idem_key: str) -> str:
        # Under the filter's hash tag, so in a cluster it lives in the filter's slot.
        digest = hashlib.sha256(idem_key.encode()).hexdigest()
        return f"{self.prefix}app:idem:{{{filter_name}}}:{digest}"

    async def run(
        self,
        filter_name: str,
        idem_key: str | None,
        request_digest: str,
        op: Callable[[], Awaitable[JSONResponse]],
    ) -> JSONResponse:
        what = f"changing filter {filter_name!r}"
        if idem_key is None:
            async with in_doubt_on_timeout(what, "check the filter before retrying"):
                return await op()
        if not KEY_PATTERN.match(idem_key):
            raise BadInput(("header", HEADER), "must be 1-255 printable ASCII characters")
        key = self._key(filter_name, idem_key)
        # "fp" holds the request's digest (its name in records older versions wrote too).
        claim = json.dumps(
            {
                "state": "pending",
                "fp": request_digest,
                "token": uuid.uuid4().hex,
                "since": time.time(),
            }
        )
        deadline = time.monotonic() + self.wait_s
        # The claim lives as long as a stored answer would. If this process dies after the
        # mutation but before the answer is stored, the claim stays "pending": retries get
        # 409 (in doubt) instead of running a second time, for a delete could then remove
        # another item's fingerprint.
        while not await self.redis.set(key, claim, nx=True, px=self.ttl_ms):
            replay = await self._stored(key, request_digest)
            if replay is not None:
                return replay
            if time.monotonic() >= deadline:
                raise Conflict("a request with this Idempotency-Key is still in progress")
            await asyncio.sleep(_POLL_S)
        try:
            async with in_doubt_on_timeout(
                what, f"check the filter; retries with this {HEADER} answer 409"
            ):
                response = await op()
        except (InDoubt, *RedisUnreachable):
            # Redis may have taken the command without its answer coming back (a timeout
            # answers 504, in doubt): a rerun could delete a second copy of a fingerprint,
            # which is a false negative. The claim is kept, marked in doubt.
            await self._mark_in_doubt(key, request_digest)
            raise
        except Exception as exc:
            mapped = error_response(exc)
            if mapped is None or mapped.status_code not in _STORED:
                await self._release(keys=[key], args=[claim])
                raise
            response = mapped
        record = {
            "state": "done",
            "fp": request_digest,
            "status": response.status_code,
            "body": json.loads(bytes(response.body) or b"null"),
        }
        await self.redis.set(key, json.dumps(record), px=self.ttl_ms)
        return response

    async def _mark_in_doubt(self, key: str, request_digest: str) -> None:
        record = {"state": "in-doubt", "fp": request_digest}
        with suppress(*RedisUnreachable):  # Redis still away: the claim stays "pending"
            await self.redis.set(key, json.dumps(record), px=self.ttl_ms)

    async def _stored(self, key: str, request_digest: str) -> JSONResponse | None:
        """The stored answer for `key`; None while the first request is still running (or
        released its claim, in which case the caller claims the key itself)."""
        raw = await self.redis.get(key)
        if raw is None:
            return None
        record = json.loads(raw)
        if record["fp"] != request_digest:
            raise BadInput(("header", HEADER), "was already used for a different request")
        if record["state"] == "in-doubt":
            raise Conflict(
                "the first request with this Idempotency-Key got no answer from Redis and may "
                "have changed the filter: check the filter, then retry with a new key"
            )
        if record["state"] != "done":
            if time.time() - record.get("since", time.time()) > IN_DOUBT_AFTER_S:
                raise Conflict(
                    "the first request with this Idempotency-Key never finished and may have "
                    "changed the filter: check the filter, then retry with a new key"
                )
            return None
        return JSONResponse(
            record["body"], status_code=record["status"], headers={"Idempotent-Replayed": "true"}
        )
