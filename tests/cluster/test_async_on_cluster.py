"""The asyncio library tests, run unchanged against an asyncio ``RedisCluster``."""

from __future__ import annotations

from tests.test_async_api import TestAsyncFilter
from tests.test_async_api import cf as cf  # the imported class's fixture

__all__ = ["TestAsyncFilter"]
