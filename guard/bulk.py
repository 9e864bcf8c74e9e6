"""Bulk builds: a filter made whole in memory with numpy, uploaded as its staging copy, promoted.

A filter being *made* (a load into a new filter, a rebuild) needs none of the atomicity that
costs Redis 15-60 µs of CPU per item a script inserts. The builder keeps only each item's hash
(12 bytes: ``h``, ``g``), places the items with whole-array operations, packs the sub-filter
strings (docs/format.md) and writes them under the staging keys for promote to swap in.
Placement, per sub-filter, on a table of item numbers:

1. **first choice**: each item claims a slot in its primary bucket, one per bucket per pass
   (a scatter whose surviving write wins), up to ``b`` passes;
2. **second choice**: the rest, in their alternate bucket the same way;
3. **kick rounds**: the homeless walk as the scripts' kick chains do, all at once: each takes a
   free slot of its current bucket, else a random one, whose item moves on to its other bucket
   (placed items never leave their two buckets; the homeless are held, never lost);
4. **search**: the few a walk leaves (at most SEARCH_ITEMS), one by one along the shortest
   chain of moves ending in a free slot of any sub-filter so far (lookups read them all). As in
   Kuhn's matching algorithm, a search within its budget misses no chain: the build fits every
   item whenever any arrangement in as many sub-filters does.

The rest go to the next sub-filter of a growing filter, as insert.lua grows it; one that
cannot grow raises FilterFullError before anything is written, as the scripts would (rare, with
guard/layout.py:buckets_for's margin). Promote refuses a staging copy that is not whole
(upload_op) or, when the build creates the filter, a live filter made meanwhile; any failure
leaves the live filter untouched and deletes the staging copy.

numpy is imported by the functions that use it, when first called: the library's lookups import
this module (a filter's handle can load), and one item's lookup never waits for numpy.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable
from contextlib import suppress
from dataclasses import replace
from functools import partial
from itertools import chain, islice
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from guard import hashing
from guard.errors import FilterExistsError, FilterFullError, InvalidParameterError
from guard.handle import FilterHandle, Target
from guard.layout import (
    COMMON_BYTES,
    HEADER_BYTES,
    INDEX_AT,
    ITEMS_AT,
    MAX_FP_BITS,
    MAX_STRING_BYTES,
    MAX_SUBFILTERS,
    SUBFILTERS_AT,
    TAG_BYTES,
    Layout,
    pack_header,
)
from guard.ops import Call, Command, Op, Round, Work
from guard.params import FilterParams

if TYPE_CHECKING:
    import numpy as np

InfoT = TypeVar("InfoT")  # what the handle's info() answers

CHUNK_ITEMS = 1 << 16  # items hashed per step: the only Python objects held at once
PACK_SLOTS = 1 << 20  # slots packed at once (a multiple of 8: every slice ends on a byte)
UPLOAD_BYTES = 4 << 20  # bytes per SETRANGE: no command is huge, however large the filter
PIPELINE_BYTES = 32 << 20  # SETRANGE payload sent per round trip
PATIENCE = 64  # kick rounds stop when this many placed under 1 % of the homeless (or none)
MAX_ROUNDS = 4000  # and in any case after this many
SEARCH_ITEMS = 1024  # a walk's leftovers are searched for (in Python) when at most this many
SEARCH_BUDGET = 1 << 18  # buckets a sub-filter's searches visit (a second): overfull fails fast

# str/bytes items or batches of them (lists, tuples: a database cursor's); async on asyncio.
Items = Iterable[Any] | AsyncIterable[Any]


class HashSink:
    """The input reduced to what placement needs: per shard, ``h`` (int64) and ``g`` (uint32)
    of every item, in input order."""

    def __init__(self, seed: int, shards: int = 1) -> None:
        self.seed, self.shards, self.count = seed, shards, 0
        self._h: list[list[np.ndarray]] = [[] for _ in range(shards)]
        self._g: list[list[np.ndarray]] = [[] for _ in range(shards)]

    def add_all(self, items: Iterable[Any]) -> None:
        """Every item of ``items``, or of its batches (the first says which), CHUNK_ITEMS at a
        time; batches are flattened in C, and no item is looked at in Python."""
        it = iter(items)
        first = list(islice(it, 1))  # [] when there is none
        it = chain(first, it)
        if first and isinstance(first[0], list | tuple):
            it = chain.from_iterable(it)
        while chunk := list(islice(it, CHUNK_ITEMS)):
            self.add(chunk)

    def add(self, chunk: list[Any]) -> None:
        import numpy as np

        rows = hashing.item_hashes(chunk, self.seed, self.shards if self.shards > 1 else 0)
        self.count += len(chunk)
        parts: list[Any] = [slice(None)]
        if self.shards > 1:  # each shard's rows, in input order
            order = np.argsort(rows[:, 2], kind="stable")
            parts = np.split(order, np.cumsum(np.bincount(rows[:, 2], minlength=self.shards)))
        for i in range(self.shards):
            self._h[i].append(rows[parts[i], 0].copy())  # a column's view would keep all rows
            self._g[i].append(rows[parts[i], 1].astype(np.uint32))

    def take(self, shard: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """One shard's (h, g) arrays, handed over: the sink forgets them."""
        import numpy as np

        h, g = [*self._h[shard], np.zeros(0, np.int64)], [*self._g[shard], np.zeros(0, np.uint32)]
        self._h[shard], self._g[shard] = [], []
        return np.concatenate(h), np.concatenate(g)


