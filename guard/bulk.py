"""Bulk builds: a filter made whole in memory with numpy, uploaded as its staging copy, promoted.

Inserting items one script call at a time costs Redis 15-60 µs of CPU per item; a filter that
is being *made* (a load into a new filter, a rebuild from the database) needs none of that
atomicity while it is invisible. The builder streams its input in chunks, keeping only each
item's hash (12 bytes: ``h`` and ``g``, guard/hashing.py), places every item with whole-array
operations, packs the sub-filter strings exactly as docs/format.md lays them out, writes them
under the filter's staging keys and swaps them in with the project's own promote script.

Placement, per sub-filter, on a table of item numbers (the owner of every slot):

1. **first choice**: each item claims a slot in its primary bucket, one slot per bucket per
   pass (a scatter whose surviving write is the winner), up to ``b`` passes;
2. **second choice**: the rest claim slots in their alternate bucket the same way;
3. **kick rounds**: the homeless items walk as the scripts' kick chains do, all at once: each
   goes to a free slot of its current bucket if one is left, else takes a random slot of it,
   and the item it evicted moves on to its own other bucket. Every round keeps every placed
   item in one of its two buckets; the homeless ones are always held in an array, never lost;
4. **search**: the few a walk leaves (at most SEARCH_ITEMS) are placed one by one along the
   shortest chain of moves that ends in a free slot, through every sub-filter so far (an item
   may move to an older one: lookups and deletes read them all). Within its budget the search
   misses no chain, so the build fits every item whenever any arrangement in as many
   sub-filters does: never fewer than one-by-one inserts.

What is still homeless is never dropped. A growing filter (``expansion`` > 0) gets its next
sub-filter, as insert.lua's growth would make it (``m0 * k^n`` buckets, one more fingerprint
bit when sized by error rate), and the leftovers are placed there the same way. A filter that
cannot hold them (fixed size, or at a growth limit) raises FilterFullError before anything is
written: the answer the scripts would give, and the sizing rule (``capacity`` →
guard/layout.py:buckets_for) leaves the margin that makes it rare.

``load_op`` is ``bulk_load`` (guard/facade.py) for every handle: an operation like the others,
run by the handle's own runner, whose hashing and placement are ``Work`` (guard/ops.py): done
in a worker thread on an asyncio handle, off the event loop. The upload writes each staging
string so that it passes the promote script's layout check only once it is whole (tag first,
allocating the string at its exact length; then the table; the header last); lookups never
read a staging copy. When the build creates a filter, promote.lua checks, in the same script,
that the live filter still does not exist, so a filter someone else created meanwhile is never
replaced (FilterExistsError). A failure anywhere leaves the live filter untouched and deletes
the staging copy.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator
from contextlib import suppress
from dataclasses import dataclass, replace
from functools import partial
from itertools import islice
from typing import Any, NamedTuple, Protocol

import numpy as np

from guard import hashing
from guard.errors import FilterExistsError, FilterFullError, InvalidParameterError
from guard.layout import (
    COMMON_BYTES,
    DELETES_AT,
    ERROR_RATE_AT,
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

CHUNK_ITEMS = 1 << 16  # items hashed per step: the only Python objects held at once
PACK_SLOTS = 1 << 20  # slots packed at once (a multiple of 8: every slice ends on a byte)
UPLOAD_BYTES = 4 << 20  # bytes per SETRANGE: no command is huge, however large the filter
PIPELINE_BYTES = 32 << 20  # SETRANGE payload sent per round trip
# Kick rounds stop when PATIENCE rounds placed under 1 % of the homeless (and at least one):
# the table is as full as walking gets it. MAX_ROUNDS bounds them in any case; a round is a
# few passes over the homeless items' arrays.
PATIENCE = 64
MAX_ROUNDS = 4000
# Items a walk leaves homeless are searched for one by one (breadth first, in Python) when at
# most SEARCH_ITEMS are left; the searches of one sub-filter visit SEARCH_BUDGET buckets at
# most (about a second), so an overfull filter fails or grows without a long wait.
SEARCH_ITEMS = 1024
SEARCH_BUDGET = 1 << 18

# str/bytes items, or batches of them (lists or tuples, as a database cursor hands them out);
# an async iterable of either on an asyncio handle.
Items = Iterable[Any] | AsyncIterable[Any]


# -- hashing --------------------------------------------------------------------------------


class Hashes:
    """The input, reduced to what placement needs: per shard, ``h`` (int64) and ``g``
    (uint32) of every item, in input order. Fed one chunk at a time."""

    def __init__(self, seed: int, shards: int = 1) -> None:
        self.seed = seed
        self.shards = shards
        self._h: list[list[np.ndarray]] = [[] for _ in range(shards)]
        self._g: list[list[np.ndarray]] = [[] for _ in range(shards)]
        self.count = 0

    def add_all(self, items: Iterable[Any]) -> None:
        """Every item of ``items``, or of its batches, a chunk at a time."""
        for chunk in _chunks(items):
            self.add(chunk)

    def add(self, chunk: list[Any]) -> None:
        if not chunk:
            return
        # One digest per item gives h, g and (sharded) the shard: hashing.item_hashes.
        rows = hashing.item_hashes(chunk, self.seed, self.shards if self.shards > 1 else 0)
        h, g = rows[:, 0], rows[:, 1].astype(np.uint32)
        self.count += len(chunk)
        if self.shards == 1:
            self._h[0].append(h.copy())  # a column of rows: a view would keep all of them
            self._g[0].append(g)
            return
        shard = rows[:, 2]
        order = np.argsort(shard, kind="stable")
        bounds = np.cumsum(np.bincount(shard, minlength=self.shards))
        for i, part in enumerate(np.split(order, bounds[:-1])):
            if len(part):
                self._h[i].append(h[part])
                self._g[i].append(g[part])

    def take(self, shard: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """One shard's (h, g) arrays, handed over: the sink forgets them."""
        h = np.concatenate(self._h[shard]) if self._h[shard] else np.zeros(0, np.int64)
        g = np.concatenate(self._g[shard]) if self._g[shard] else np.zeros(0, np.uint32)
        self._h[shard], self._g[shard] = [], []
        return h, g


