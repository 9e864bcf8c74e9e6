"""Export a filter to a file in chunks, and restore one, checked end to end, by atomic swap.

The file (all integers big-endian)::

    b"CKGDUMP\\0"  u16 version  u32 n  <n bytes of JSON header>
    chunk*:     u16 sub-filter  u64 offset  u32 length  <length bytes>
    end:        u16 0xFFFF      u64 total bytes of all chunks  u32 0
    SHA-256 of everything above (32 bytes)

The JSON header names the filter, its layout, the byte length of every sub-filter string and
the item count. Export reads a snapshot: one MULTI/EXEC COPYs every sub-filter key under the
filter's hash tag (a memory copy: writers wait microseconds), with a TTL in case the export
dies; the copies are read in GETRANGE chunks, then deleted. A read-only replica refuses COPY:
there every chunk of the live keys is read in one MULTI (a replica changes only by
replication, so one transaction sees one instant).

Both sides check every sub-filter string as the probe does (layout.verify_stored): export
before it writes a byte, import over the whole file (with the checksum, lengths and offsets)
before it writes anything. Import then fills the filter's staging copy, verifies it again and
promotes it in one Lua script: a refused or failed import leaves the live filter as it was.

Sync only (``SyncCuckooFilter``): this is for the command line and scripts.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any, BinaryIO

from redis.exceptions import ReadOnlyError, ResponseError

from guard import scripts
from guard.errors import FilterCorruptError, FilterNotFoundError, GuardError
from guard.filter import SyncCuckooFilter
from guard.layout import (
    HEADER_BYTES,
    MAX_STRING_BYTES,
    MAX_SUBFILTERS,
    TAG_BYTES,
    Layout,
    Stored,
    probe_reads,
    unpack_header,
    verify_stored,
)
from guard.layout import VERSION as FORMAT_VERSION

MAGIC = b"CKGDUMP\x00"
VERSION = 1
CHUNK_BYTES = 1 << 20
MAX_CHUNK_BYTES = 64 << 20
MAX_HEADER_BYTES = 1 << 20
SNAPSHOT_TTL_MS = 3_600_000
PIPELINE_CHUNKS = 8  # GETRANGE / SETRANGE replies in flight at once (8 MiB by default)

_PREAMBLE = struct.Struct(">8sHI")
_CHUNK = struct.Struct(">HQI")
_END_SUB = 0xFFFF


class DumpError(GuardError):
    """A dump file is corrupt, truncated, or does not describe a valid filter."""


@dataclass(frozen=True)
class DumpHeader:
    name: str
    layout: Layout
    lengths: list[int]
    items: int
    capacity: int

    def to_json(self) -> bytes:
        return json.dumps({**asdict(self), "format": FORMAT_VERSION}, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> DumpHeader:
        """The header, once its lengths are the ones its layout makes."""
        try:
            body = json.loads(raw)
            layout = Layout(**{k: int(v) for k, v in body["layout"].items()})
            lengths = [int(n) for n in body["lengths"]]
            name, items, capacity = str(body["name"]), int(body["items"]), int(body["capacity"])
            version = int(body["format"])
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise DumpError(f"bad dump header: {exc!r}") from None
        if version != FORMAT_VERSION:
            raise DumpError(f"filter format version {version} is not supported")
        if not 1 <= layout.subfilters <= MAX_SUBFILTERS:
            raise DumpError(f"bad dump header: {layout.subfilters} sub-filters")
        if lengths != [layout.string_bytes(n) for n in range(layout.subfilters)]:
            raise DumpError(f"bad dump header: lengths {lengths} are not those of its layout")
        if any(n > MAX_STRING_BYTES for n in lengths):
            raise DumpError("bad dump header: a sub-filter is larger than a Redis string")
        return cls(name, layout, lengths, items, capacity)


@dataclass(frozen=True)
class DumpSummary:
    name: str
    subfilters: int
    items: int
    bytes: int  # filter bytes (the file is slightly larger)
    sha256: str


def _snapshot(cf: SyncCuckooFilter) -> list[str] | None:
    """Copy every sub-filter key to snapshot keys in one transaction; return their names, or
    None on a read-only replica (it refuses COPY)."""
    token = secrets.token_hex(8)
    snaps = [f"{cf.key(0)}:dump:{token}:{n}" for n in range(MAX_SUBFILTERS)]
    pipe = cf.redis.pipeline(transaction=True)
    for n, snap in enumerate(snaps):
        pipe.copy(cf.key(n), snap)
        pipe.pexpire(snap, SNAPSHOT_TTL_MS)
    try:
        replies = pipe.execute()
    except ReadOnlyError:
        return None
    if not replies[0]:
        if any(replies[2::2]):  # what is left of a filter is no filter, but never "absent"
            cf.redis.delete(*snaps)
            raise FilterCorruptError(cf.name, f"{cf.key(0)} is missing")
        raise FilterNotFoundError(f"{cf.name}: no such filter")
    return snaps


_Range = tuple[int, int, int]  # (sub-filter, start, size)


def _read(
    redis: Any, name: str, keys: list[str], names: list[str], ranges: Sequence[_Range] = ()
) -> tuple[list[Stored], list[bytes]]:
    """The probe's reads of ``keys`` (Stored under ``names``, the live keys: the snapshot's are
    nobody's business), then GETRANGE of each of ``ranges``. Those are a replica's chunks,
    read in one MULTI with the probe's reads: they belong to the filter those saw."""
    pipe = redis.pipeline(transaction=bool(ranges))
    for key in keys:
        for command, args in probe_reads(key):
            pipe.execute_command(command, *args)
    for n, start, size in ranges:
        pipe.getrange(keys[n], start, start + size - 1)
    replies = pipe.execute(raise_on_error=False)
    for reply in replies:
        if isinstance(reply, ResponseError):
            raise scripts.map_error(reply, name) from reply
    stored = [Stored(key, *replies[3 * n : 3 * n + 3]) for n, key in enumerate(names)]
    return stored, replies[3 * len(keys) :]


