"""Auto-batching of lookups: concurrent calls on one async handle share one Redis round trip.

The first lookup goes out at once, made by its caller (an idle guard adds no latency and no
task); lookups that arrive while it is in flight wait for it to return and then go together,
up to ``max_items`` per trip. Under a flood that turns many small reads into few large ones,
which is what Redis does fastest.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from guard.errors import RedisUnreachable

Lookup = Callable[[list[bytes]], Awaitable[list[bool]]]
_Waiting = tuple[list[bytes], asyncio.Future[list[bool]]]  # a queued call's items, and its answer


class LookupCoalescer:
    def __init__(self, lookup: Lookup, max_items: int = 2000) -> None:
        self._lookup = lookup
        self._max_items = max_items
        self._waiting: list[_Waiting] = []
        self._flushing = False

    async def lookup_many(self, items: list[bytes]) -> list[bool]:
        if not items:
            return []
        if not self._flushing:  # idle: this call makes the trip itself, no task or future
            self._flushing = True
            try:
                return await self._lookup(items)
            except BaseException as exc:
                self._fail(exc, [])
                raise
            finally:
                if self._waiting:
                    asyncio.get_running_loop().create_task(self._flush())
                else:
                    self._flushing = False
        future: asyncio.Future[list[bool]] = asyncio.get_running_loop().create_future()
        self._waiting.append((items, future))
        return await future

    def _fail(self, exc: BaseException, batch: list[_Waiting]) -> None:
        """The calls of a failed trip fail with it, and so do those queued behind a trip Redis
        never answered: sending them next would only wait out another full timeout."""
        if isinstance(exc, RedisUnreachable):
            batch, self._waiting = [*batch, *self._waiting], []
        for _, future in batch:
            if not future.done():
                future.set_exception(exc)

    async def _flush(self) -> None:
        try:
            while self._waiting:
                batch = self._take()
                items = [x for chunk, _ in batch for x in chunk]
                try:
                    results = await self._lookup(items)
                except BaseException as exc:  # every waiter gets the failure, none hangs
                    self._fail(exc, batch)
                    if not isinstance(exc, Exception):
                        raise
                    continue
                start = 0
                for chunk, future in batch:
                    if not future.done():  # a cancelled caller just drops its share
                        future.set_result(results[start : start + len(chunk)])
                    start += len(chunk)
        finally:
            self._flushing = False

    def _take(self) -> list[_Waiting]:
        """The waiting calls that fit in one trip (at least one, however large)."""
        taken, count = 0, 0
        while taken < len(self._waiting):
            size = len(self._waiting[taken][0])
            if taken and count + size > self._max_items:
                break
            count += size
            taken += 1
        batch, self._waiting = self._waiting[:taken], self._waiting[taken:]
        return batch
