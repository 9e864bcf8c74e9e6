"""The stored format: header fields, sub-filter geometry, sizing from capacity or error rate.

docs/format.md describes the same bytes for other clients; the Lua prelude reads them.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import cached_property
from typing import NamedTuple

from guard.errors import FilterCorruptError

MAGIC = 0x434B4744  # "CKGD"
VERSION = 3
HEADER_BYTES = 128
# The header's fields in byte order, as big-endian struct codes (docs/format.md's table).
_FIELDS = (
    ("magic", "I"), ("version", "B"), ("bucket_size", "B"), ("fp_bits", "B"),
    ("fp_step", "B"), ("expansion", "B"), ("subfilters", "B"), ("index", "B"), ("flags", "B"),
    ("buckets0", "I"), ("max_kicks", "H"), ("shards", "H"), ("seed", "I"), ("capacity", "q"),
    ("items", "q"), ("deletes", "q"), ("missed_deletes", "q"), ("error_rate", "q"),
    ("applied", "Q"),  # id of the last database change applied (docs/format.md, "Change feed")
    ("source", "Q"),  # identity of the change log the filter follows
)  # fmt: skip
_CODES = ">" + "".join(code for _, code in _FIELDS)  # one character per field
# Each field's byte offset: the size of the fields before it.
FIELD_AT = {name: struct.calcsize(_CODES[: k + 1]) for k, (name, _) in enumerate(_FIELDS)}
# Growth copies sub-filter 0's first COMMON_BYTES into a new sub-filter; the bytes after them
# are sub-filter 0's alone (0 elsewhere). From RESERVED_AT to HEADER_BYTES: zero.
SUBFILTERS_AT = FIELD_AT["subfilters"]
INDEX_AT = FIELD_AT["index"]
ITEMS_AT = FIELD_AT["items"]
DELETES_AT = FIELD_AT["deletes"]
ERROR_RATE_AT = FIELD_AT["error_rate"]
APPLIED_AT = FIELD_AT["applied"]
SOURCE_AT = FIELD_AT["source"]
COMMON_BYTES = APPLIED_AT
RESERVED_AT = SOURCE_AT + 8
MAX_CHANGE_ID = 2**53 - 1  # the scripts compare and add change ids as Lua doubles, exactly
MAX_SOURCE = 2**64 - 1
# Every sub-filter string ends in an 8-byte tag (Layout.tag), so that a lookup proves the
# layout it reads with one 64-bit read instead of the whole header.
TAG_BYTES = 8
DIGEST_BYTES = 6  # the tag's middle (Layout.digest)
TRAILER = 0xA5  # the tag's last byte: a truncated string loses it
TAG_INDEX_FLAG = 0x80  # set in the tag's first byte by sub-filters n >= 1 (Layout.tag)
MAX_SUBFILTERS = 32
MAX_STRING_BYTES = 512 * 1024 * 1024  # Redis's proto-max-bulk-len default
BUCKET_SIZES = (1, 2, 4, 8)
MIN_FP_BITS, MAX_FP_BITS = 4, 32
MAX_EXPANSION = 16
MAX_KICKS_LIMIT = 4000  # keeps the worst single insert far below Redis's 5 s busy-script limit
MAX_CAPACITY = 1 << 40
MAX_SHARDS = 1024
ERROR_RATE_SCALE = 10**12  # error_rate is stored as round(error_rate * ERROR_RATE_SCALE)
# The load at a table's first failed insert with 500 kicks (median of 5 seeds at ~100k slots:
# b=1 0.51, 2 0.874, 4 0.965, 8 0.990; docs/bench-core.md), less a margin so `capacity` items
# fit a fixed-size filter. Small tables vary more (lowest of 40 seeds below 4k slots: b=2
# 0.765, b=4 0.919), so they get more room: a few hundred bytes at most.
TARGET_LOAD = {1: 0.42, 2: 0.83, 4: 0.94, 8: 0.97}
SMALL_TABLE_SLOTS = 4096
SMALL_TABLE_LOAD = {1: 0.35, 2: 0.72, 4: 0.88, 8: 0.93}

_HEADER = struct.Struct(f"{_CODES}{HEADER_BYTES - RESERVED_AT}x")
assert _HEADER.size == HEADER_BYTES
FIELD_SIZE = {name: struct.calcsize(code) for name, code in _FIELDS}
# What the tag's digest hashes: version, b, f0, step, expansion (a byte each), max_kicks (2),
# buckets0 and seed (4 each), big-endian: 15 bytes.
DIGEST_FIELDS = struct.Struct(">BBBBBHII")


@dataclass(frozen=True)
class Layout:
    """What every script call carries to prove it reads the filter the caller thinks it reads."""

    bucket_size: int
    fp_bits: int  # width in sub-filter 0
    fp_step: int  # bits added per sub-filter (1 when sized by error rate, else 0)
    expansion: int
    subfilters: int
    max_kicks: int
    buckets0: int
    seed: int

    def args(self) -> list[int]:
        """The fields in order, then the digest: it lets the scripts check every tag."""
        return [self.bucket_size, self.fp_bits, self.fp_step, self.expansion, self.subfilters,
                self.max_kicks, self.buckets0, self.seed,
                int.from_bytes(self.digest, "big")]  # fmt: skip

    def buckets(self, n: int) -> int:
        return self.buckets0 * (self.expansion**n if self.expansion else 1)

    def fp_bits_at(self, n: int) -> int:
        return min(MAX_FP_BITS, self.fp_bits + self.fp_step * n)

    def string_bytes(self, n: int) -> int:
        return string_bytes(self.buckets(n), self.bucket_size, self.fp_bits_at(n))

    @cached_property
    def digest(self) -> bytes:
        """The tag's middle (DIGEST_BYTES): pins every field but ``subfilters``, fixed at
        creation."""
        fields = (VERSION, self.bucket_size, self.fp_bits, self.fp_step, self.expansion,
                  self.max_kicks, self.buckets0, self.seed)  # fmt: skip
        return hashlib.blake2b(DIGEST_FIELDS.pack(*fields), digest_size=DIGEST_BYTES).digest()

    def tag(self, n: int) -> bytes:
        """The last 8 bytes of sub-filter n's string under this layout."""
        # Sub-filter 0 counts the sub-filters (growth rewrites that byte); the others say which
        # one they are, with the top bit set so the two kinds never match (32 fits in 7 bits).
        first = self.subfilters if n == 0 else TAG_INDEX_FLAG | n
        return bytes([first]) + self.digest + bytes([TRAILER])