def _getranges(redis: Any, keys: list[str], ranges: list[_Range]) -> Iterator[bytes]:
    pipe = redis.pipeline(transaction=False)
    for i in range(0, len(ranges), PIPELINE_CHUNKS):
        for n, start, size in ranges[i : i + PIPELINE_CHUNKS]:
            pipe.getrange(keys[n], start, start + size - 1)
        yield from pipe.execute()


def export_filter(
    cf: SyncCuckooFilter,
    out: BinaryIO,
    *,
    chunk_bytes: int = CHUNK_BYTES,
    progress: Any = None,
) -> DumpSummary:
    """Write ``cf`` to ``out`` from a consistent snapshot. ``progress(nbytes)`` per chunk."""
    if not 1 <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be 1-{MAX_CHUNK_BYTES}")
    redis = cf.redis
    snaps = _snapshot(cf)
    live = [cf.key(n) for n in range(MAX_SUBFILTERS)]
    source = snaps or live
    try:
        count = verify_stored(cf.name, _read(redis, cf.name, source[:1], live[:1])[0]).subfilters
        stored, _ = _read(redis, cf.name, source[:count], live[:count])
        layout = verify_stored(cf.name, stored)  # every sub-filter, as the probe checks them
        changed = GuardError(f"{cf.name}: the filter changed while reading it; try again")
        if layout.subfilters != count:  # only a replica's live keys can change meanwhile
            raise changed
        lengths = [s.length for s in stored]
        ranges = [
            (n, start, min(chunk_bytes, length - start))
            for n, length in enumerate(lengths)
            for start in range(0, length, chunk_bytes)
        ]
        if snaps:
            chunks: Iterable[bytes] = _getranges(redis, snaps, ranges)
        else:  # a replica: every chunk and the probe's reads again, in one MULTI
            again, chunks = _read(redis, cf.name, live[:count], live[:count], ranges)
            if again != stored:
                raise changed
        headers = [unpack_header(s.header) for s in stored]
        items = sum(h.items for h in headers)  # each sub-filter's header counts its own
        header = DumpHeader(cf.name, layout, lengths, items, headers[0].capacity)
        digest = hashlib.sha256()

        def write(data: bytes) -> None:
            digest.update(data)
            out.write(data)

        raw_header = header.to_json()
        write(_PREAMBLE.pack(MAGIC, VERSION, len(raw_header)) + raw_header)
        for (n, start, size), data in zip(ranges, chunks, strict=True):
            if len(data) != size:
                raise GuardError(f"{cf.name}: snapshot changed while reading it")
            write(_CHUNK.pack(n, start, size) + data)
            if progress:
                progress(size)
        write(_CHUNK.pack(_END_SUB, sum(lengths), 0))
        out.write(digest.digest())
        return DumpSummary(cf.name, layout.subfilters, items, sum(lengths), digest.hexdigest())
    finally:
        if snaps:
            redis.delete(*snaps)


