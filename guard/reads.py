"""Script-free lookups: one BITFIELD_RO per sub-filter reads its tag and the buckets.

A lookup only reads, and one Redis command is atomic by itself, so no script is needed: each
command reads the 8-byte tag that ends the sub-filter's string (docs/format.md) beside the
item's two buckets. The tag is where the handle's layout says the string ends, and holds the
sub-filter count and a digest of the geometry, so one 64-bit read proves that the string is
there, whole, and laid out as the handle thinks. Every command validates itself, so a chunked
batch cannot mix two layouts; several sub-filters are read in one MULTI. Each command ends
with the reads of the filter's age (guard/ages.py: items; in sub-filter 0 also
deletes and applied), so the read that answers a lookup also shows how old the filter is.

Redis pays per BITFIELD sub-command more than per bit (Redis 7.0.15 here: 20 reads in one
command cost 0.11 µs each as u8, 0.19 µs as i64), so reads are as few and as wide as BITFIELD
allows: the tag in one 64-bit word, a bucket in as few reads as hold whole slots in 64 bits
(one for b=4, f=16). Two bucket reads per item are why a batched lookup costs Redis several
times what a native module's CF.MEXISTS does.

A plan takes the form its hashes come in (hashing.hash_batch): batches are planned and checked
with numpy, where per-item Python would cost several times what Redis spends answering. numpy
is imported by a batch's plan: a lookup of a few items never waits for it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from mmh3 import hash128

from guard import hashing
from guard.ages import AGE_READS, AGE_VALUES, ITEMS_READ, age_of
from guard.layout import HEADER_BYTES, TAG_BYTES, Layout

if TYPE_CHECKING:
    import numpy as np

MAX_GETS = 2000
_U64 = 1 << 64
_H_MASK, _G_MASK, _mix = hashing.H_MASK, hashing.G_MASK, hashing.mix


class TagMismatch(Exception):
    """A sub-filter's tag is not the one the handle's layout predicts: the filter grew or was
    replaced (a stale handle), or the key is gone or damaged; only a script's header check knows."""

    def __init__(self, key: str) -> None:
        super().__init__(f"tag mismatch in {key}")
        self.key = key


@dataclass
class _Command:
    subfilter: int
    items: list[int]  # indexes into the batch
    fps: list[int]
    args: list[object]