_END = object()


def _chunks(items: Iterable[Any]) -> Iterator[list[Any]]:
    """The input in lists of about CHUNK_ITEMS items: from items, or from batches of items."""
    it = iter(items)
    first = next(it, _END)
    if first is _END:
        return
    if isinstance(first, list | tuple):
        pending = list(first)
        for batch in it:
            pending.extend(batch)
            if len(pending) >= CHUNK_ITEMS:
                yield pending
                pending = []
        if pending:
            yield pending
        return
    yield [first, *islice(it, CHUNK_ITEMS - 1)]
    while chunk := list(islice(it, CHUNK_ITEMS)):
        yield chunk


async def _achunks(items: AsyncIterable[Any]) -> AsyncIterator[list[Any]]:
    """``_chunks`` of an async iterable."""
    pending: list[Any] = []
    async for x in items:
        if isinstance(x, list | tuple):
            pending.extend(x)
        else:
            pending.append(x)
        if len(pending) >= CHUNK_ITEMS:
            yield pending
            pending = []
    if pending:
        yield pending


# -- placement ------------------------------------------------------------------------------


class _Table:
    """One sub-filter being filled: in every slot, the number of the item it holds (its place
    in the input; -1: empty). ``fill[i]`` counts bucket i's slots taken, always its first ones.

    Bucket numbers fit int32 (a sub-filter string of at most 512 MB has at most 2**30 buckets,
    so i1 + i2 does too), and so do slot numbers (2**30 slots of at least 4 bits).
    """

    def __init__(self, buckets: int, bucket_size: int, dtype: Any) -> None:
        self.m = buckets
        self.b = bucket_size
        self.owner = np.full(buckets * bucket_size, -1, dtype=dtype)
        self.fill = np.zeros(buckets, dtype=np.int8)
        self.items = 0
        self._claims = np.empty(buckets, dtype=dtype)

    def claim(self, ids: np.ndarray, bucket: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Put each item ``ids[k]`` in a free slot of ``bucket[k]`` where one is left;
        returns the items not placed (their bucket is full) and their buckets.

        One pass gives every bucket at most one new item: of the items writing their number
        into a bucket's cell, the one whose number survived wins. Which one survives does not
        matter; that exactly one does is what a scatter guarantees.
        """
        b = self.b
        if not self.items:
            return self._claim_empty(ids, bucket)
        is_open = self.fill[bucket] < b
        full_ids, full_buckets = [ids[~is_open]], [bucket[~is_open]]
        ids, bucket = ids[is_open], bucket[is_open]
        while len(ids):
            self._claims[bucket] = ids
            won = self._claims[bucket] == ids
            at = bucket[won]
            self.owner[at * b + self.fill[at]] = ids[won]
            self.fill[at] += 1
            self.items += len(at)
            lost = ~won
            ids, bucket = ids[lost], bucket[lost]
            is_open = self.fill[bucket] < b
            if not is_open.all():
                full_ids.append(ids[~is_open])
                full_buckets.append(bucket[~is_open])
                ids, bucket = ids[is_open], bucket[is_open]
        return np.concatenate(full_ids), np.concatenate(full_buckets)

    def _claim_empty(self, ids: np.ndarray, bucket: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """claim() on an empty table, where pass p's winners all take slot p (each of their
        buckets won once in every earlier pass): no fill counts to read, and after b passes
        every bucket still wanted is full."""
        b = self.b
        for p in range(b):
            if not len(ids):
                break
            self._claims[bucket] = ids
            won = self._claims[bucket] == ids
            self.owner[bucket[won] * b + p] = ids[won]
            lost = ~won
            ids, bucket = ids[lost], bucket[lost]
        taken = self.owner.reshape(-1, b) >= 0
        self.fill[:] = taken.sum(axis=1, dtype=np.int8)
        self.items = int(taken.sum())
        return ids, bucket

    def place(
        self, ids: np.ndarray, i1: np.ndarray, i2: np.ndarray, rng: np.random.Generator
    ) -> np.ndarray:
        """Place the items ``ids`` (ascending; ``ids[k]``'s buckets are ``i1[k]``,
        ``i2[k]``): first choices, second choices, then kick rounds. Returns those homeless."""
        if len(ids) and ids[-1] == len(ids) - 1:  # 0..n-1: an item's number is its index

            def index(x: np.ndarray) -> np.ndarray:
                return x

        else:

            def index(x: np.ndarray) -> np.ndarray:
                return np.searchsorted(ids, x)

        homeless, _ = self.claim(ids, i1)
        homeless, _ = self.claim(homeless, i2[index(homeless)])
        if len(homeless):
            homeless = self._kick(homeless, i1, i2, index, rng)
        return homeless

    def _kick(
        self,
        homeless: np.ndarray,
        i1: np.ndarray,
        i2: np.ndarray,
        index: Callable[[np.ndarray], np.ndarray],
        rng: np.random.Generator,
    ) -> np.ndarray:
        """The kick chains of all homeless items at once (see the module docstring)."""
        free = self.m * self.b - self.items
        # No more walkers than free slots: the others have no slot to reach in this table.
        ids, aside = homeless[:free], homeless[free:]
        k = index(ids)
        at = np.where(rng.random(len(ids)) < 0.5, i1[k], i2[k])
        window = len(ids)  # homeless at the start of the current PATIENCE rounds
        for rounds in range(1, MAX_ROUNDS + 1):
            ids, at = self.claim(ids, at)  # a free slot in the current bucket, if one is left
            if not len(ids):
                break
            # One walker per bucket (a scatter picks it, as in claim) takes a random slot of it.
            self._claims[at] = ids
            won = self._claims[at] == ids
            pos = at[won] * self.b + rng.integers(0, self.b, int(won.sum()), dtype=at.dtype)
            victims = self.owner[pos]
            self.owner[pos] = ids[won]
            # A victim moves to its other bucket; a loser tries its own other bucket next.
            lost = ids[~won]
            kv, kl = index(victims), index(lost)
            victims_at = i1[kv] + i2[kv] - at[won]
            lost_at = i1[kl] + i2[kl] - at[~won]
            ids = np.concatenate([victims, lost])
            at = np.concatenate([victims_at, lost_at])
            if rounds % PATIENCE == 0:
                if window - len(ids) < max(1, window // 100):
                    break  # as full as walking gets it: the rest go to the next sub-filter
                window = len(ids)
        return np.concatenate([ids, aside])


class _Placement:
    """The items of one build (``h``, fixed ``g``), placed into sub-filters added as
    insert.lua's growth would add them."""

    def __init__(self, h: np.ndarray, g: np.ndarray, layout: Layout) -> None:
        self.h, self.g, self.layout = h, g, layout
        self.tables: list[_Table] = []
        self._dtype = np.int32 if len(h) < 2**31 else np.int64
        self._rng = np.random.default_rng([layout.seed, len(h)])  # a build is reproducible

    def add_subfilter(self, ids: np.ndarray | None) -> np.ndarray:
        """Add the next sub-filter and place the items ``ids`` (ascending; None: all) in it,
        then search every sub-filter for the few a walk leaves. Returns those still homeless."""
        n = len(self.tables)
        m = self.layout.buckets(n)
        table = _Table(m, self.layout.bucket_size, self._dtype)
        self.tables.append(table)
        if ids is None:
            ids = np.arange(len(self.h), dtype=self._dtype)
        i1, i2 = self._buckets(ids, m)
        homeless = table.place(ids, i1, i2, self._rng)
        del i1, i2, ids
        if 0 < len(homeless) <= SEARCH_ITEMS:
            budget = [SEARCH_BUDGET]
            homeless = np.array(
                [x for x in homeless.tolist() if not self._search(x, budget)], dtype=self._dtype
            )
        return np.sort(homeless)

    def _buckets(self, ids: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray]:
        """Both buckets (int32) of the items ``ids`` in a sub-filter of m buckets, a slice at
        a time so that the int64 intermediates stay small.

        ``H(P)`` (hashing.mix of the f0-bit fingerprint prefix) is looked up in a table of
        every prefix when there are at most as many prefixes as items: four modulos per item
        cost more than one look-up in a table that fits in a cache."""
        f0 = self.layout.fp_bits
        table = None
        if 1 << f0 <= max(1 << 16, len(ids)):
            table = hashing.mix(np.arange(1 << f0, dtype=np.int64))
        i1, i2 = np.empty(len(ids), np.int32), np.empty(len(ids), np.int32)
        for a in range(0, len(ids), CHUNK_ITEMS * 16):
            part = slice(a, a + CHUNK_ITEMS * 16)
            pick = ids[part]
            prefix = self.g[pick] >> np.uint32(32 - f0)
            mixed = table[prefix] if table is not None else hashing.mix(prefix.astype(np.int64))
            i1[part], i2[part] = hashing.buckets(self.h[pick], mixed, m)
        return i1, i2

    def _nodes(self, item: int) -> list[tuple[int, int]]:
        """Every (sub-filter, bucket) the item may sit in."""
        h = int(self.h[item])
        mixed = hashing.mix(int(self.g[item]) >> (32 - self.layout.fp_bits))
        out = []
        for n, table in enumerate(self.tables):
            i1, i2 = hashing.buckets(h, mixed, table.m)
            out += [(n, i1), (n, i2)] if i2 != i1 else [(n, i1)]
        return out

    def _search(self, item: int, budget: list[int]) -> bool:
        """Place ``item`` by the shortest chain of moves that ends in a free slot of any
        sub-filter, if a breadth-first search finds one within ``budget[0]`` buckets (the
        budget is shared by the searches of one sub-filter's leftovers, and used up here).

        A search that ends within its budget misses no chain; so, as in Kuhn's matching
        algorithm, a build whose searches all end within budget holds every item whenever any
        arrangement in as many sub-filters does (never fewer than one-by-one inserts place).
        An item may move to an older sub-filter: lookups and deletes read them all.
        """
        came: dict[tuple[int, int], tuple[tuple[int, int], int] | None]
        came = dict.fromkeys(self._nodes(item))
        queue = deque(came)
        tables, b = self.tables, self.layout.bucket_size
        while queue and budget[0] > 0:
            budget[0] -= 1
            node = queue.popleft()
            n, i = node
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