async def _achunks(items: AsyncIterable[Any]) -> AsyncIterator[list[Any]]:
    """An async iterable's items, or its batches' items, in lists of CHUNK_ITEMS or so."""
    pending: list[Any] = []
    async for x in items:
        pending += x if isinstance(x, list | tuple) else (x,)
        if len(pending) >= CHUNK_ITEMS:
            yield pending
            pending = []
    yield pending


# -- the build: placement and packing -------------------------------------------------------


class _Table:
    """One sub-filter being filled: in every slot, the number of the item it holds (its place
    in the input; -1: empty). ``fill[i]`` counts bucket i's slots taken, always its first ones.
    Bucket and slot numbers (so i1 + i2) fit int32: a 512 MB string has under 2**30 slots."""

    def __init__(self, buckets: int, bucket_size: int, dtype: Any) -> None:
        import numpy as np

        self.m, self.b, self.items = buckets, bucket_size, 0
        self.owner = np.full(buckets * bucket_size, -1, dtype=dtype)
        self.fill = np.zeros(buckets, dtype=np.int8)
        self._claims = np.empty(buckets, dtype=dtype)

    def _won(self, ids: np.ndarray, bucket: np.ndarray) -> np.ndarray:
        """Which items won their bucket: the one whose number survived the scatter (any one)."""
        self._claims[bucket] = ids
        return self._claims[bucket] == ids

    def claim(self, ids: np.ndarray, bucket: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Put each item ``ids[k]`` in a free slot of ``bucket[k]``, a pass giving each bucket at
        most one; returns the items whose bucket is full, and their buckets."""
        import numpy as np

        b, full_ids, full_buckets = self.b, [], []
        if not self.items:
            # Faster on an empty table: pass p's winners all take slot p (their buckets won
            # once in each earlier pass), and after b passes every bucket wanted is full.
            for p in range(b):
                won = self._won(ids, bucket)
                self.owner[bucket[won] * b + p] = ids[won]
                ids, bucket = ids[~won], bucket[~won]
            self.fill[:] = (self.owner.reshape(-1, b) >= 0).sum(axis=1, dtype=np.int8)
            self.items = int(self.fill.sum())
            return ids, bucket
        while len(ids):
            is_open = self.fill[bucket] < b
            if not is_open.all():
                full_ids.append(ids[~is_open])
                full_buckets.append(bucket[~is_open])
                ids, bucket = ids[is_open], bucket[is_open]
            won = self._won(ids, bucket)
            at = bucket[won]
            self.owner[at * b + self.fill[at]] = ids[won]
            self.fill[at] += 1
            self.items += len(at)
            ids, bucket = ids[~won], bucket[~won]
        return np.concatenate([*full_ids, ids]), np.concatenate([*full_buckets, bucket])

    def place(
        self, ids: np.ndarray, i1: np.ndarray, i2: np.ndarray, rng: np.random.Generator
    ) -> np.ndarray:
        """Place the items ``ids`` (ascending; ``ids[k]``'s buckets are ``i1[k]``, ``i2[k]``):
        first choices, second choices, then kick rounds. Returns those left homeless."""
        import numpy as np

        index: Callable[[np.ndarray], Any] = np.asarray  # where items are in ids
        if not (len(ids) and ids[-1] == len(ids) - 1):  # else 0..n-1: an item is its index
            index = partial(np.searchsorted, ids)
        homeless, _ = self.claim(ids, i1)
        homeless, _ = self.claim(homeless, i2[index(homeless)])
        # No more walkers than free slots: the others have no slot to reach in this table.
        free = self.m * self.b - self.items
        ids, aside = homeless[:free], homeless[free:]
        k = index(ids)
        at = np.where(rng.random(len(ids)) < 0.5, i1[k], i2[k])
        window = len(ids)  # homeless at the start of the current PATIENCE rounds
        for rounds in range(1, MAX_ROUNDS + 1):
            ids, at = self.claim(ids, at)  # a free slot in the current bucket, if one is left
            if not len(ids):
                break
            # One walker per bucket takes a random slot of it; its victim moves to its other
            # bucket, and the losers try their own other bucket next.
            won = self._won(ids, at)
            pos = at[won] * self.b + rng.integers(0, self.b, int(won.sum()), dtype=at.dtype)
            victims = self.owner[pos]
            self.owner[pos] = ids[won]
            lost = ids[~won]
            kv, kl = index(victims), index(lost)
            ids = np.concatenate([victims, lost])
            at = np.concatenate([i1[kv] + i2[kv] - at[won], i1[kl] + i2[kl] - at[~won]])
            if rounds % PATIENCE == 0:
                if window - len(ids) < max(1, window // 100):
                    break  # as full as walking gets it: the rest go to the next sub-filter
                window = len(ids)
        return np.concatenate([ids, aside])

    def pack(self, n: int, header0: bytearray, layout: Layout, g: np.ndarray) -> bytearray:
        """The table as sub-filter n's whole string: sub-filter 0's header as growth copies it
        (its first COMMON_BYTES; index n, its own item count), the slots packed a slice at a
        time (only a slice's fingerprints exist at once), the tag."""
        import numpy as np

        out = bytearray(layout.string_bytes(n))
        shared = COMMON_BYTES if n else HEADER_BYTES
        out[:shared] = header0[:shared]
        if n:
            out[SUBFILTERS_AT] = out[INDEX_AT] = n
        out[ITEMS_AT : ITEMS_AT + 8] = self.items.to_bytes(8, "big", signed=True)
        f = layout.fp_bits_at(n)
        for start in range(0, len(self.owner) if self.items else 0, PACK_SLOTS):
            owner = self.owner[start : start + PACK_SLOTS]
            packed = pack_slots(np.where(owner >= 0, hashing.fingerprint(g[owner], f), 0), f)
            at = HEADER_BYTES + start * f // 8  # a slice of PACK_SLOTS ends on a byte
            out[at : at + len(packed)] = packed
        out[-TAG_BYTES:] = layout.tag(n)
        return out


class _Placement:
    """One build's items (``h``, fixed ``g``), placed into sub-filters as insert.lua adds them."""

    def __init__(self, h: np.ndarray, g: np.ndarray, layout: Layout) -> None:
        import numpy as np

        self.h, self.g, self.layout, self.tables = h, g, layout, list[_Table]()
        self.dtype = np.int32 if len(h) < 2**31 else np.int64  # of item numbers
        self._rng = np.random.default_rng([layout.seed, len(h)])  # a build is reproducible
        self._budget = 0  # buckets the searches may still visit

    def add_subfilter(self, ids: np.ndarray) -> np.ndarray:
        """Add the next sub-filter and place the items ``ids`` (ascending) in it, then search
        every sub-filter for the few a walk leaves. Returns those still homeless."""
        import numpy as np

        m = self.layout.buckets(len(self.tables))
        table = _Table(m, self.layout.bucket_size, self.dtype)
        self.tables.append(table)
        homeless = table.place(ids, *self._buckets(ids, m), self._rng)
        if 0 < len(homeless) <= SEARCH_ITEMS:
            self._budget = SEARCH_BUDGET
            left = [x for x in homeless.tolist() if not self._search(x)]
            homeless = np.array(left, dtype=self.dtype)
        return np.sort(homeless)

    def _buckets(self, ids: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray]:
        """Both buckets (int32) of the items ``ids`` in a sub-filter of m buckets, a slice at a
        time (small int64 temporaries); ``mix`` of each f0-bit prefix looked up in a table of all
        when no larger than the items: four modulos cost more than a look-up in cache."""
        import numpy as np

        f0 = self.layout.fp_bits
        few = 1 << f0 <= max(1 << 16, len(ids))
        table = hashing.mix(np.arange(1 << f0, dtype=np.int64)) if few else None
        i1, i2 = np.empty(len(ids), np.int32), np.empty(len(ids), np.int32)
        for a in range(0, len(ids), CHUNK_ITEMS * 16):
            part = slice(a, a + CHUNK_ITEMS * 16)
            pick = ids[part]
            prefix = self.g[pick] >> np.uint32(32 - f0)  # hashing.fingerprint inline: in place
            mixed = table[prefix] if table is not None else hashing.mix(prefix.astype(np.int64))
            i1[part], i2[part] = hashing.buckets(self.h[pick], mixed, m)
        return i1, i2

    def _nodes(self, item: int) -> list[tuple[int, int]]:
        """Every (sub-filter, bucket) the item may sit in."""
        h = int(self.h[item])
        mixed = hashing.mix(hashing.fingerprint(int(self.g[item]), self.layout.fp_bits))
        out = []
        for n, table in enumerate(self.tables):
            i1, i2 = hashing.buckets(h, mixed, table.m)
            out += [(n, i1), (n, i2)] if i2 != i1 else [(n, i1)]
        return out

    def _search(self, item: int) -> bool:
        """Place ``item`` if a breadth-first search finds its chain in budget (module docstring)."""
        came: dict[tuple[int, int], tuple[tuple[int, int], int] | None]
        came = dict.fromkeys(self._nodes(item))
        queue = deque(came)
        tables, b = self.tables, self.layout.bucket_size
        while queue and self._budget > 0:
            self._budget -= 1
            n, i = node = queue.popleft()
            if tables[n].fill[i] < b:
                slot = int(tables[n].fill[i])
                tables[n].fill[i] += 1
                tables[n].items += 1
                step = came[node]
                while step is not None:  # each item on the chain moves on, the last first
                    (pn, pi), ps = step
                    tables[n].owner[i * b + slot] = tables[pn].owner[pi * b + ps]
                    n, i, slot, step = pn, pi, ps, came[pn, pi]
                tables[n].owner[i * b + slot] = item
                return True
            for s in range(b):
                for nxt in self._nodes(int(tables[n].owner[i * b + s])):
                    if nxt not in came:
                        came[nxt] = (node, s)
                        queue.append(nxt)
        return False


def pack_slots(values: np.ndarray, fp_bits: int) -> bytes:
    """Slots as docs/format.md lays them out: ``fp_bits``-bit unsigned big-endian integers,
    bit-packed from the first bit (what ``BITFIELD GET u<f>`` reads), zero bits at the end;
    each group of slots that ends on a byte is shifted into 64-bit words, whole arrays at once."""
    import numpy as np

    f = fp_bits
    if f in (8, 16, 32):
        return values.astype(f">u{f // 8}").tobytes()
    k = 8 // math.gcd(f, 8)  # slots per group; a group is k * f / 8 bytes
    words = (k * f + 63) // 64
    groups = -(-len(values) // k)
    flat = np.zeros(groups * k, dtype=np.uint64)
    flat[: len(values)] = values
    v = flat.reshape(groups, k)
    out = np.zeros((groups, words), dtype=np.uint64)
    for j in range(k):
        w, shift = j * f // 64, 64 - j * f % 64 - f  # the slot ends `shift` bits above word w's end
        if shift >= 0:
            out[:, w] |= v[:, j] << np.uint64(shift)
        else:  # the slot straddles words w and w + 1
            out[:, w] |= v[:, j] >> np.uint64(-shift)
            out[:, w + 1] |= v[:, j] << np.uint64(64 + shift)
    raw = out.astype(">u8").view(np.uint8).reshape(groups, words * 8)[:, : k * f // 8]
    return raw.tobytes()[: (len(values) * f + 7) // 8]


class BuiltFilter(NamedTuple):
    """A filter's sub-filter strings, ready to upload."""

    strings: list[bytes | bytearray]
    items: list[int]  # fingerprints stored per sub-filter


def _growth_problem(layout: Layout, n: int) -> str | None:
    """Why sub-filter n cannot be added, as insert.lua's grow() decides; None when it can."""
    if not layout.expansion:
        return "the filter has a fixed size (expansion 0)"
    if n >= MAX_SUBFILTERS:
        return f"it would need more than {MAX_SUBFILTERS} sub-filters"
    if layout.fp_step and layout.fp_bits + layout.fp_step * n > MAX_FP_BITS:
        return f"sub-filter {n} would need fingerprints over {MAX_FP_BITS} bits"
    if layout.string_bytes(n) > MAX_STRING_BYTES:
        return f"sub-filter {n} would be larger than a Redis string"
    return None


def build(h: np.ndarray, g: np.ndarray, layout: Layout, header: bytes, *, name: str) -> BuiltFilter:
    """Place the items whose hashes are ``h``, ``g`` (handed over, not lent: ``g`` is fixed in
    place) into a filter laid out as ``layout`` with sub-filter 0's ``header`` (both as
    reserve() makes them; it grows from there as the scripts would) and pack its strings.
    FilterFullError when the items do not fit a filter that may not grow further."""
    import numpy as np

    for a in range(0, len(g), CHUNK_ITEMS):  # in place, a slice at a time: temporaries in cache
        g[a : a + CHUNK_ITEMS] = hashing.fix_g(g[a : a + CHUNK_ITEMS], layout.fp_bits)
    placement = _Placement(h, g, layout)
    homeless = np.arange(len(h), dtype=placement.dtype)  # every item, for sub-filter 0
    while len(homeless := placement.add_subfilter(homeless)):
        if problem := _growth_problem(layout, len(placement.tables)):
            raise FilterFullError(
                f"filter {name!r} is full: {len(homeless):,} of {len(h):,} items do not fit "
                f"({problem}); nothing was written. Give a larger capacity or an expansion",
                filter=name,
            )
    tables = placement.tables
    del placement, h, homeless
    layout = replace(layout, subfilters=len(tables))
    header0 = bytearray(header)  # pack_header's: counters and change ids 0
    header0[SUBFILTERS_AT] = layout.subfilters
    items = [table.items for table in tables]
    strings: list[bytes | bytearray] = []
    while tables:  # each table freed once packed
        strings.append(tables.pop(0).pack(len(strings), header0, layout, g))
    return BuiltFilter(strings, items)


# -- the operation: bulk_load on any handle -------------------------------------------------


def load_op(
    handle: FilterHandle[InfoT],
    items: Items,
    capacity: int | None,
    params: dict[str, Any],
    *,
    replace: bool,
    promote: bool,
    applied: int,
    source: int,
) -> Op[InfoT]:
    """``bulk_load`` of ``handle`` (guard/facade.py, which imports this module):
    arguments checked as reserve() checks them, before any I/O; the input hashed; each part
    built and uploaded to the staging copy; the copy promoted; the info of what was written."""
    made = FilterParams.of(1 if capacity is None else capacity, **params)
    stage = handle.staging()
    target: Target = stage._bulk_target(applied, source)
    if promote and stage.key(0) == handle.key(0):  # promoting it onto itself would delete it
        raise InvalidParameterError(
            "bulk_load on a staging copy writes it and stops there: pass promote=False, then "
            "call its promote()",
            param="promote",
            filter=handle.name,
        )
    seed = made.seed
    if promote and not replace:  # refused before the input is read, and again by promote
        if (yield from handle._exists_op()):
            raise FilterExistsError(f"{handle.name}: filter exists", filter=handle.name)
    elif seed is None and target.keep_seed:
        # A replaced sharded filter keeps its seed, as its staging copy does (sharded.py): items
        # route to the same shards in both, so lookups between two shards' promotes find them.
        seed = yield from target.keep_seed()
    # Sized now (too large for a Redis string: refused before any I/O), the seed drawn as
    # reserve() draws it unless given or kept.
    seed = target.params(made, made.capacity, seed).layout().seed
    sink = HashSink(seed, len(target.parts))
    if isinstance(items, AsyncIterable):  # its chunks awaited one by one
        chunks = _achunks(items)
        while (chunk := (yield Work(partial(anext, chunks, None), awaits=True))) is not None:
            yield Work(partial(sink.add, chunk))
    else:
        yield Work(partial(sink.add_all, items))
    part = target.params(made, max(1, sink.count) if capacity is None else capacity, seed)
    layout = part.layout()
    header = pack_header(
        layout, part.capacity, part.error_rate, target.shards, applied=applied, source=source
    )

    def build_part(i: int) -> BuiltFilter:
        # The hashes handed over in the runner (a worker thread on asyncio): build() holds the
        # only reference, and frees each array once done with it.
        return build(*sink.take(i), layout, header, name=handle.name)

    def upload() -> Op[None]:
        for i, filter_part in enumerate(target.parts):
            built = yield Work(partial(build_part, i))
            yield from upload_op(filter_part.key, built)
            del built

    return (yield from staged_op(handle, stage, upload(), promote, only_if_new=not replace))


def staged_op(
    handle: FilterHandle[InfoT],
    stage: FilterHandle[InfoT],
    write: Op[None],
    promote: bool,
    only_if_new: bool,
) -> Op[InfoT]:
    """The one way a filter is replaced whole (a bulk build, an import: guard/dump.py): ``write``
    fills ``stage``, ``handle``'s staging copy, emptied first; promote swaps it in atomically
    (with ``only_if_new``, only if no live filter exists). Any failure drops the staging copy
    and leaves the live filter as it was. Returns the info of what was written."""
    try:
        yield from stage._drop_op()  # an older staging copy
        yield from write
        if promote:
            yield from stage._promote_op(only_if_new=only_if_new)
    except Exception:
        with suppress(Exception):  # a failure here must not hide the one being raised
            yield from stage._drop_op()
        raise
    return (yield from (handle if promote else stage)._info_op())


def upload_op(key: Callable[[int], str], built: BuiltFilter) -> Op[None]:
    """Write ``built`` under ``key(n)`` (an empty staging copy's) so that each string passes the
    layout check only once whole: the tag first (making it at its exact length, as reserve does),
    the table in pieces, the header last; sub-filter 0, which promote reads first, last of all."""
    calls: list[Call | Command] = []
    size = 0
    for n in reversed(range(len(built.strings))):
        data = memoryview(built.strings[n])
        tag_at = len(data) - TAG_BYTES
        table = [(at, data[at : min(at + UPLOAD_BYTES, tag_at)])
                 for at in range(HEADER_BYTES, tag_at, UPLOAD_BYTES)]  # fmt: skip
        for at, piece in [(tag_at, data[tag_at:]), *table, (0, data[:HEADER_BYTES])]:
            calls.append(Command("SETRANGE", [key(n), at, piece]))
            size += len(piece)
            if size >= PIPELINE_BYTES:
                yield Round(calls)
                calls, size = [], 0
    if calls:
        yield Round(calls)