def _chunks(f: IO[bytes], header_out: list[DumpHeader]) -> Iterator[tuple[int, int, bytes]]:
    """Parse a dump into ``header_out`` and (sub-filter, offset, data), checking everything on
    the way. The checksum is known only at the end: a caller that writes must first have run
    this to the end (``validate_dump``)."""
    digest = hashlib.sha256()

    def read(n: int, what: str) -> bytes:
        data = f.read(n)
        if len(data) != n:
            raise DumpError(f"truncated dump: file ends inside {what}")
        digest.update(data)
        return data

    magic, version, hlen = _PREAMBLE.unpack(read(_PREAMBLE.size, "the preamble"))
    if magic != MAGIC:
        raise DumpError("not a cuckoo-guard dump (bad magic)")
    if version != VERSION:
        raise DumpError(f"dump version {version} is not supported (this reads {VERSION})")
    if not 2 <= hlen <= MAX_HEADER_BYTES:
        raise DumpError(f"bad dump header length {hlen}")
    header = DumpHeader.from_json(read(hlen, "the header"))
    header_out.append(header)
    sub, pos = 0, 0
    while True:
        n, offset, size = _CHUNK.unpack(read(_CHUNK.size, "a chunk header"))
        if n == _END_SUB:
            if sub != len(header.lengths) or offset != sum(header.lengths) or size != 0:
                raise DumpError("truncated dump: sub-filters missing before the end marker")
            break
        if sub >= len(header.lengths) or n != sub or offset != pos:
            raise DumpError(f"bad chunk order at sub-filter {n} offset {offset}")
        if not 1 <= size <= min(MAX_CHUNK_BYTES, header.lengths[sub] - pos):
            raise DumpError(f"bad chunk length {size} at sub-filter {n} offset {offset}")
        yield n, offset, read(size, f"sub-filter {n}")
        pos += size
        if pos == header.lengths[sub]:
            sub, pos = sub + 1, 0
    expected = digest.digest()
    checksum = f.read(len(expected))
    if len(checksum) != len(expected):
        raise DumpError("truncated dump: checksum missing")
    if f.read(1):
        raise DumpError("corrupt dump: bytes after the checksum")
    if checksum != expected:
        raise DumpError("corrupt dump: SHA-256 checksum mismatch")


def validate_dump(path: str | Path) -> DumpHeader:
    """Check a dump file completely (checksum, lengths, every sub-filter string as the probe
    checks it); write nothing."""
    found: list[DumpHeader] = []
    heads: dict[int, bytes] = {}
    tags: dict[int, bytes] = {}
    with open(path, "rb") as f:
        for n, offset, data in _chunks(f, found):
            if offset < HEADER_BYTES:  # the header and the tag may span chunks
                heads[n] = heads.get(n, b"") + data[: HEADER_BYTES - offset]
            tags[n] = (tags.get(n, b"") + data[-TAG_BYTES:])[-TAG_BYTES:]
    header = found[0]
    stored = [
        Stored(f"sub-filter {n}", heads[n], length, tags[n])
        for n, length in enumerate(header.lengths)
    ]
    try:
        layout = verify_stored(header.name, stored)
    except FilterCorruptError as exc:
        raise DumpError(f"corrupt dump: {exc.reason}") from None
    if layout != header.layout or unpack_header(heads[0]).capacity != header.capacity:
        raise DumpError("corrupt dump: the stored filter header disagrees with the dump header")
    return header


def import_filter(cf: SyncCuckooFilter, path: str | Path, *, progress: Any = None) -> DumpHeader:
    """Replace ``cf`` (or create it) with the filter in the dump at ``path``: nothing is
    written unless the whole file checks out; the live filter changes only at the promote."""
    header = validate_dump(path)
    staging = cf.staging()
    staging.drop()  # a crashed import or rebuild may have left a staging copy
    try:
        pipe = cf.redis.pipeline(transaction=False)
        for n, length in enumerate(header.lengths):
            # One allocation at full size (zero-filled), then the chunks overwrite it.
            pipe.setrange(staging.key(n), length - 1, b"\x00")
        with open(path, "rb") as f:
            for n, offset, data in _chunks(f, []):
                pipe.setrange(staging.key(n), offset, data)
                if progress:
                    progress(len(data))
                if len(pipe) >= PIPELINE_CHUNKS:
                    pipe.execute()
        pipe.execute()  # the file re-checked to its checksum before this last write
        # The probe verifies every string (length, header, tag), as validate_dump did.
        items = staging.info().items
        if items != header.items:
            raise DumpError(f"restored copy holds {items} items, the dump {header.items}")
        staging.promote()
    except BaseException:
        staging.drop()
        raise
    return header


__all__ = [
    "DumpError",
    "DumpHeader",
    "DumpSummary",
    "export_filter",
    "import_filter",
    "validate_dump",
]