class _Subfilter:
    """How sub-filter ``n`` is read, derived from the layout alone: its tag, and each bucket
    as ``parts``, (first slot, slots, bits) per GET."""

    def __init__(self, layout: Layout, n: int) -> None:
        b, f = layout.bucket_size, layout.fp_bits_at(n)
        per_read = max(1, min(b, 64 // f))
        self.fp_bits, self.buckets = f, layout.buckets(n)
        self.tag = int.from_bytes(layout.tag(n), "big", signed=True)  # as BITFIELD's i64 reads it
        self.tag_read = ("GET", "i64", (layout.string_bytes(n) - TAG_BYTES) * 8)
        self.parts = tuple(
            (s, min(per_read, b - s), min(per_read, b - s) * f) for s in range(0, b, per_read)
        )
        # Items per read command: at most MAX_GETS reads in one, the tag's and age's among them.
        self.per_command = max(1, (MAX_GETS - 1 - AGE_VALUES) // (2 * len(self.parts)))
        # u64 does not exist (unsigned tops out at 63 bits): read i64, fix the sign on use.
        self._reads = [("GET", "i64" if w == 64 else f"u{w}", s * f) for s, _, w in self.parts]
        # Per read, (lo, hi): a 1 in the lowest, and in the highest, bit of every slot.
        lows = [sum(1 << (j * f) for j in range(count)) for _, count, _ in self.parts]
        self.lanes = [(lo, lo << (f - 1)) for lo in lows]
        self._both_lanes = self.lanes * 2

    def gets(self, bucket_bit: int) -> list[object]:
        return [x for get, kind, start in self._reads for x in (get, kind, bucket_bit + start)]

    def holds(self, values: Sequence[int], fp: int) -> bool:
        """Whether either bucket's reads (both buckets', in order) hold ``fp``."""
        # evaluate's zero-lane test on Python ints: a borrow out of the top lane only reaches
        # bits that ``hi`` masks off, as in numpy's wrapping uint64.
        for (lo, hi), v in zip(self._both_lanes, values, strict=True):
            x = (v % _U64) ^ (fp * lo)
            if (x - lo) & ~x & hi:
                return True
        return False


@lru_cache(maxsize=256)  # a handle holds one layout at a time; a service has a few handles
def _per_subfilter(layout: Layout) -> tuple[_Subfilter, ...]:
    return tuple(_Subfilter(layout, n) for n in range(layout.subfilters))


class SingleRead:
    """One item's lookup in a filter of one sub-filter, the most frequent read (a web request's):
    ReadPlan's command, with hashing.py's arithmetic inline (the tests compare both). A handle
    keeps one per layout; ``command`` and ``holds`` are all the Python such a lookup runs beyond
    the driver, where ReadPlan's planning would cost more than Redis and the client spend."""

    def __init__(self, layout: Layout) -> None:
        if layout.subfilters != 1:
            raise ValueError("a single read is for a filter of one sub-filter")
        sub = _per_subfilter(layout)[0]
        self.layout, self.tag, self._sub = layout, sub.tag, sub
        self.identity = layout.digest  # guard/ages.py
        f = layout.fp_bits
        # One read per bucket (b * f <= 64: b=4 with f=16, say): its type; else None.
        kind = sub._reads[0][1] if len(sub.parts) == 1 else None
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
        self._lanes = sub.lanes[0] if kind is not None else None

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
            return [key, get, tag_kind, tag_bit, "GET", kind, at1, "GET", kind, at2, *AGE_READS], fp
        gets = self._sub.gets
        return [key, get, tag_kind, tag_bit, *gets(at1), *gets(at2), *AGE_READS], fp

    @staticmethod
    def age(reply: Sequence[int]) -> tuple[int, int]:
        """The filter's write count and applied, from the reply's last reads (guard/ages.py)."""
        items, deletes, applied = reply[-AGE_VALUES:]
        return age_of(items, deletes), applied

    def holds(self, reply: Sequence[int], fp: int) -> bool:
        """Whether the reply's buckets hold ``fp``; the caller checks its tag, ``reply[0]``."""
        if self._lanes is None:
            return self._sub.holds(reply[1:-AGE_VALUES], fp)
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
        self.count = len(hashes)
        self.identity = layout.digest  # guard/ages.py
        self.vector = not isinstance(hashes, list)  # (n, 2) int64: planned with numpy
        self.subfilters = _per_subfilter(layout)
        self.commands: list[_Command] = []
        self._fps: list[np.ndarray] = []  # vector plans: fingerprints per sub-filter
        b, f0, base = layout.bucket_size, layout.fp_bits, HEADER_BYTES * 8
        h: Any  # h, fixed g, and the mix giving the alternate bucket in every sub-filter
        g: Any
        if isinstance(hashes, list):
            h, g = [x for x, _ in hashes], [hashing.fix_g(x, f0) for _, x in hashes]
            mixed = [hashing.mix(hashing.fingerprint(x, f0)) for x in g]
        else:  # whole arrays (every value stays below 2**53)
            import numpy as np

            h, g = hashes[:, 0], hashing.fix_g(hashes[:, 1], f0)
            mixed = hashing.mix(hashing.fingerprint(g, f0))
        for n, sub in enumerate(self.subfilters):
            m, f = sub.buckets, sub.fp_bits
            starts = [start for _, _, start in sub._reads]  # each read's bit in a bucket
            fps: Any
            if self.vector:
                i1, i2 = hashing.buckets(h, mixed, m)
                fps = hashing.fingerprint(g, f)
                self._fps.append(fps)
                at = base + np.stack([i1, i2], axis=1) * (b * f)
                offsets = (at[:, :, None] + np.array(starts)).ravel().tolist()
            else:
                fps = [hashing.fingerprint(x, f) for x in g]
                offsets = [
                    base + i * b * f + s
                    for item_h, item_mixed in zip(h, mixed, strict=True)
                    for i in hashing.buckets(item_h, item_mixed, m)
                    for s in starts
                ]
            # Per item, both buckets' reads in order, each as (GET, type, bit offset): a
            # repeated template whose every third entry is overwritten by the offsets.
            unit = sub.gets(0) * 2
            flat = unit * self.count
            flat[2::3] = offsets
            per_command, width = sub.per_command, len(unit)
            for start in range(0, self.count, per_command):
                stop = min(self.count, start + per_command)
                ages = AGE_READS if n == 0 else ITEMS_READ
                args = [key(n), *sub.tag_read, *flat[start * width : stop * width], *ages]
                own = [] if self.vector else fps[start:stop]
                self.commands.append(_Command(n, list(range(start, stop)), own, args))

    def evaluate(self, replies: Sequence[Sequence[int]]) -> list[bool]:
        """Results per item; raises TagMismatch when a sub-filter's tag is not the expected one."""
        for cmd, reply in zip(self.commands, replies, strict=True):
            if reply[0] != self.subfilters[cmd.subfilter].tag:
                raise TagMismatch(str(cmd.args[0]))
        if self.vector:
            # A read holds fp iff some slot of (read XOR fp in every slot) is zero; the classic
            # zero-lane test, (x - lo) & ~x & hi != 0, answers that exactly for all slots at once.
            import numpy as np

            hits = np.zeros(self.count, dtype=bool)
            for cmd, reply in zip(self.commands, replies, strict=True):
                sub = self.subfilters[cmd.subfilter]
                start, stop = cmd.items[0], cmd.items[-1] + 1
                end = len(reply) - (AGE_VALUES if cmd.subfilter == 0 else 1)
                values = np.array(reply[1:end], dtype=np.int64).view(np.uint64)
                values = values.reshape(stop - start, 2, len(sub.parts))
                fps = self._fps[cmd.subfilter][start:stop].astype(np.uint64)
                for j, (lo, hi) in enumerate(sub.lanes):
                    x = values[:, :, j] ^ (fps * np.uint64(lo))[:, None]
                    hit = (x - np.uint64(lo)) & ~x & np.uint64(hi)
                    hits[start:stop] |= (hit != 0).any(axis=1)
            return hits.tolist()  # type: ignore[no-any-return]
        found = [False] * self.count
        for cmd, reply in zip(self.commands, replies, strict=True):
            sub = self.subfilters[cmd.subfilter]
            width = 2 * len(sub.parts)
            pos = 1
            for k, fp in zip(cmd.items, cmd.fps, strict=True):
                if not found[k]:
                    found[k] = sub.holds(reply[pos : pos + width], fp)
                pos += width
        return found

    def ages(self, replies: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
        """The filter's (write count, applied) as the replies read it: one per command when
        it has one sub-filter (its chunks go unwrapped, each read on its own), else one for
        the whole MULTI, from each sub-filter's first command."""
        if len(self.subfilters) == 1:
            return [SingleRead.age(reply) for reply in replies]
        items = deletes = applied = 0
        seen = set()
        for cmd, reply in zip(self.commands, replies, strict=True):
            if cmd.subfilter in seen:
                continue
            seen.add(cmd.subfilter)
            if cmd.subfilter == 0:
                items0, deletes, applied = reply[-AGE_VALUES:]
                items += items0
            else:
                items += reply[-1]
        return [(age_of(items, deletes), applied)]
