"""Export a filter to a file in chunks, and restore one, checked end to end, by atomic swap.

The file (all integers big-endian)::

    b"CKGDUMP\\0"  u16 version  u32 n  <n bytes of JSON header>
    chunk*:     u16 string      u64 offset  u32 length  <length bytes>
    end:        u16 0xFFFF      u64 total bytes of all chunks  u32 0
    SHA-256 of everything above (32 bytes)

The JSON header names the filter and gives its layout, the byte length of every sub-filter
string, the item count and the capacity; a chunk's string is the sub-filter it belongs to.
A sharded filter's header has instead ``shards``: those four for each shard in order, and its
chunks number the strings across shards (shard 0's sub-filters first).

Export and import are operations like the others (guard/ops.py): ``export_filter`` and
``import_filter`` run them on any handle, blocking or asyncio, plain or sharded (an asyncio
handle returns a coroutine; the file is read and written in a worker thread).

Export reads a snapshot: per shard, one MULTI COPYs every sub-filter key to snapshot keys under
the same hash tag (a memory copy: writers wait microseconds), with a TTL in case the export
dies. The snapshot is a filter under other keys: the probe checks it as it checks any filter
(guard/filter.py: not found, corrupt, verified) before a byte is written, then its strings are
read in GETRANGE chunks, then it is deleted. A read-only replica refuses COPY: there the probe
reads the live keys, then every chunk is read in one MULTI with the probe's reads again (a
replica changes only by replication, so one transaction sees one instant).

Import checks the whole file first (checksum, lengths, offsets, every string as the probe
checks it) and writes nothing unless it all checks out; then it fills the filter's staging copy
and promotes it as a bulk build does (guard/bulk.py: staged_op): a refused or failed import
leaves the live filter as it was.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import struct
from collections.abc import Coroutine, Iterator
from contextlib import suppress
from dataclasses import asdict, dataclass
from functools import partial
from itertools import islice
from pathlib import Path
from typing import IO, Any, BinaryIO, NamedTuple, overload

from redis.exceptions import ReadOnlyError

from guard.bulk import staged_op
from guard.errors import (
    FilterCorruptError,
    FilterNotFoundError,
    GuardError,
    InvalidParameterError,
)
from guard.facade import AsyncHandle, SyncHandle
from guard.filter import FilterOps
from guard.handle import FilterHandle
from guard.layout import (
    HEADER_BYTES,
    MAX_SHARDS,
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
from guard.ops import Call, Command, Op, Round, Work, lockstep, raise_first

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
class DumpPart:
    """The strings of one filter in a dump: the whole filter, or one shard of a sharded one."""

    layout: Layout
    lengths: list[int]
    items: int
    capacity: int

    def as_json(self) -> dict[str, Any]:
        return {"capacity": self.capacity, "items": self.items, "layout": asdict(self.layout),
                "lengths": self.lengths}  # fmt: skip

    @classmethod
    def read(cls, stored: list[Stored]) -> DumpPart:
        """The part whose strings the probe read (each sub-filter counts its own items)."""
        headers = [unpack_header(s.header) for s in stored]
        items = sum(h.items for h in headers)
        return cls(headers[0].layout, [s.length for s in stored], items, headers[0].capacity)

    @classmethod
    def from_json(cls, body: Any) -> DumpPart:
        """The part, once its lengths are the ones its layout makes."""
        layout = Layout(**{k: int(v) for k, v in body["layout"].items()})
        lengths = [int(n) for n in body["lengths"]]
        if not 1 <= layout.subfilters <= MAX_SUBFILTERS:
            raise DumpError(f"bad dump header: {layout.subfilters} sub-filters")
        if lengths != [layout.string_bytes(n) for n in range(layout.subfilters)]:
            raise DumpError(f"bad dump header: lengths {lengths} are not those of its layout")
        if any(n > MAX_STRING_BYTES for n in lengths):
            raise DumpError("bad dump header: a sub-filter is larger than a Redis string")
        return cls(layout, lengths, int(body["items"]), int(body["capacity"]))


@dataclass(frozen=True)
class DumpHeader:
    """What a dump holds: ``parts``, one filter's strings, or each shard's in order when
    ``sharded``."""

    name: str
    parts: tuple[DumpPart, ...]
    sharded: bool = False

    @property
    def layout(self) -> Layout:
        """The filter's layout (a sharded filter's first shard's)."""
        return self.parts[0].layout

    @property
    def lengths(self) -> list[int]:
        """Every string's length, in the file's order."""
        return [n for part in self.parts for n in part.lengths]

    @property
    def items(self) -> int:
        return sum(part.items for part in self.parts)

    @property
    def capacity(self) -> int:
        """The capacity the headers record (a sharded filter's shards', summed)."""
        return sum(part.capacity for part in self.parts)

    def to_json(self) -> bytes:
        head = {"format": FORMAT_VERSION, "name": self.name}
        if self.sharded:
            head["shards"] = [part.as_json() for part in self.parts]
        else:
            head |= self.parts[0].as_json()
        return json.dumps(head, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> DumpHeader:
        """The header, once each part's lengths are the ones its layout makes."""
        try:
            body = json.loads(raw)
            name, version = str(body["name"]), int(body["format"])
            if version != FORMAT_VERSION:
                raise DumpError(f"filter format version {version} is not supported")
            sharded = "shards" in body
            shards = body["shards"] if sharded else [body]
            if not 1 <= len(shards) <= MAX_SHARDS:
                raise DumpError(f"bad dump header: {len(shards)} shards")
            return cls(name, tuple(DumpPart.from_json(part) for part in shards), sharded)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise DumpError(f"bad dump header: {exc!r}") from None


@dataclass(frozen=True)
class DumpSummary:
    name: str
    subfilters: int  # sub-filter strings (of every shard)
    items: int
    bytes: int  # filter bytes (the file is slightly larger)
    sha256: str
    shards: int = 0  # 0: not sharded


def _shards_problem(firsts: list[bytes], sharded: bool) -> str | None:
    """What is wrong with a sharded filter whose shards' sub-filter 0 headers (each verified)
    are ``firsts``, or None: they must record their number and one seed, as a sharded handle
    checks when it opens the filter."""
    if not sharded:
        return None
    headers = [unpack_header(first) for first in firsts]
    if any(h.shards != len(firsts) for h in headers):
        return f"a shard's header does not record {len(firsts)} shards"
    if len({h.layout.seed for h in headers}) > 1:
        return "the shards have different seeds"
    return None


# -- export ---------------------------------------------------------------------------------


class _Source(NamedTuple):
    """One filter part's strings, verified: where to read them, or (a replica's) read."""

    stored: list[Stored]  # the probe's reads, under the live keys
    keys: list[str]  # the snapshot's keys, or the live ones on a replica
    chunks: list[bytes] | None = None  # a replica's chunks, read with the probe's reads


def _ranges(lengths: list[int], chunk_bytes: int) -> list[tuple[int, int, int]]:
    """(sub-filter, offset, size) of every chunk, in file order."""
    return [
        (n, start, min(chunk_bytes, length - start))
        for n, length in enumerate(lengths)
        for start in range(0, length, chunk_bytes)
    ]


def _snapshot_keys(part: FilterOps, token: str) -> list[str]:
    return [f"{part.key(0)}:dump:{token}" + (f":{n}" if n else "") for n in range(MAX_SUBFILTERS)]


def _replica_op(part: FilterOps, chunk_bytes: int) -> Op[_Source]:
    """On a read-only replica: the live keys verified, then every chunk read in one MULTI with
    the probe's reads again (a replica changes only by replication)."""
    stored = yield from part._probe_op()
    ranges = _ranges([s.length for s in stored], chunk_bytes)
    reads: list[Call | Command] = [Command(*read) for s in stored for read in probe_reads(s.key)]
    reads += [Command("GETRANGE", [stored[n].key, at, at + size - 1]) for n, at, size in ranges]
    replies = yield Round(reads, atomic=True)
    if [Stored(s.key, *replies[3 * n : 3 * n + 3]) for n, s in enumerate(stored)] != stored:
        raise GuardError(f"{part.name}: the filter changed while reading it; try again")
    return _Source(stored, [s.key for s in stored], replies[3 * len(stored) :])


def _snapshot_op(part: FilterOps, token: str, chunk_bytes: int) -> Op[_Source]:
    """Copy ``part``'s keys to snapshot keys in one transaction and verify the copy."""
    snaps = _snapshot_keys(part, token)
    copy: list[Any] = []
    for n, snap in enumerate(snaps):
        copy += [Command("COPY", [part.key(n), snap]), Command("PEXPIRE", [snap, SNAPSHOT_TTL_MS])]
    try:
        yield Round(copy, atomic=True)
    except ReadOnlyError:
        return (yield from _replica_op(part, chunk_bytes))
    # The snapshot is a filter under other keys (a handle of its own on them, as staging() is):
    # the probe's verdict on it is the live filter's at the copy, its messages name live keys.
    snapshot = part.staging()
    snapshot._base = snaps[0]
    try:
        stored = yield from snapshot._probe_op()
    except FilterCorruptError as exc:
        raise FilterCorruptError(part.name, exc.reason.replace(f":dump:{token}", "")) from None
    live = [s._replace(key=part.key(n)) for n, s in enumerate(stored)]
    return _Source(live, snaps[: len(stored)])


def export_op(
    handle: FilterHandle[Any], out: BinaryIO, chunk_bytes: int = CHUNK_BYTES, progress: Any = None
) -> Op[DumpSummary]:
    """Write the filter of ``handle`` (any handle: guard/handle.py) to ``out`` from a
    consistent snapshot (per shard, for a sharded one). ``progress(nbytes)`` per chunk."""
    if not 1 <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be 1-{MAX_CHUNK_BYTES}")
    target = handle._bulk_target(0, 0)  # the filters that hold the items: its shards, or it
    token = secrets.token_hex(8)
    # Every snapshot key, made or not; a TTL covers an export that dies before this.
    drop = Round([Command("DEL", _snapshot_keys(part, token)) for part in target.parts])
    try:
        found = yield from lockstep(
            {i: _snapshot_op(part, token, chunk_bytes) for i, part in enumerate(target.parts)}
        )
        sources: list[_Source] = [found[i] for i in range(len(found))]
        gone = [i for i, src in enumerate(sources) if isinstance(src, FilterNotFoundError)]
        if 0 < len(gone) < len(sources):  # what is left of a filter is no filter: damage
            raise FilterCorruptError(handle.name, f"shard(s) {gone} missing")
        raise_first(sources)
        summary = yield from _write_op(
            handle.name, sources, target.shards, out, chunk_bytes, progress
        )
    except Exception:
        with suppress(Exception):  # a failure here must not hide the one being raised
            yield drop
        raise
    if any(src.chunks is None for src in sources):  # a replica made no snapshot (nor can)
        yield drop
    return summary


def _write_op(
    name: str, sources: list[_Source], shards: int, out: BinaryIO, chunk_bytes: int, progress: Any
) -> Op[DumpSummary]:
    """The dump of the filter whose parts ``sources`` read, written to ``out``."""
    sharded = shards > 0
    if problem := _shards_problem([src.stored[0].header for src in sources], sharded):
        raise FilterCorruptError(name, problem)
    header = DumpHeader(name, tuple(DumpPart.read(src.stored) for src in sources), sharded)
    digest = hashlib.sha256()

    def write(pieces: list[bytes]) -> None:
        for data in pieces:
            digest.update(data)
            out.write(data)

    raw_header = header.to_json()
    yield Work(partial(write, [_PREAMBLE.pack(MAGIC, VERSION, len(raw_header)), raw_header]))
    string = 0  # the file's numbering of strings, across shards
    for src in sources:
        ranges = _ranges([s.length for s in src.stored], chunk_bytes)
        for i in range(0, len(ranges), PIPELINE_CHUNKS):
            batch = ranges[i : i + PIPELINE_CHUNKS]
            if src.chunks is not None:
                chunks = src.chunks[i : i + PIPELINE_CHUNKS]
            else:
                chunks = yield Round([Command("GETRANGE", [src.keys[n], at, at + size - 1])
                                      for n, at, size in batch])  # fmt: skip
            pieces = []
            for (n, at, size), data in zip(batch, chunks, strict=True):
                if len(data) != size:
                    raise GuardError(f"{name}: snapshot changed while reading it")
                pieces += [_CHUNK.pack(string + n, at, size), data]
            yield Work(partial(write, pieces))
            if progress:
                for _, _, size in batch:
                    progress(size)
        string += len(src.stored)
    total = sum(header.lengths)
    yield Work(partial(write, [_CHUNK.pack(_END_SUB, total, 0)]))
    yield Work(partial(out.write, digest.digest()))
    return DumpSummary(
        name, string, header.items, total, digest.hexdigest(), len(sources) if sharded else 0
    )


# -- import ---------------------------------------------------------------------------------


def _chunks(f: IO[bytes], header_out: list[DumpHeader]) -> Iterator[tuple[int, int, bytes]]:
    """Parse a dump into ``header_out`` and (string, offset, data), checking everything on
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
    lengths = header.lengths
    sub, pos = 0, 0
    while True:
        n, offset, size = _CHUNK.unpack(read(_CHUNK.size, "a chunk header"))
        if n == _END_SUB:
            if sub != len(lengths) or offset != sum(lengths) or size != 0:
                raise DumpError("truncated dump: sub-filters missing before the end marker")
            break
        if sub >= len(lengths) or n != sub or offset != pos:
            raise DumpError(f"bad chunk order at sub-filter {n} offset {offset}")
        if not 1 <= size <= min(MAX_CHUNK_BYTES, lengths[sub] - pos):
            raise DumpError(f"bad chunk length {size} at sub-filter {n} offset {offset}")
        yield n, offset, read(size, f"sub-filter {n}")
        pos += size
        if pos == lengths[sub]:
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
    string = 0
    firsts: list[bytes] = []
    for part in header.parts:
        stored = [Stored(f"sub-filter {string + n}", heads[string + n], length, tags[string + n])
                  for n, length in enumerate(part.lengths)]  # fmt: skip
        try:
            layout = verify_stored(header.name, stored)
        except FilterCorruptError as exc:
            raise DumpError(f"corrupt dump: {exc.reason}") from None
        if layout != part.layout or unpack_header(stored[0].header).capacity != part.capacity:
            raise DumpError("corrupt dump: the stored filter header disagrees with the dump header")
        firsts.append(stored[0].header)
        string += len(stored)
    if problem := _shards_problem(firsts, header.sharded):
        raise DumpError(f"corrupt dump: {problem}")
    return header


def import_op(handle: FilterHandle[Any], path: str | Path, progress: Any = None) -> Op[DumpHeader]:
    """Replace the filter of ``handle`` (or create it) with the one in the dump at ``path``:
    nothing is written unless the whole file checks out; the live filter changes only at
    the promote."""
    header = yield Work(partial(validate_dump, path))
    stage = handle.staging()
    target = stage._bulk_target(0, 0)
    shards = len(header.parts) if header.sharded else 0
    if target.shards != shards:
        held = f"a filter of {shards} shards" if shards else "an unsharded filter"
        raise InvalidParameterError(
            f"{handle.name}: the dump holds {held}; open it with shards={shards or None}",
            param="shards",
            value=target.shards or None,
            filter=handle.name,
        )
    keys = [part.key(n) for part, dumped in zip(target.parts, header.parts, strict=True)
            for n in range(dumped.layout.subfilters)]  # fmt: skip
    tags = [
        dumped.layout.tag(n) for dumped in header.parts for n in range(dumped.layout.subfilters)
    ]

    def fill() -> Op[None]:
        # Each string made at its full length by writing its tag (as reserve.lua does), then
        # its table; the headers last, sub-filter 0's last of all, so that no string passes
        # the layout check before it is whole (as guard/bulk.py: upload_op writes).
        sizes = zip(keys, header.lengths, tags, strict=True)
        yield Round(
            [Command("SETRANGE", [key, length - TAG_BYTES, tag]) for key, length, tag in sizes]
        )
        heads = [b""] * len(keys)
        f = yield Work(partial(open, path, "rb"))
        try:
            chunks = _chunks(f, [])  # read again, to its checksum, before the last write
            while batch := (yield Work(partial(list, islice(chunks, PIPELINE_CHUNKS)))):
                writes: list[Call | Command] = []
                for n, at, data in batch:
                    if at < HEADER_BYTES:
                        heads[n] += data[: HEADER_BYTES - at]
                        data, at = data[HEADER_BYTES - at :], HEADER_BYTES
                    if data:
                        writes.append(Command("SETRANGE", [keys[n], at, data]))
                if writes:
                    yield Round(writes)
                if progress:
                    for _, _, data in batch:
                        progress(len(data))
        finally:
            f.close()
        yield Round(
            [Command("SETRANGE", [keys[n], 0, heads[n]]) for n in reversed(range(len(keys)))]
        )
        # The probe verifies every string (length, header, tag), as validate_dump did.
        items = (yield from stage._info_op()).items
        if items != header.items:
            raise DumpError(f"restored copy holds {items} items, the dump {header.items}")

    yield from staged_op(handle, stage, fill(), promote=True, only_if_new=False)
    return header


# -- on a handle ----------------------------------------------------------------------------


@overload
def export_filter(
    cf: SyncHandle[Any], out: BinaryIO, *, chunk_bytes: int = ..., progress: Any = ...
) -> DumpSummary: ...
@overload
def export_filter(
    cf: AsyncHandle[Any], out: BinaryIO, *, chunk_bytes: int = ..., progress: Any = ...
) -> Coroutine[Any, Any, DumpSummary]: ...
def export_filter(
    cf: Any, out: BinaryIO, *, chunk_bytes: int = CHUNK_BYTES, progress: Any = None
) -> Any:
    """Write ``cf``'s filter to ``out`` (export_op); on an asyncio handle, a coroutine."""
    return cf._run(export_op(cf, out, chunk_bytes, progress))


@overload
def import_filter(cf: SyncHandle[Any], path: str | Path, *, progress: Any = ...) -> DumpHeader: ...
@overload
def import_filter(
    cf: AsyncHandle[Any], path: str | Path, *, progress: Any = ...
) -> Coroutine[Any, Any, DumpHeader]: ...
def import_filter(cf: Any, path: str | Path, *, progress: Any = None) -> Any:
    """Restore ``cf``'s filter from the dump at ``path`` (import_op); on an asyncio handle,
    a coroutine."""
    return cf._run(import_op(cf, path, progress))


__all__ = [
    "DumpError",
    "DumpHeader",
    "DumpPart",
    "DumpSummary",
    "export_filter",
    "export_op",
    "import_filter",
    "import_op",
    "validate_dump",
]
