"""Export a filter to a file in chunks, and restore one, checked end to end, by atomic swap.

The file (all integers big-endian)::

    b"CKGDUMP\\0"  u16 version  u32 n  <n bytes of JSON header>
    chunk*:     u16 sub-filter  u64 offset  u32 length  <length bytes>
    end:        u16 0xFFFF      u64 total bytes of all chunks  u32 0
    SHA-256 of everything above (32 bytes)

The JSON header names the filter, its layout, the byte length of every sub-filter string and
the item count. Export reads a snapshot: one MULTI/EXEC copies every sub-filter key to
snapshot keys under the filter's hash tag (COPY is a memory copy on the server, so writers wait
microseconds, and the copies cannot change while they are read in GETRANGE chunks); the copies
carry a TTL so a crashed export cleans up after itself, and are deleted when done. A read-only
replica refuses COPY: there every chunk of the live keys is read in one MULTI instead (the
replica changes only by replication, so one transaction sees one instant). Every sub-filter
is checked as the probe checks it (guard/layout.py:verify_stored) before a byte is written.

Import reads the whole file once to check the checksum, every length and offset, and the
sub-filter headers, before it writes anything. Then it writes the filter's staging copy (each
string created at full size by one SETRANGE at its last byte, then filled chunk by chunk),
checks it through the scripts, and promotes it: one Lua script replaces the live filter. A
refused or failed import leaves the live filter as it was.

Sync only (``SyncCuckooFilter``): this is for the command line and scripts.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import struct
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any, BinaryIO

from redis.exceptions import ReadOnlyError, ResponseError

from guard.errors import FilterCorruptError, FilterNotFoundError, GuardError
from guard.filter import SyncCuckooFilter
from guard.layout import (
    HEADER_BYTES,
    INDEX_AT,
    MAX_STRING_BYTES,
    MAX_SUBFILTERS,
    TAG_BYTES,
    Layout,
    Stored,
    probe_reads,
    unpack_header,
    verify_stored,
)
from guard.layout import MAGIC as FILTER_MAGIC
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
_DIGEST = 32


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
        body = asdict(self)
        body["format"] = FORMAT_VERSION
        return json.dumps(body, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> DumpHeader:
        try:
            body = json.loads(raw)
            layout = Layout(**{k: int(v) for k, v in body["layout"].items()})
            header = cls(
                name=str(body["name"]),
                layout=layout,
                lengths=[int(n) for n in body["lengths"]],
                items=int(body["items"]),
                capacity=int(body["capacity"]),
            )
            version = int(body["format"])
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise DumpError(f"bad dump header: {exc!r}") from None
        if version != FORMAT_VERSION:
            raise DumpError(f"filter format version {version} is not supported")
        header.check()
        return header

    def check(self) -> None:
        lay = self.layout
        if not 1 <= lay.subfilters <= MAX_SUBFILTERS or len(self.lengths) != lay.subfilters:
            raise DumpError("bad dump header: sub-filter count does not match the lengths")
        try:
            expected = [lay.string_bytes(n) for n in range(lay.subfilters)]
        except (ValueError, OverflowError, ZeroDivisionError):
            raise DumpError("bad dump header: impossible layout") from None
        if self.lengths != expected:
            raise DumpError(
                f"bad dump header: sub-filter lengths {self.lengths} do not match the layout "
                f"({expected})"
            )
        if any(n > MAX_STRING_BYTES for n in self.lengths):
            raise DumpError("bad dump header: a sub-filter is larger than a Redis string")


@dataclass(frozen=True)
class DumpSummary:
    name: str
    subfilters: int
    items: int
    bytes: int  # filter bytes (the file is slightly larger)
    sha256: str


def _parse_header(data: bytes) -> tuple[Layout, int, int]:
    """(layout, capacity, items) from sub-filter 0's header."""
    if len(data) < HEADER_BYTES:
        raise DumpError("sub-filter 0 is shorter than a header")
    header = unpack_header(data)
    if header.magic != FILTER_MAGIC:
        raise FilterNotFoundError("not a cuckoo-guard filter (bad magic)")
    if header.version != FORMAT_VERSION:
        raise DumpError(f"filter format version {header.version} is not supported")
    return header.layout, header.capacity, header.items


# -- export ---------------------------------------------------------------------------------


def _snapshot(cf: SyncCuckooFilter) -> list[str] | None:
    """Copy every sub-filter key to snapshot keys in one transaction; return their names.

    None on a read-only replica, which refuses COPY (see _read_at_once)."""
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


def _read_stored(redis: Any, name: str, keys: list[str], names: list[str]) -> list[Stored]:
    pipe = redis.pipeline(transaction=False)
    for key in keys:
        for command, args in probe_reads(key):
            pipe.execute_command(command, *args)
    replies = pipe.execute(raise_on_error=False)
    for k, reply in enumerate(replies):
        if isinstance(reply, ResponseError) and "WRONGTYPE" in str(reply):
            raise FilterCorruptError(name, f"{names[k // 3]} holds another type")
        if isinstance(reply, Exception):
            raise reply
    return [Stored(name, *replies[3 * n : 3 * n + 3]) for n, name in enumerate(names)]