UNKNOWN_LAYOUT = Layout(0, 0, 0, 0, 0, 0, 0, 0)


def string_bytes(buckets: int, bucket_size: int, fp_bits: int) -> int:
    return HEADER_BYTES + (buckets * bucket_size * fp_bits + 7) // 8 + TAG_BYTES


def allocator_size(nbytes: int) -> int:
    """The jemalloc size class Redis rounds an allocation of ``nbytes`` up to (above 64 bytes,
    four per doubling): a table sized to fill its class gets the slack as free headroom."""
    if nbytes <= 64:
        return max(8, (nbytes + 7) // 8 * 8)
    step = (1 << (nbytes - 1).bit_length() - 1) // 4  # largest power of two below nbytes, / 4
    return (nbytes + step - 1) // step * step


def buckets_for(capacity: int, bucket_size: int, fp_bits: int) -> int:
    """Bucket count for ``capacity`` items: no power-of-two rounding, allocator slack reused."""
    need = max(1, math.ceil(capacity / (bucket_size * TARGET_LOAD[bucket_size])))
    if need * bucket_size < SMALL_TABLE_SLOTS:
        need = max(1, math.ceil(capacity / (bucket_size * SMALL_TABLE_LOAD[bucket_size])))
    nbytes = string_bytes(need, bucket_size, fp_bits)
    sds = (5 if nbytes < 65536 else 9) + 1  # sdshdr16/32 header + the NUL Redis keeps after it
    room = allocator_size(nbytes + sds) - sds
    table_bits = (room - HEADER_BYTES - TAG_BYTES) * 8
    return max(need, table_bits // (bucket_size * fp_bits))


def fp_bits_for(error_rate: float, bucket_size: int, growing: bool) -> int:
    """Narrowest fingerprint keeping the whole filter's false-positive rate under ``error_rate``.

    One full sub-filter answers a false "maybe" with probability at most 2b / 2**f. A growing
    filter adds one bit per sub-filter, so its rates form a series summing to under twice the
    first: one more bit up front covers every sub-filter it will ever have.
    """
    # In logarithms: 2b / error_rate overflows a float for denormal rates.
    bits = math.log2(2 * bucket_size) - math.log2(error_rate) + (1 if growing else 0)
    return max(MIN_FP_BITS, math.ceil(bits))


def pack_header(
    layout: Layout,
    capacity: int,
    error_rate: float | None,
    shards: int = 0,
    *,
    applied: int = 0,
    source: int = 0,
) -> bytes:
    """Sub-filter 0's header of a new, empty filter: index, flags and counters 0."""
    values = {
        **asdict(layout),  # the Layout's fields are named as the header's
        "magic": MAGIC,
        "version": VERSION,
        "shards": shards,
        "capacity": capacity,
        "error_rate": round((error_rate or 0.0) * ERROR_RATE_SCALE),
        "applied": applied,
        "source": source,
    }
    return _HEADER.pack(*(values.get(name, 0) for name, _ in _FIELDS))


class Header(NamedTuple):
    """A sub-filter's header, decoded (docs/format.md has the byte offsets)."""

    magic: int
    version: int
    layout: Layout  # as sub-filter 0 stores it; `subfilters` counts only there
    subfilter: int  # which sub-filter this string is
    shards: int
    capacity: int
    items: int
    deletes: int
    missed_deletes: int
    error_rate: float | None
    applied: int  # last database change applied (sub-filter 0; 0 = none)
    source: int  # the change log followed (sub-filter 0; 0 = none)


def unpack_header(data: bytes) -> Header:
    """Decode the header of a sub-filter string (no validation: compare magic yourself)."""
    (magic, version, b, f0, step, exp, nsub, index, _flags, m0, kicks, shards, seed, capacity,
     items, deletes, missed, eps_ppt, applied, source) = _HEADER.unpack_from(data)  # fmt: skip
    layout = Layout(b, f0, step, exp, nsub, kicks, m0, seed)
    rate = eps_ppt / ERROR_RATE_SCALE if eps_ppt else None
    return Header(magic, version, layout, index, shards, capacity, items, deletes, missed, rate,
                  applied, source)  # fmt: skip


class Stored(NamedTuple):
    """What the probe read of one sub-filter string: the replies to ``probe_reads(key)``."""

    key: str
    header: bytes
    length: int
    tag: bytes


def probe_reads(key: str) -> list[tuple[str, list[str | int]]]:
    """The commands (name, arguments) reading what verify_stored checks of a sub-filter string:
    its header, its length and its tag."""
    return [
        ("GETRANGE", [key, 0, HEADER_BYTES - 1]),
        ("STRLEN", [key]),
        ("GETRANGE", [key, -TAG_BYTES, -1]),
    ]


# (field, lowest, highest): every header field with a range of its own (docs/format.md,
# "Valid values"); guard/scripts.py writes the same list into _common.lua's full check. The
# version comes first, on its own: another version is not damage but another format.
FIELD_RANGES = (
    ("bucket_size", 1, 8), ("fp_bits", MIN_FP_BITS, MAX_FP_BITS), ("fp_step", 0, 1),
    ("expansion", 0, MAX_EXPANSION), ("subfilters", 1, MAX_SUBFILTERS), ("index", 0, 0),
    ("flags", 0, 0), ("buckets0", 1, 2**32 - 1), ("max_kicks", 0, MAX_KICKS_LIMIT),
    ("shards", 0, MAX_SHARDS), ("capacity", 1, MAX_CAPACITY), ("deletes", 0, 2**63 - 1),
    ("missed_deletes", 0, 2**63 - 1),
    ("error_rate", 0, ERROR_RATE_SCALE - 1),  # below 1
    ("applied", 0, MAX_CHANGE_ID),
)  # fmt: skip


def version_problem(version: int) -> str:
    """Why a string of another format version is refused (docs/format.md, "Upgrading")."""
    return (
        f"unsupported format version {version} (this library reads version {VERSION}; "
        "re-create the filter: docs/format.md, Upgrading)"
    )


def _field(header: bytes, name: str) -> int:
    """A header field as an unsigned integer (a signed one's negative values read as huge)."""
    at = FIELD_AT[name]
    return int.from_bytes(header[at : at + FIELD_SIZE[name]], "big")


def _header_problem(header: bytes) -> str | None:
    """What is wrong with sub-filter 0's header on its own, or None."""
    if len(header) <= FIELD_AT["version"] or _field(header, "magic") != MAGIC:
        return "bad magic"
    version = _field(header, "version")
    if version != VERSION:
        return version_problem(version)
    if len(header) < HEADER_BYTES:
        return f"truncated: {len(header)} bytes long, shorter than a header"
    if any(header[RESERVED_AT:HEADER_BYTES]):
        return f"reserved bytes {RESERVED_AT}-{HEADER_BYTES - 1} are not zero"
    for name, low, high in FIELD_RANGES:
        value = _field(header, name)
        if not low <= value <= high:
            return f"{name} {value} is out of range {low}-{high}"
    layout = unpack_header(header).layout
    if layout.bucket_size not in BUCKET_SIZES:
        return f"bucket_size {layout.bucket_size} is not one of {BUCKET_SIZES}"
    last = layout.subfilters - 1
    if last and not layout.expansion:
        return f"subfilters {layout.subfilters} in a filter of fixed size (expansion 0)"
    if layout.fp_step and layout.fp_bits + last > MAX_FP_BITS:
        return f"subfilters {layout.subfilters} would need fingerprints over {MAX_FP_BITS} bits"
    if layout.string_bytes(last) > MAX_STRING_BYTES:
        return f"buckets0 {layout.buckets0} makes sub-filter {last} larger than a Redis string"
    return None


def _string_problem(sub: Stored, n: int, header0: bytes, layout: Layout) -> str | None:
    """What is wrong with sub-filter n's string, or None, once sub-filter 0's header passed
    _header_problem."""
    header = sub.header
    if n:
        if len(header) < HEADER_BYTES or _field(header, "magic") != MAGIC:
            return "bad magic"
        count, index = header[SUBFILTERS_AT], header[INDEX_AT]
        if count != n or index != n:
            return f"holds sub-filter count {count} and index {index}, expected {n}"
        # Growth's copy: sub-filter 0's first COMMON_BYTES with count and index n, its own item
        # count, the other counters zero; then zeros where sub-filter 0 has its own bytes.
        grown = bytearray(header0[:COMMON_BYTES]) + bytes(HEADER_BYTES - COMMON_BYTES)
        grown[SUBFILTERS_AT] = grown[INDEX_AT] = n
        grown[ITEMS_AT:DELETES_AT] = header[ITEMS_AT:DELETES_AT]
        grown[DELETES_AT:ERROR_RATE_AT] = bytes(ERROR_RATE_AT - DELETES_AT)
        if header != grown:
            return "header disagrees with sub-filter 0's"
    items = _field(header, "items")
    slots = layout.buckets(n) * layout.bucket_size
    if items > slots:  # also every negative count: the field is a signed 64-bit integer
        return f"items {items} is out of range 0-{slots}"
    expected = layout.string_bytes(n)
    if sub.length != expected:
        how = "truncated" if sub.length < expected else "extended"
        return f"{how}: {sub.length} bytes long, its header says {expected}"
    if sub.tag != layout.tag(n):
        return "bad tag (it disagrees with the header)"
    return None


def verify_stored(name: str, subs: Sequence[Stored]) -> Layout:
    """The layout a stored filter holds, once every byte read agrees with the format, else
    FilterCorruptError. ``subs[0]`` is sub-filter 0; when ``subs`` holds fewer strings than it
    counts, only those are checked: read the rest, call again.
    """
    first = subs[0]
    if problem := _header_problem(first.header):
        raise FilterCorruptError(name, f"{first.key}: {problem}")
    layout = unpack_header(first.header).layout
    for n, sub in enumerate(subs[: layout.subfilters]):
        if problem := _string_problem(sub, n, first.header, layout):
            raise FilterCorruptError(name, f"{sub.key}: {problem}")
    return layout
