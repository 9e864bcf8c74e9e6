"""A minimal lookup client: the library's lookup command, with nothing around it.

What the library's single ``lookup`` sends is one BITFIELD_RO reading the sub-filter's tag and
the item's two buckets (guard/reads.py). This client sends the same command for a fixed-size
filter of bucket size 4 and 16-bit fingerprints (one 64-bit read per bucket), from arithmetic
written inline, and checks the tag and the buckets itself: the least any client can do for the
same answer, and so the yardstick of the library's own overhead. ``agrees`` proves, before any
timing, that it answers what the library answers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import mmh3
import redis

from guard import hashing
from guard.layout import HEADER_BYTES, TAG_BYTES

_U64 = 1 << 64
_LO = 0x0001_0001_0001_0001  # a 1 in the lowest bit of each 16-bit slot
_HI = _LO << 15  # ... and in the highest


class MinimalLookup:
    """Lookups of one filter (b=4, f=16, one sub-filter), each one BITFIELD_RO."""

    def __init__(self, r: redis.Redis, key: str, seed: int) -> None:
        size = int(r.strlen(key))
        self.key, self.seed = key, seed
        self.buckets = (size - HEADER_BYTES - TAG_BYTES) // 8
        self.tag = int.from_bytes(r.getrange(key, size - TAG_BYTES, size - 1), "big", signed=True)
        self.tag_bit = (size - TAG_BYTES) * 8

    def command(self, item: str) -> tuple[Any, ...]:
        """The BITFIELD_RO for ``item``, and its fingerprint last (not sent)."""
        x = mmh3.hash128(item, self.seed, signed=False)
        h, g = x & hashing.H_MASK, (x >> 64) & hashing.G_MASK
        if g < 0x10000:  # fix_g: the top 16 bits never all 0
            g += 0x10000
        fp = g >> 16
        p = fp % hashing.P31  # mix(), inline
        p = (p * 1103515 + 12345) % hashing.P31
        p = (p * (p % 65521 + 1)) % hashing.P31
        p = (p * 1664525 + 1013904223) % hashing.P31
        m = self.buckets
        i1 = h % m
        i2 = (p - i1) % m
        base = HEADER_BYTES * 8
        return (
            "BITFIELD_RO", self.key, "GET", "i64", self.tag_bit,
            "GET", "i64", base + i1 * 64, "GET", "i64", base + i2 * 64, fp,
        )  # fmt: skip

    def answer(self, reply: Sequence[int], fp: int) -> bool:
        if reply[0] != self.tag:
            raise RuntimeError(f"tag mismatch in {self.key}")
        want = fp * _LO
        for v in (reply[1], reply[2]):
            x = (v % _U64) ^ want
            if (x - _LO) & ~x & _HI:
                return True
        return False

    def pipelined(self, r: redis.Redis, items: Sequence[str], depth: int = 100) -> list[bool]:
        out: list[bool] = []
        for a in range(0, len(items), depth):
            pipe = r.pipeline(transaction=False)
            fps = []
            for item in items[a : a + depth]:
                *cmd, fp = self.command(item)
                pipe.execute_command(*cmd)
                fps.append(fp)
            out += map(self.answer, pipe.execute(), fps)
        return out

    async def one(self, ar: Any, item: str) -> bool:
        *cmd, fp = self.command(item)
        return self.answer(await ar.execute_command(*cmd), fp)

    async def concurrent(self, ar: Any, items: Sequence[str], inflight: int = 100) -> None:
        """``inflight`` tasks, each awaiting one lookup at a time, as a web server's do."""

        async def worker(k: int) -> None:
            for x in items[k::inflight]:
                await self.one(ar, x)

        await asyncio.gather(*(worker(k) for k in range(inflight)))


def agrees(
    r: redis.Redis, minimal: MinimalLookup, items: Sequence[str], expected: list[bool]
) -> None:
    """Raise unless the minimal client answers ``expected`` (the library's answers)."""
    got = minimal.pipelined(r, items)
    if got != expected:
        wrong = sum(a != b for a, b in zip(got, expected, strict=True))
        raise RuntimeError(f"the minimal lookup client disagrees with the library on {wrong} items")