def _read_at_once(
    redis: Any, name: str, stored: list[Stored], chunk: int
) -> dict[tuple[int, int], bytes]:
    """Every chunk of the live keys, {(sub-filter, offset): bytes}, read in one MULTI.

    For a read-only replica: no snapshot can be made there, but it changes only by
    replication, so one transaction sees one instant. It re-reads the headers, lengths and
    tags in the same MULTI: the chunks belong to the filter that was verified.
    """
    keys = [s.key for s in stored]
    wanted = [
        (n, start, size) for n, s in enumerate(stored) for start, size in _ranges(s.length, chunk)
    ]
    pipe = redis.pipeline(transaction=True)
    for key in keys:
        for command, args in probe_reads(key):
            pipe.execute_command(command, *args)
    for n, start, size in wanted:
        pipe.getrange(keys[n], start, start + size - 1)
    replies = pipe.execute()
    again = [Stored(key, *replies[3 * n : 3 * n + 3]) for n, key in enumerate(keys)]
    if again != stored:
        raise GuardError(f"{name}: the filter changed while reading it; try again")
    data = replies[3 * len(keys) :]
    return {(n, start): data[k] for k, (n, start, _) in enumerate(wanted)}


def _ranges(length: int, chunk: int) -> Iterator[tuple[int, int]]:
    for start in range(0, length, chunk):
        yield start, min(chunk, length - start)


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
        # Checked under the live keys' names: the snapshot's are nobody's business.
        stored = _read_stored(redis, cf.name, source[:1], live[:1])
        layout = verify_stored(cf.name, stored)
        names = live[: layout.subfilters]
        stored = _read_stored(redis, cf.name, source[: layout.subfilters], names)
        verify_stored(cf.name, stored)  # every sub-filter, as the probe checks them
        at_once = None if snaps else _read_at_once(redis, cf.name, stored, chunk_bytes)
        headers = [unpack_header(s.header) for s in stored]
        # Items live in each sub-filter's own header (bytes 32..39).
        items = sum(h.items for h in headers)
        lengths = [s.length for s in stored]
        header = DumpHeader(cf.name, layout, lengths, items, headers[0].capacity)
        try:
            header.check()
        except DumpError as exc:
            raise GuardError(f"{cf.name}: stored filter is inconsistent: {exc}") from None
        digest = hashlib.sha256()

        def write(data: bytes) -> None:
            digest.update(data)
            out.write(data)

        raw_header = header.to_json()
        write(_PREAMBLE.pack(MAGIC, VERSION, len(raw_header)) + raw_header)
        total = 0
        for n, length in enumerate(lengths):
            ranges = list(_ranges(length, chunk_bytes))
            for i in range(0, len(ranges), PIPELINE_CHUNKS):
                group = ranges[i : i + PIPELINE_CHUNKS]
                pipe = redis.pipeline(transaction=False)
                for start, size in group:
                    pipe.getrange(source[n], start, start + size - 1)
                replies = [at_once[n, s] for s, _ in group] if at_once else pipe.execute()
                for (start, size), data in zip(group, replies, strict=True):
                    if len(data) != size:
                        raise GuardError(f"{cf.name}: snapshot changed while reading it")
                    write(_CHUNK.pack(n, start, size) + data)
                    total += size
                    if progress:
                        progress(size)
        write(_CHUNK.pack(_END_SUB, total, 0))
        out.write(digest.digest())
        return DumpSummary(cf.name, layout.subfilters, items, total, digest.hexdigest())
    finally:
        if snaps:
            redis.delete(*snaps)


# -- import ---------------------------------------------------------------------------------


