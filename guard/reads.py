"""Script-free lookups: one BITFIELD_RO per sub-filter reads its tag and the buckets.

A lookup only reads, and one Redis command is atomic by itself, so no script is needed: each
command reads the 8-byte tag that ends the sub-filter's string (docs/format.md) beside the
item's two buckets. The tag is where the handle's layout says the string ends, and holds the
sub-filter count and a digest of the geometry, so one 64-bit read proves that the string is
there, whole, and laid out as the handle thinks. Every command validates itself, so a chunked
batch cannot mix two layouts; several sub-filters are read in one MULTI.

Redis pays per BITFIELD sub-command more than per bit (Redis 7.0.15 here: 20 reads in one
command cost 0.11 µs each as u8, 0.19 µs as i64), so reads are as few and as wide as BITFIELD
allows: the tag in one 64-bit word, a bucket in as few reads as hold whole slots in 64 bits
(one for b=4, f=16). Two bucket reads per item are why a batched lookup costs Redis several
times what a native module's CF.MEXISTS does.

Batches are planned and checked with numpy: per item, Python-level arithmetic and slot loops
cost several times what Redis spends answering. Small batches (one request's single lookup)
stay in plain Python, where numpy's fixed cost per call would dominate: a plan takes the form
its hashes come in (guard/hashing.py: ``hash_batch``), and both forms run hashing's functions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import NamedTuple

import numpy as np
from mmh3 import hash128

from guard import hashing
from guard.layout import HEADER_BYTES, TAG_BYTES, Layout

MAX_GETS = 2000
_U64 = 1 << 64
_H_MASK, _G_MASK, _mix = hashing.H_MASK, hashing.G_MASK, hashing.mix


class TagMismatch(Exception):
    """A sub-filter's tag is not the one the handle's layout predicts.

    The filter grew or was replaced (the handle is stale), or the key is gone or damaged: only
    a full header check (a script) can tell which.
    """

    def __init__(self, key: str) -> None:
        super().__init__(f"tag mismatch in {key}")
        self.key = key


@dataclass(frozen=True)
class _BucketReads:
    """How one bucket of a sub-filter is read: (first slot, slots, bits) per GET."""

    parts: tuple[tuple[int, int, int], ...]
    fp_bits: int

    @classmethod
    def plan(cls, bucket_size: int, fp_bits: int) -> _BucketReads:
        per_read = max(1, min(bucket_size, 64 // fp_bits))
        parts = tuple(
            (s, min(per_read, bucket_size - s), min(per_read, bucket_size - s) * fp_bits)
            for s in range(0, bucket_size, per_read)
        )
        return cls(parts, fp_bits)

    @cached_property
    def _reads(self) -> tuple[tuple[str, str, int], ...]:
        # u64 does not exist (unsigned tops out at 63 bits): read i64, fix the sign on use.
        return tuple(
            ("GET", "i64" if bits == 64 else f"u{bits}", first * self.fp_bits)
            for first, _, bits in self.parts
        )

    def gets(self, bucket_bit: int) -> list[object]:
        out: list[object] = []
        for get, kind, start in self._reads:
            out += (get, kind, bucket_bit + start)
        return out

    @cached_property
    def lanes(self) -> list[tuple[int, int]]:
        """Per read, (lo, hi): a 1 in the lowest, and in the highest, bit of every slot."""
        f = self.fp_bits
        out = []
        for _, count, _ in self.parts:
            lo = sum(1 << (j * f) for j in range(count))
            out.append((lo, lo << (f - 1)))
        return out

    @cached_property
    def _both_lanes(self) -> list[tuple[int, int]]:
        return self.lanes * 2

    def holds(self, values: Sequence[int], fp: int) -> bool:
        """Whether either bucket's reads (both buckets', in order) hold ``fp``."""
        # The zero-lane test of _evaluate_vector on Python ints: a borrow out of the top lane
        # only reaches bits that ``hi`` masks off, as in numpy's wrapping uint64.
        for (lo, hi), v in zip(self._both_lanes, values, strict=True):
            x = (v % _U64) ^ (fp * lo)
            if (x - lo) & ~x & hi:
                return True
        return False


@dataclass
class _Command:
    subfilter: int
    items: list[int]  # indexes into the batch
    fps: list[int]
    args: list[object]


class _Subfilter(NamedTuple):
    """What reading one sub-filter takes, derived from the layout alone."""

    reads: _BucketReads
    tag: int  # the tag as BITFIELD's i64 read answers it
    tag_read: tuple[str, str, int]
    buckets: int
    per_command: int  # items per read command


@lru_cache(maxsize=256)  # a handle holds one layout at a time; a service has a few handles
def _per_subfilter(layout: Layout) -> tuple[_Subfilter, ...]:
    """Worked out once per layout, not once per lookup."""
    out = []
    for n in range(layout.subfilters):
        reads = _BucketReads.plan(layout.bucket_size, layout.fp_bits_at(n))
        out.append(
            _Subfilter(
                reads,
                int.from_bytes(layout.tag(n), "big", signed=True),
                ("GET", "i64", (layout.string_bytes(n) - TAG_BYTES) * 8),
                layout.buckets(n),
                max(1, (MAX_GETS - 1) // (2 * len(reads.parts))),
            )
        )
    return tuple(out)


class SingleRead:
    """One item's lookup in a filter of one sub-filter, the most frequent read of all (a web
    request's): the command ReadPlan makes for it, from arithmetic written out inline.

    A handle keeps one per layout; ``command`` and ``holds`` are the only Python calls a
    lookup makes beyond the driver's (ReadPlan's general planning costs a single item more
    than Redis and the client library spend on it). The same arithmetic as guard/hashing.py,
    inlined: the tests compare both plans' commands.
    """

    def __init__(self, layout: Layout) -> None:
        if layout.subfilters != 1:
            raise ValueError("a single read is for a filter of one sub-filter")
        sub = _per_subfilter(layout)[0]
        self.layout = layout
        self.tag = sub.tag
        self._reads = sub.reads
        f = layout.fp_bits
        # One read per bucket (b * f <= 64: b=4 with f=16, say): its type; else None.
        reads = sub.reads._reads
        kind = reads[0][1] if len(reads) == 1 else None
        # Everything command() needs, unpacked in one step (attribute loads add up here).
        self._consts = (
            layout.seed,
            sub.buckets,
            1 << (32 - f),  # fix_g's bound
            32 - f,
            layout.bucket_size * f,
            HEADER_BYTES * 8,
            kind,
            *sub.tag_read,
        )
        self._lanes = sub.reads.lanes[0] if kind is not None else None

    def command(self, key: str, item: bytes) -> tuple[list[object], int]:
        """The read command's arguments (after its name), and the item's fingerprint."""
        seed, m, low, shift, bucket_bits, base, kind, get, tag_kind, tag_bit = self._consts
        x = hash128(item, seed, signed=False)
        g = (x >> 64) & _G_MASK
        if g < low:
            g += low
        fp = g >> shift
        i1 = (x & _H_MASK) % m
        i2 = (_mix(fp) - i1) % m
        at1 = base + i1 * bucket_bits
        at2 = base + i2 * bucket_bits
        if kind is not None:
            return [key, get, tag_kind, tag_bit, "GET", kind, at1, "GET", kind, at2], fp
        gets = self._reads.gets
        return [key, get, tag_kind, tag_bit, *gets(at1), *gets(at2)], fp

    def holds(self, reply: Sequence[int], fp: int) -> bool:
        """Whether the reply's buckets hold ``fp``; its tag (``reply[0]``) is checked first by
        the caller, against ``tag``."""
        if self._lanes is None:
            return self._reads.holds(reply[1:], fp)
        lo, hi = self._lanes
        want = fp * lo
        x = (reply[1] % _U64) ^ want
        if (x - lo) & ~x & hi:
            return True
        x = (reply[2] % _U64) ^ want
        return bool((x - lo) & ~x & hi)


class ReadPlan:
    """The commands answering ``lookup`` for a batch under one layout, and their check."""

    def __init__(self, layout: Layout, hashes: hashing.Hashes, key: Callable[[int], str]) -> None:
        self.layout = layout
        self.count = len(hashes)
        self.vector = isinstance(hashes, np.ndarray)  # (n, 2) int64: planned with numpy
        self.subfilters = _per_subfilter(layout)
        self.commands: list[_Command] = []
        self._fps: list[np.ndarray] = []  # vector plans: fingerprints per sub-filter
        if isinstance(hashes, np.ndarray):
            self._plan_vector(hashes, key)
        else:
            self._plan_scalar(hashes, key)

    def _plan_scalar(self, hashes: Sequence[tuple[int, int]], key: Callable[[int], str]) -> None:
        f0, b, base = self.layout.fp_bits, self.layout.bucket_size, HEADER_BYTES * 8
        items = []  # (h, fixed g, the mix giving the alternate bucket in every sub-filter)
        for h, g in hashes:
            g = hashing.fix_g(g, f0)
            items.append((h, g, hashing.mix(hashing.fingerprint(g, f0))))
        for n, sub in enumerate(self.subfilters):
            m, f, gets = sub.buckets, sub.reads.fp_bits, sub.reads.gets
            for start in range(0, max(1, self.count), sub.per_command):
                stop = min(self.count, start + sub.per_command)
                args: list[object] = [key(n), *sub.tag_read]
                fps = []
                for h, g, mixed in items[start:stop]:
                    i1, i2 = hashing.buckets(h, mixed, m)
                    fps.append(hashing.fingerprint(g, f))
                    args += gets(base + i1 * b * f)
                    args += gets(base + i2 * b * f)
                self.commands.append(_Command(n, list(range(start, stop)), fps, args))

    def _plan_vector(self, hg: np.ndarray, key: Callable[[int], str]) -> None:
        """The same, on whole arrays (every value stays below 2**53)."""
        b, f0 = self.layout.bucket_size, self.layout.fp_bits
        h, g = hg[:, 0], hashing.fix_g(hg[:, 1], f0)
        mixed = hashing.mix(hashing.fingerprint(g, f0))
        for n, sub in enumerate(self.subfilters):
            m, f, reads = sub.buckets, sub.reads.fp_bits, sub.reads
            i1, i2 = hashing.buckets(h, mixed, m)
            self._fps.append(hashing.fingerprint(g, f))
            # Per item, both buckets' reads in order, each as (GET, type, bit offset): a
            # repeated template whose every third entry is overwritten by the offsets.
            parts = len(reads.parts)
            offsets = np.empty((self.count, 2, parts), dtype=np.int64)
            for j, (first, _, _) in enumerate(reads.parts):
                offsets[:, 0, j] = HEADER_BYTES * 8 + (i1 * b + first) * f
                offsets[:, 1, j] = HEADER_BYTES * 8 + (i2 * b + first) * f
            unit = reads.gets(0) * 2  # one item's reads; its offsets are placeholders
            flat = unit * self.count
            flat[2::3] = offsets.ravel().tolist()
            per_command, width = sub.per_command, len(unit)
            for start in range(0, self.count, per_command):
                stop = min(self.count, start + per_command)
                args = [key(n), *sub.tag_read, *flat[start * width : stop * width]]
                self.commands.append(_Command(n, list(range(start, stop)), [], args))

    def evaluate(self, replies: Sequence[Sequence[int]]) -> list[bool]:
        """Results per item; raises TagMismatch when a sub-filter's tag is not the expected one."""
        for cmd, reply in zip(self.commands, replies, strict=True):
            if reply[0] != self.subfilters[cmd.subfilter].tag:
                raise TagMismatch(str(cmd.args[0]))
        if self.vector:
            return self._evaluate_vector(replies)
        found = [False] * self.count
        for cmd, reply in zip(self.commands, replies, strict=True):
            reads = self.subfilters[cmd.subfilter].reads
            width = 2 * len(reads.parts)
            pos = 1
            for k, fp in zip(cmd.items, cmd.fps, strict=True):
                if not found[k]:
                    found[k] = reads.holds(reply[pos : pos + width], fp)
                pos += width
        return found

    def _evaluate_vector(self, replies: Sequence[Sequence[int]]) -> list[bool]:
        # A read holds fp iff some slot of (read XOR fp in every slot) is zero; the classic
        # zero-lane test, (x - lo) & ~x & hi != 0, answers that exactly for all slots at once.
        found = np.zeros(self.count, dtype=bool)
        for cmd, reply in zip(self.commands, replies, strict=True):
            reads = self.subfilters[cmd.subfilter].reads
            start, stop = cmd.items[0], cmd.items[-1] + 1
            values = np.array(reply[1:], dtype=np.int64).view(np.uint64)
            values = values.reshape(stop - start, 2, len(reads.parts))
            fp = self._fps[cmd.subfilter][start:stop].astype(np.uint64)
            for j, (lo, hi) in enumerate(reads.lanes):
                x = values[:, :, j] ^ (fp * np.uint64(lo))[:, None]
                hit = (x - np.uint64(lo)) & ~x & np.uint64(hi)
                found[start:stop] |= (hit != 0).any(axis=1)
        return found.tolist()
