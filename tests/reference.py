"""A pure-Python twin of the Lua scripts: same placement, same kick victims, same growth.

Tests replay random operations on it and on Redis and compare the tables slot for slot, so
any divergence of the Lua from the specified algorithm shows up at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from guard import hashing, layout
from guard.changes import Change
from guard.layout import Layout

P31 = 2147483647


def lehmer_next(state: int) -> int:
    """The kick chain's victim generator (seeded per item; _common.lua's, reproduced)."""
    return (state * 48271) % P31


def lehmer_seed(h: int, g: int) -> int:
    return (h + g) % (P31 - 1) + 1


def unpack_table(data: bytes, buckets: int, bucket_size: int, fp_bits: int) -> list[int]:
    """A sub-filter string's slots, laid out as the twin's tables (tests compare the two)."""
    # One pass over a bit string: shifting one big integer per slot would be quadratic.
    bits = "".join(f"{byte:08b}" for byte in data[layout.HEADER_BYTES : -layout.TAG_BYTES])
    return [
        int(bits[k : k + fp_bits], 2) for k in range(0, buckets * bucket_size * fp_bits, fp_bits)
    ]


class SourceMismatch(Exception):
    """The filter follows another change log (the library raises ChangeSourceError)."""


@dataclass
class Applied:
    """What apply() did: the library's ApplyResult, plus whether a full filter stopped it."""

    applied: int
    gap: bool
    results: list[bool]
    skipped: int
    full: bool = False


@dataclass
class ReferenceFilter:
    layout: Layout
    tables: list[list[int]] = field(default_factory=list)
    applied: int = 0  # the change feed's watermark (docs/format.md, "Change feed")
    source: int = 0

    def __post_init__(self) -> None:
        if not self.tables:
            self.tables = [self._empty(0)]

    def _empty(self, n: int) -> list[int]:
        return [0] * (self.layout.buckets(n) * self.layout.bucket_size)

    def _bucket(self, n: int, i: int) -> range:
        b = self.layout.bucket_size
        return range(i * b, (i + 1) * b)

    def _item_at(self, h: int, g: int, n: int) -> tuple[int, int, int]:
        lay = self.layout
        m = lay.buckets(n)
        fp = hashing.fingerprint(g, lay.fp_bits_at(n))
        i1 = h % m
        return fp, i1, hashing.alt_bucket(i1, hashing.fingerprint(g, lay.fp_bits), m)

    def _hash(self, item: str | bytes) -> tuple[int, int]:
        h, g = hashing.item_hash(item, self.layout.seed)
        return h, hashing.fix_g(g, self.layout.fp_bits)

    def _find(self, n: int, i: int, fp: int) -> int | None:
        t = self.tables[n]
        return next((k for k in self._bucket(n, i) if t[k] == fp), None)

    def lookup(self, item: str | bytes) -> bool:
        h, g = self._hash(item)
        for n in range(len(self.tables)):
            fp, i1, i2 = self._item_at(h, g, n)
            if self._find(n, i1, fp) is not None or self._find(n, i2, fp) is not None:
                return True
        return False

    def count(self, item: str | bytes) -> int:
        h, g = self._hash(item)
        total = 0
        for n, t in enumerate(self.tables):
            fp, i1, i2 = self._item_at(h, g, n)
            buckets = {i1, i2}
            total += sum(1 for i in buckets for k in self._bucket(n, i) if t[k] == fp)
        return total

    def delete(self, item: str | bytes) -> bool:
        h, g = self._hash(item)
        for n in reversed(range(len(self.tables))):
            fp, i1, i2 = self._item_at(h, g, n)
            for i in (i1, i2):
                k = self._find(n, i, fp)
                if k is not None:
                    self.tables[n][k] = 0
                    return True
        return False

    def insert(self, item: str | bytes, unique: bool = False) -> bool | None:
        """True added, False present (unique), None when it could not be placed (full)."""
        if unique and self.lookup(item):
            return False
        h, g = self._hash(item)
        if self._place_direct(h, g) or (self.layout.max_kicks and self._place_kicking(h, g)):
            return True
        if not self._grow():
            return None
        self._place_direct(h, g)
        return True

    def _place_direct(self, h: int, g: int) -> bool:
        for n in reversed(range(len(self.tables))):
            fp, i1, i2 = self._item_at(h, g, n)
            for i in (i1, i2):
                k = self._find(n, i, 0)
                if k is not None:
                    self.tables[n][k] = fp
                    return True
        return False

    def _place_kicking(self, h: int, g: int) -> bool:
        lay = self.layout
        n = len(self.tables) - 1
        t = list(self.tables[n])  # kicks work on a copy: a failed chain leaves no trace
        m = lay.buckets(n)
        fp, i1, i2 = self._item_at(h, g, n)
        st = lehmer_next(lehmer_seed(h, g))
        i = i1 if st % 2 == 0 else i2
        shift = lay.fp_bits_at(n) - lay.fp_bits
        for _ in range(lay.max_kicks):
            st = lehmer_next(st)
            k = i * lay.bucket_size + st % lay.bucket_size
            t[k], fp = fp, t[k]
            i = hashing.alt_bucket(i, fp >> shift, m)
            free = next((k for k in self._bucket(n, i) if t[k] == 0), None)
            if free is not None:
                t[free] = fp
                self.tables[n] = t
                return True
        return False

    def _grow(self) -> bool:
        lay = self.layout
        n = len(self.tables)
        if lay.expansion == 0 or n >= layout.MAX_SUBFILTERS:
            return False
        if lay.fp_step and lay.fp_bits + lay.fp_step * n > layout.MAX_FP_BITS:
            return False
        self.layout = replace(lay, subfilters=n + 1)
        if self.layout.string_bytes(n) > layout.MAX_STRING_BYTES:
            self.layout = lay
            return False
        self.tables.append(self._empty(n))
        return True

    # -- the change feed: guard/lua/apply.lua and undo.lua ----------------------------------

    def _check_source(self, source: int) -> None:
        if self.source and self.source != source:
            raise SourceMismatch(f"{self.source} != {source}")

    def apply(self, changes: Sequence[Change], source: int) -> Applied:
        """Each change exactly once: ids up to ``applied`` are skipped, the next must follow
        ``applied``, which moves to the last change handled."""
        self._check_source(source)
        first = changes[0].id if changes else 1
        skip = min(len(changes), max(0, self.applied - first + 1))
        if skip < len(changes) and first + skip != self.applied + 1:
            return Applied(self.applied, True, [], 0)
        out = Applied(self.applied, False, [True] * skip, skip)
        for change in changes[skip:]:
            if change.insert:
                added = self.insert(change.item)
                if added is None:
                    out.full = True
                    break
                out.results.append(added)
            else:
                out.results.append(self.delete(change.item))
        self.applied = out.applied = max(self.applied, first + len(out.results) - 1)
        self.source = source
        return out

    def undo(self, change: Change, source: int) -> bool | None:
        """Take back the last change applied: True; False when ``change`` is not it; None
        when a delete cannot be taken back (no room for the item)."""
        self._check_source(source)
        if self.applied != change.id:
            return False
        if change.insert:
            self.delete(change.item)
        elif self.insert(change.item) is None:
            return None
        self.applied = change.id - 1
        self.source = source
        return True