class _Reader:
    """Reads exactly the bytes asked for, hashing them; a short read is a truncated dump."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f = f
        self.digest = hashlib.sha256()

    def read(self, n: int, what: str) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise DumpError(f"truncated dump: file ends inside {what}")
        self.digest.update(data)
        return data


def _chunks(f: IO[bytes], header_out: list[DumpHeader]) -> Iterator[tuple[int, int, bytes]]:
    """Parse a dump, yielding (sub-filter, offset, data); check everything on the way.

    The checksum is only known at the end, so callers that write must run this once to the
    end first (``validate_dump``) and then again to write.
    """
    r = _Reader(f)
    magic, version, hlen = _PREAMBLE.unpack(r.read(_PREAMBLE.size, "the preamble"))
    if magic != MAGIC:
        raise DumpError("not a cuckoo-guard dump (bad magic)")
    if version != VERSION:
        raise DumpError(f"dump version {version} is not supported (this reads {VERSION})")
    if not 2 <= hlen <= MAX_HEADER_BYTES:
        raise DumpError(f"bad dump header length {hlen}")
    header = DumpHeader.from_json(r.read(hlen, "the header"))
    header_out.append(header)
    sub, pos, total = 0, 0, 0
    while True:
        n, offset, size = _CHUNK.unpack(r.read(_CHUNK.size, "a chunk header"))
        if n == _END_SUB:
            if sub != len(header.lengths) or offset != total or size != 0:
                raise DumpError("truncated dump: sub-filters missing before the end marker")
            break
        if sub >= len(header.lengths) or n != sub or offset != pos:
            raise DumpError(f"bad chunk order at sub-filter {n} offset {offset}")
        if not 1 <= size <= min(MAX_CHUNK_BYTES, header.lengths[sub] - pos):
            raise DumpError(f"bad chunk length {size} at sub-filter {n} offset {offset}")
        data = r.read(size, f"sub-filter {n}")
        yield n, offset, data
        pos += size
        total += size
        if pos == header.lengths[sub]:
            sub, pos = sub + 1, 0
    expected = r.digest.digest()
    stored = f.read(_DIGEST)
    if len(stored) != _DIGEST:
        raise DumpError("truncated dump: checksum missing")
    if f.read(1):
        raise DumpError("corrupt dump: bytes after the checksum")
    if stored != expected:
        raise DumpError("corrupt dump: SHA-256 checksum mismatch")


def validate_dump(path: str | Path) -> DumpHeader:
    """Check a dump file completely (checksum, lengths, sub-filter headers); write nothing."""
    found: list[DumpHeader] = []
    head0 = b""
    tags: dict[int, bytes] = {}
    with open(path, "rb") as f:
        for n, offset, data in _chunks(f, found):
            header = found[0]
            end = offset + len(data)
            if offset < HEADER_BYTES:  # collect the header of each sub-filter
                piece = data[: HEADER_BYTES - offset]
                if n == 0:
                    head0 += piece
                if offset == 0 and (piece[:4] != FILTER_MAGIC.to_bytes(4, "big")):
                    raise DumpError(f"corrupt dump: sub-filter {n} has no filter header")
                if offset <= INDEX_AT < end and data[INDEX_AT - offset] != n:
                    raise DumpError(f"corrupt dump: sub-filter {n} has the index of another")
            tag_at = header.lengths[n] - TAG_BYTES
            if end > tag_at:  # the tag may span chunks
                tags[n] = tags.get(n, b"") + data[max(0, tag_at - offset) :]
    header = found[0]
    try:
        layout, capacity, _ = _parse_header(head0)
    except FilterNotFoundError:
        raise DumpError("corrupt dump: sub-filter 0 has no filter header") from None
    if layout != header.layout or capacity != header.capacity:
        raise DumpError("corrupt dump: the stored filter header disagrees with the dump header")
    for n in range(layout.subfilters):
        if tags.get(n) != layout.tag(n):
            raise DumpError(f"corrupt dump: sub-filter {n} does not end in its tag")
    return header


def import_filter(cf: SyncCuckooFilter, path: str | Path, *, progress: Any = None) -> DumpHeader:
    """Replace ``cf`` (or create it) with the filter in the dump at ``path``.

    Nothing is written unless the whole file checks out; the live filter changes only at the
    final atomic promote.
    """
    header = validate_dump(path)
    staging = cf.staging()
    redis = cf.redis
    staging.drop()  # a crashed import or rebuild may have left a staging copy
    try:
        pipe = redis.pipeline(transaction=False)
        for n, length in enumerate(header.lengths):
            # One allocation at full size (zero-filled), then the chunks overwrite it.
            pipe.setrange(staging.key(n), length - 1, b"\x00")
        pipe.execute()
        found: list[DumpHeader] = []
        with open(path, "rb") as f:
            pipe = redis.pipeline(transaction=False)
            queued = 0
            for n, offset, data in _chunks(f, found):
                pipe.setrange(staging.key(n), offset, data)
                queued += 1
                if progress:
                    progress(len(data))
                if queued >= PIPELINE_CHUNKS:
                    pipe.execute()
                    pipe, queued = redis.pipeline(transaction=False), 0
            pipe.execute()  # the file re-checked to its checksum before this last write
        _verify(staging, header)
        staging.promote()
    except BaseException:
        staging.drop()
        raise
    return header


def _verify(staging: SyncCuckooFilter, header: DumpHeader) -> None:
    lengths = [int(staging.redis.strlen(staging.key(n))) for n in range(len(header.lengths))]
    if lengths != header.lengths:
        raise DumpError(f"restored copy has lengths {lengths}, expected {header.lengths}")
    # The scripts check magic, layout and every sub-filter's tag, as validate_dump did.
    info = staging.info()
    if info.items != header.items:
        raise DumpError(f"restored copy holds {info.items} items, the dump {header.items}")


__all__ = [
    "DumpError",
    "DumpHeader",
    "DumpSummary",
    "export_filter",
    "import_filter",
    "validate_dump",
]