# -- packing --------------------------------------------------------------------------------


def pack_slots(values: np.ndarray, fp_bits: int) -> bytes:
    """Slots as docs/format.md lays them out: ``fp_bits``-bit unsigned big-endian integers,
    bit-packed from the first bit (what ``BITFIELD GET u<f>`` reads), zero bits at the end.

    Slots go in groups that end on a byte boundary (8 / gcd(f, 8) slots); each group is built
    in a few 64-bit words with shifts, whole arrays at once, and the words' bytes are the
    group's bytes.
    """
    f = fp_bits
    nbytes = (len(values) * f + 7) // 8
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
        at = j * f
        w, shift = at // 64, 64 - at % 64 - f  # the slot's bits end `shift` bits above word w's
        if shift >= 0:
            out[:, w] |= v[:, j] << np.uint64(shift)
        else:  # the slot straddles words w and w + 1
            out[:, w] |= v[:, j] >> np.uint64(-shift)
            out[:, w + 1] |= v[:, j] << np.uint64(64 + shift)
    raw = out.astype(">u8").view(np.uint8).reshape(groups, words * 8)[:, : k * f // 8]
    return raw.tobytes()[:nbytes]


# -- the build ------------------------------------------------------------------------------


@dataclass(frozen=True)
class BuiltFilter:
    """A filter's sub-filter strings, ready to upload (``layout.subfilters`` of them)."""

    layout: Layout
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


def _subfilter_string(
    header0: bytes | bytearray, layout: Layout, n: int, table: _Table, g: np.ndarray
) -> bytearray:
    """Sub-filter n's whole string: sub-filter 0's header as growth copies it (index n, its own
    item count, counters and change ids zero), the table packed a slice at a time (the slots'
    fingerprints exist only a slice at a time), the tag."""
    out = bytearray(layout.string_bytes(n))
    shared = HEADER_BYTES if n == 0 else COMMON_BYTES
    out[:shared] = header0[:shared]
    if n:  # the bytes after COMMON_BYTES (applied, source) stay 0, as do the delete counters
        out[SUBFILTERS_AT] = out[INDEX_AT] = n
        out[DELETES_AT:ERROR_RATE_AT] = bytes(ERROR_RATE_AT - DELETES_AT)
    out[ITEMS_AT : ITEMS_AT + 8] = table.items.to_bytes(8, "big", signed=True)
    f = layout.fp_bits_at(n)
    at = HEADER_BYTES
    for start in range(0, len(table.owner) if table.items else 0, PACK_SLOTS):
        owner = table.owner[start : start + PACK_SLOTS]
        prints = np.where(owner >= 0, hashing.fingerprint(g[owner], f), 0)
        packed = pack_slots(prints, f)
        out[at : at + len(packed)] = packed
        at += len(packed)
    out[-TAG_BYTES:] = layout.tag(n)
    return out


def build(h: np.ndarray, g: np.ndarray, layout: Layout, header: bytes, *, name: str) -> BuiltFilter:
    """Place the items whose hashes are ``h``, ``g`` into a filter laid out as ``layout`` with
    sub-filter 0's ``header`` (both as reserve() would make them: it grows from there as the
    scripts would) and pack its strings.

    ``g`` is changed in place (hashing.fix_g): the arrays are handed over, not lent.
    Raises FilterFullError when the items do not fit a filter that may not grow further.
    """
    f0 = layout.fp_bits
    g[g >> np.uint32(32 - f0) == 0] += np.uint32(1 << (32 - f0))  # hashing.fix_g, in place
    placement = _Placement(h, g, layout)
    homeless = placement.add_subfilter(None)
    while len(homeless):
        problem = _growth_problem(layout, len(placement.tables))
        if problem:
            raise FilterFullError(
                f"filter {name!r} is full: {len(homeless):,} of {len(h):,} items do not fit "
                f"({problem}); nothing was written. Give a larger capacity or an expansion",
                filter=name,
            )
        homeless = placement.add_subfilter(homeless)
    tables = placement.tables
    del placement, h, homeless
    layout = replace(layout, subfilters=len(tables))
    header0 = bytearray(header)
    header0[SUBFILTERS_AT] = layout.subfilters
    strings: list[bytes | bytearray] = []
    items = []
    while tables:  # each table freed once packed
        table = tables.pop(0)
        strings.append(_subfilter_string(header0, layout, len(strings), table, g))
        items.append(table.items)
        del table
    return BuiltFilter(layout, strings, items)


# -- the operation: bulk_load on any handle -------------------------------------------------


class Target(NamedTuple):
    """What a build writes, as the staging copy's handle says (its ``_bulk_target``,
    guard/filter.py and guard/sharded.py): the filters that hold the items, one or one per
    shard, and what their headers record."""

    parts: list[Any]  # each with .key(n), sub-filter n's key
    shards: int = 0  # as the headers record it: 0 for a plain filter
    share: Callable[[int], int] | None = None  # one part's capacity, from the total
    keep_seed: Callable[[], Op[int | None]] | None = None  # the live filter's, if it has one

    def params(self, made: FilterParams, total: int, seed: int | None) -> FilterParams:
        """One part's parameters, for a ``total`` capacity."""
        return replace(made, capacity=self.share(total) if self.share else total, seed=seed)


class Handle(Protocol):
    """What a build uses of the handle whose filter it makes (guard/facade.py)."""

    name: str
    key: Callable[..., str]  # key(0): its first key

    def staging(self) -> Handle: ...
    def _bulk_target(self, applied: int, source: int) -> Target: ...
    def _exists_op(self) -> Op[bool]: ...
    def _drop_op(self) -> Op[bool]: ...
    def _promote_op(self, only_if_new: bool = False) -> Op[bool]: ...
    def _info_op(self) -> Op[Any]: ...


def load_op(
    handle: Handle,
    items: Items,
    capacity: int | None,
    params: dict[str, Any],
    *,
    replace: bool,
    promote: bool,
    applied: int,
    source: int,
) -> Op[Any]:
    """``bulk_load`` of ``handle`` (see guard/facade.py): every argument checked as reserve()
    checks it, before any I/O; the input read and hashed; each part built, then uploaded to
    the staging copy; the copy promoted; the info of what was written."""
    made = FilterParams.of(1 if capacity is None else capacity, **params)
    stage = handle.staging()
    target = stage._bulk_target(applied, source)
    if promote and stage.key(0) == handle.key(0):
        # A staging handle's own staging copy is itself: promoting it onto "its live keys"
        # would delete the build.
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
        # A sharded filter replaced keeps its seed, as its staging copy does (sharded.py): an
        # item routes to the same shard in both, so a lookup between two shards' promotes
        # still finds it.
        seed = yield from target.keep_seed()
    # Sized now (a filter too large for a Redis string is refused before any I/O); the seed
    # drawn as reserve() draws it, unless one is given or kept.
    seed = target.params(made, made.capacity, seed).layout().seed
    sink = Hashes(seed, len(target.parts))
    yield from _read_op(items, sink)
    part = target.params(made, max(1, sink.count) if capacity is None else capacity, seed)
    layout = part.layout()
    header = pack_header(
        layout, part.capacity, part.error_rate, target.shards, applied=applied, source=source
    )
    try:
        yield from stage._drop_op()  # an older staging copy
        for i, filter_part in enumerate(target.parts):
            built = yield Work(partial(_build, sink, i, layout, header, handle.name))
            yield from upload_op(filter_part.key, built)
            del built
        if promote:
            yield from stage._promote_op(only_if_new=not replace)
    except Exception:
        with suppress(Exception):  # a failure here must not hide the one being raised
            yield from stage._drop_op()
        raise
    return (yield from (handle if promote else stage)._info_op())


def _read_op(items: Items, sink: Hashes) -> Op[None]:
    """The input into ``sink``; an async iterable's batches awaited one by one."""
    if not isinstance(items, AsyncIterable):
        yield Work(partial(sink.add_all, items))
        return
    batches = _achunks(items)
    while (chunk := (yield Work(partial(anext, batches, None), awaits=True))) is not None:
        yield Work(partial(sink.add, chunk))


def _build(sink: Hashes, part: int, layout: Layout, header: bytes, name: str) -> BuiltFilter:
    # The hashes are handed over here, in the runner (a worker thread on asyncio): build()
    # holds the only reference, and frees each array as soon as it is done with it.
    return build(*sink.take(part), layout, header, name=name)


def upload_op(key: Callable[[int], str], built: BuiltFilter) -> Op[None]:
    """Write ``built`` under ``key(n)``, the keys of a staging copy that holds nothing.

    Each string is written so that it passes the scripts' layout check only once whole: the
    tag first (creating the string at its exact length, as reserve does), then the table in
    pieces, the header last; and sub-filter 0, whose header a promote reads first, last."""
    calls: list[Call | Command] = []
    size = 0
    for n in reversed(range(len(built.strings))):
        data = memoryview(built.strings[n])
        tag_at = len(data) - TAG_BYTES
        pieces = [(tag_at, data[tag_at:])]
        pieces += [(at, data[at : min(at + UPLOAD_BYTES, tag_at)])
                   for at in range(HEADER_BYTES, tag_at, UPLOAD_BYTES)]  # fmt: skip
        pieces.append((0, data[:HEADER_BYTES]))
        for at, piece in pieces:
            calls.append(Command("SETRANGE", [key(n), at, piece]))
            size += len(piece)
            if size >= PIPELINE_BYTES:
                yield Round(calls)
                calls, size = [], 0
    if calls:
        yield Round(calls)
