"""Script-free lookups: one BITFIELD_RO per sub-filter reads the header and the buckets.

A lookup only reads, and one Redis command is atomic by itself, so no script is needed: each
command carries the header fields, the trailer and the item's two buckets, and is checked here
exactly as the scripts check a header (docs/format.md). Every command validates itself, so a
chunked batch cannot mix two layouts; several sub-filters are read in one MULTI.

Reads are as wide as BITFIELD allows: the header in three 64-bit words, a bucket in as few
reads as hold whole slots in 64 bits (one for b=4, f=16). Each GET sub-command costs the
server and the client (packing, parsing) far more than the bits it carries.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from guard import hashing
from guard import layout as fmt
from guard.layout import Layout

# Sub-filter 0's header bytes 0..23 as three i64 words (all positive in a valid header):
# magic, version, b, f0, fp_step | expansion, subfilters, index, flags, m0 | kicks, -, seed.
_HEADER0 = (("i64", 0), ("i64", 64), ("i64", 128))
_HEADER0_WORDS = struct.Struct(">IBBBBBBBBIHHI")
_HEADER_N = (("u32", 0), ("u8", 80))  # other sub-filters: magic and index
MAX_GETS = 2000
_U64 = 1 << 64


class Stale(Exception):
    """The stored layout differs from the handle's; carries the stored one."""

    def __init__(self, layout: Layout) -> None:
        super().__init__("stale layout")
        self.layout = layout


class BadHeader(Exception):
    """Magic, index or trailer wrong: missing (if the key is gone) or corrupt."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(reason)
        self.key = key
        self.reason = reason


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

    def gets(self, bucket_bit: int) -> list[object]:
        out: list[object] = []
        for first, _, bits in self.parts:
            # u64 does not exist (unsigned tops out at 63 bits): read i64, fix the sign below.
            out += ("GET", "i64" if bits == 64 else f"u{bits}", bucket_bit + first * self.fp_bits)
        return out

    def holds(self, values: Sequence[int], fp: int) -> bool:
        f, mask = self.fp_bits, (1 << self.fp_bits) - 1
        for (_, count, bits), v in zip(self.parts, values, strict=True):
            v %= _U64
            for j in range(count):
                if (v >> (bits - (j + 1) * f)) & mask == fp:
                    return True
        return False


@dataclass
class _Command:
    subfilter: int
    items: list[int]  # indexes into the batch
    fps: list[int]
    args: list[object]


class ReadPlan:
    """The commands answering ``lookup`` for a batch under one layout, and their check."""

    def __init__(
        self, layout: Layout, hashes: Sequence[tuple[int, int]], key: Callable[[int], str]
    ) -> None:
        self.layout = layout
        self.count = len(hashes)
        b = layout.bucket_size
        fixed = [(h, hashing.fix_g(g, layout.fp_bits)) for h, g in hashes]
        self.reads = [_BucketReads.plan(b, layout.fp_bits_at(n)) for n in range(layout.subfilters)]
        self.commands: list[_Command] = []
        for n, reads in enumerate(self.reads):
            m, f = layout.buckets(n), layout.fp_bits_at(n)
            per_item = 2 * len(reads.parts)
            per_command = max(1, (MAX_GETS - len(_HEADER0) - 1) // per_item)
            trailer = (layout.string_bytes(n) - 1) * 8
            header = _HEADER0 if n == 0 else _HEADER_N
            for start in range(0, max(1, self.count), per_command):
                args: list[object] = [key(n)]
                for t, off in header:
                    args += ("GET", t, off)
                args += ("GET", "u8", trailer)
                idx = list(range(start, min(self.count, start + per_command)))
                fps = []
                for k in idx:
                    h, g = fixed[k]
                    i1 = h % m
                    i2 = hashing.alt_bucket(i1, hashing.fingerprint(g, layout.fp_bits), m)
                    fps.append(hashing.fingerprint(g, f))
                    args += reads.gets(fmt.HEADER_BYTES * 8 + i1 * b * f)
                    args += reads.gets(fmt.HEADER_BYTES * 8 + i2 * b * f)
                self.commands.append(_Command(n, idx, fps, args))

    def evaluate(self, replies: Sequence[Sequence[int]]) -> list[bool]:
        """Results per item; raises Stale or BadHeader when a header check fails."""
        found = [False] * self.count
        for cmd, reply in zip(self.commands, replies, strict=True):
            key = str(cmd.args[0])
            if cmd.subfilter == 0:
                self._check_header0(key, reply)
                skip = len(_HEADER0) + 1
            else:
                if reply[0] != fmt.MAGIC or reply[1] != cmd.subfilter:
                    raise BadHeader(key, f"bad sub-filter {key}")
                if reply[2] != fmt.TRAILER:
                    raise BadHeader(key, f"truncated: {key}")
                skip = len(_HEADER_N) + 1
            reads = self.reads[cmd.subfilter]
            width = len(reads.parts)
            pos = skip
            for k, fp in zip(cmd.items, cmd.fps, strict=True):
                if not found[k]:
                    found[k] = reads.holds(reply[pos : pos + width], fp) or reads.holds(
                        reply[pos + width : pos + 2 * width], fp
                    )
                pos += 2 * width
        return found

    def _check_header0(self, key: str, reply: Sequence[int]) -> None:
        raw = b"".join((int(w) % _U64).to_bytes(8, "big") for w in reply[:3])
        magic, version, *fields = _HEADER0_WORDS.unpack(raw)
        if magic != fmt.MAGIC:
            raise BadHeader(key, f"bad magic in {key}")
        if version != fmt.VERSION:
            raise BadHeader(key, "unsupported format version")
        b, f0, step, exp, nsub, _index, _flags, m0, kicks, _shards, seed = fields
        stored = Layout(b, f0, step, exp, nsub, kicks, m0, seed)
        if stored != self.layout:
            raise Stale(stored)
        if reply[len(_HEADER0)] != fmt.TRAILER:
            raise BadHeader(key, f"truncated: {key}")
