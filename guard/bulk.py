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

The upload writes each staging string so that it passes the promote script's layout check only
once it is whole (tag first, allocating the string at its exact length; then the table; the
header last); lookups never read a staging copy. When the build creates a filter, the
promote script runs after a check, in the same script, that the live filter still does not
exist, so a filter someone else created meanwhile is never replaced (FilterExistsError). A
failure anywhere leaves the live filter untouched and deletes the staging copy.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import AsyncIterable, Callable, Generator, Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial
from itertools import islice, repeat
from typing import Any, NamedTuple

import mmh3
import numpy as np
from redis.exceptions import ResponseError

from guard import hashing, scripts
from guard import layout as fmt
from guard.errors import (
    FilterExistsError,
    FilterFullError,
    GuardError,
    InvalidParameterError,
)
from guard.layout import Layout

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

Items = Iterable[str | bytes] | Iterable[list[str | bytes]]
Plan = Callable[..., Layout]  # reserve()'s planner: (capacity, **options) -> sub-filter 0's layout
Share = Callable[[int, int], int]  # (total capacity, shards) -> one shard's capacity


# -- hashing --------------------------------------------------------------------------------


def _digests(chunk: list[Any], seed: int) -> np.ndarray:
    """The 128-bit mmh3 hash of every item, as (n, 2) little-endian words: one C call each.

    The same hash as guard/hashing.py's item_hash, item_hashes and shard_of, taken once: the
    builder needs its shard bits (96..127) beside ``h`` and ``g``.
    """
    digest = mmh3.mmh3_x64_128_digest
    try:
        if isinstance(chunk[0], str):  # the digest takes bytes only; str is UTF-8 encoded
            raw = b"".join(map(digest, map(str.encode, chunk), repeat(seed)))
        else:
            raw = b"".join(map(digest, chunk, repeat(seed)))
    except TypeError:  # str and bytes mixed, or something that is not an item
        raw = b"".join([digest(hashing.to_bytes(x), seed) for x in chunk])
    return np.frombuffer(raw, dtype="<u8").reshape(-1, 2)


class Hashes:
    """The input, reduced to what placement needs: per shard, ``h`` (uint64) and ``g``
    (uint32) of every item, in input order. Fed one chunk at a time."""

    def __init__(self, seed: int, shards: int = 1) -> None:
        self.seed = seed
        self.shards = shards
        self._h: list[list[np.ndarray]] = [[] for _ in range(shards)]
        self._g: list[list[np.ndarray]] = [[] for _ in range(shards)]
        self.count = 0

    def add(self, chunk: list[Any]) -> None:
        if not chunk:
            return
        words = _digests(chunk, self.seed)
        h = words[:, 0] & np.uint64(hashing.H_MASK)
        g = (words[:, 1] & np.uint64(hashing.G_MASK)).astype(np.uint32)
        self.count += len(chunk)
        if self.shards == 1:
            self._h[0].append(h)
            self._g[0].append(g)
            return
        shard = (words[:, 1] >> np.uint64(32)) % np.uint64(self.shards)  # hashing.shard_of
        order = np.argsort(shard, kind="stable")
        bounds = np.cumsum(np.bincount(shard.astype(np.intp), minlength=self.shards))
        for i, part in enumerate(np.split(order, bounds[:-1])):
            if len(part):
                self._h[i].append(h[part])
                self._g[i].append(g[part])

    def take(self, shard: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """One shard's (h, g) arrays, handed over: the sink forgets them."""
        h = np.concatenate(self._h[shard]) if self._h[shard] else np.zeros(0, np.uint64)
        g = np.concatenate(self._g[shard]) if self._g[shard] else np.zeros(0, np.uint32)
        self._h[shard], self._g[shard] = [], []
        return h, g


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
            first = (self.h[pick] % np.uint64(m)).astype(np.int64)
            i1[part] = first
            i2[part] = (mixed - first) % m  # hashing.alt_bucket
        return i1, i2

    def _nodes(self, item: int) -> list[tuple[int, int]]:
        """Every (sub-filter, bucket) the item may sit in."""
        h = int(self.h[item])
        mixed = hashing.mix(int(self.g[item]) >> (32 - self.layout.fp_bits))
        out = []
        for n, table in enumerate(self.tables):
            i1 = h % table.m
            i2 = (mixed - i1) % table.m  # hashing.alt_bucket
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
    if n >= fmt.MAX_SUBFILTERS:
        return f"it would need more than {fmt.MAX_SUBFILTERS} sub-filters"
    if layout.fp_step and layout.fp_bits + layout.fp_step * n > fmt.MAX_FP_BITS:
        return f"sub-filter {n} would need fingerprints over {fmt.MAX_FP_BITS} bits"
    if layout.string_bytes(n) > fmt.MAX_STRING_BYTES:
        return f"sub-filter {n} would be larger than a Redis string"
    return None


def _subfilter_string(
    header0: bytes, layout: Layout, n: int, table: _Table, g: np.ndarray
) -> bytearray:
    """Sub-filter n's whole string: sub-filter 0's header as growth copies it (index n, its own
    item count, counters and change ids zero), the table packed a slice at a time (the slots'
    fingerprints exist only a slice at a time), the tag."""
    out = bytearray(layout.string_bytes(n))
    shared = fmt.HEADER_BYTES if n == 0 else fmt.COMMON_BYTES
    out[:shared] = header0[:shared]
    if n:  # the bytes after COMMON_BYTES (applied, source) stay 0, as do the delete counters
        out[fmt.SUBFILTERS_AT] = out[fmt.INDEX_AT] = n
        out[fmt.DELETES_AT : fmt.ERROR_RATE_AT] = bytes(fmt.ERROR_RATE_AT - fmt.DELETES_AT)
    out[fmt.ITEMS_AT : fmt.ITEMS_AT + 8] = table.items.to_bytes(8, "big", signed=True)
    f = layout.fp_bits_at(n)
    at = fmt.HEADER_BYTES
    for start in range(0, len(table.owner) if table.items else 0, PACK_SLOTS):
        owner = table.owner[start : start + PACK_SLOTS]
        prints = np.where(owner >= 0, g[owner] >> np.uint32(32 - f), 0)  # hashing.fingerprint
        packed = pack_slots(prints, f)
        out[at : at + len(packed)] = packed
        at += len(packed)
    out[-fmt.TAG_BYTES :] = layout.tag(n)
    return out


def build(
    h: np.ndarray,
    g: np.ndarray,
    layout: Layout,
    *,
    name: str,
    capacity: int,
    error_rate: float | None,
    shards: int = 0,
    applied: int = 0,
    source: int = 0,
) -> BuiltFilter:
    """Place the items whose hashes are ``h``, ``g`` into a filter laid out as ``layout``
    (sub-filter 0's geometry; it grows from there as the scripts would) and pack its strings.

    ``g`` is changed in place (hashing.fix_g): the arrays are handed over, not lent.
    Raises FilterFullError when the items do not fit a filter that may not grow further.
    """
    f0 = layout.fp_bits
    g[g >> np.uint32(32 - f0) == 0] += np.uint32(1 << (32 - f0))  # hashing.fix_g
    placement = _Placement(h, g, layout)
    homeless = placement.add_subfilter(None)
    while len(homeless):
        problem = _growth_problem(layout, len(placement.tables))
        if problem:
            raise FilterFullError(
                f"filter {name!r} is full: {len(homeless):,} of {len(h):,} items do not fit "
                f"({problem}); nothing was written. Give a larger capacity or an expansion"
            )
        homeless = placement.add_subfilter(homeless)
    tables = placement.tables
    del placement, h, homeless
    layout = Layout(
        layout.bucket_size, f0, layout.fp_step, layout.expansion, len(tables),
        layout.max_kicks, layout.buckets0, layout.seed,
    )  # fmt: skip
    header0 = fmt.pack_header(layout, capacity, error_rate, shards, applied=applied, source=source)
    strings: list[bytes | bytearray] = []
    items = []
    while tables:  # each table freed once packed
        table = tables.pop(0)
        strings.append(_subfilter_string(header0, layout, len(strings), table, g))
        items.append(table.items)
        del table
    return BuiltFilter(layout, strings, items)


# -- upload and promote (sans-IO: the drivers below run the steps) --------------------------


class _Batch(NamedTuple):
    """Redis commands sent in one pipeline; the reply is the list of their replies."""

    commands: list[tuple[Any, ...]]


class _Work(NamedTuple):
    """CPU work (a build): the async driver runs it in a thread, off the event loop."""

    run: Callable[[], Any]


Step = _Batch | _Work
Op = Generator[Step, Any, Any]


@dataclass(frozen=True)
class _Target:
    """One filter the build writes: a plain filter, or one shard of a sharded filter."""

    name: str
    live: Callable[[int], str]  # sub-filter n's key
    staging: Callable[[int], str]

    def live_keys(self) -> list[str]:
        return [self.live(n) for n in range(fmt.MAX_SUBFILTERS)]

    def staging_keys(self) -> list[str]:
        return [self.staging(n) for n in range(fmt.MAX_SUBFILTERS)]


def _writes(key: str, string: bytes | bytearray) -> list[tuple[Any, ...]]:
    """SETRANGEs writing ``string`` to a missing ``key`` so that it passes the scripts' layout
    check only once whole: the tag first (creating the string at its exact length, as reserve
    does), then the table in pieces, the header last."""
    data = memoryview(string)
    tag_at, table_at = len(data) - fmt.TAG_BYTES, fmt.HEADER_BYTES
    out: list[tuple[Any, ...]] = [("SETRANGE", key, tag_at, data[tag_at:])]
    for at in range(table_at, tag_at, UPLOAD_BYTES):
        out.append(("SETRANGE", key, at, data[at : min(at + UPLOAD_BYTES, tag_at)]))
    out.append(("SETRANGE", key, 0, data[:table_at]))
    return out


def _upload_op(target: _Target, built: BuiltFilter) -> Op:
    """Write ``built`` as ``target``'s staging copy (any older copy deleted first)."""
    yield _Batch([("DEL", *target.staging_keys())])
    # Sub-filters from the last: sub-filter 0's header, the one a promote reads first, last.
    commands = [
        c
        for n in reversed(range(len(built.strings)))
        for c in _writes(target.staging(n), built.strings[n])
    ]
    batch: list[tuple[Any, ...]] = []
    size = 0
    for c in commands:
        batch.append(c)
        size += len(c[3])
        if size >= PIPELINE_BYTES:
            yield _Batch(batch)
            batch, size = [], 0
    if batch:
        yield _Batch(batch)


# Put before promote.lua when the build creates the filter: one script checks that the live
# filter still does not exist and swaps the staging copy in, so a filter someone else made
# meanwhile is never replaced (and the check holds on every client, Redis Cluster included).
_ONLY_IF_NEW = (
    "if redis.call('EXISTS', KEYS[1]) == 1 then\n"
    "  return redis.error_reply('GUARD_EXISTS filter exists')\n"
    "end\n"
)


def _promote_op(target: _Target, layout: Layout, create: bool) -> Op:
    """Swap the staging copy in with the promote script; when ``create``, only if the live
    filter still does not exist (FilterExistsError otherwise)."""
    source = (_ONLY_IF_NEW if create else "") + scripts.source("promote")
    keys = [*target.live_keys(), *target.staging_keys()]
    try:
        (reply,) = yield _Batch([("EVAL", source, len(keys), *keys, *layout.args())])
    except ResponseError as exc:
        raise scripts.map_error(exc, target.name) from exc
    if reply != 1:  # STALE: another build replaced the staging copy meanwhile
        raise GuardError(f"{target.name}: the staging copy changed during the build")


def _cleanup(targets: list[_Target]) -> Op:
    """Delete the staging copies; a failure here must not hide the one being raised."""
    try:
        for t in targets:
            yield _Batch([("DEL", *t.staging_keys())])
    except Exception:
        return


# -- the job: what one bulk load does, whatever runs it -------------------------------------


def _check_id(name: str, value: object, highest: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= highest:
        raise InvalidParameterError(f"{name} must be an integer from 0 to {highest}, got {value!r}")
    return value


@dataclass
class _Job:
    """A bulk load of one filter (``shards`` > 0: of a sharded filter, one target per shard)."""

    targets: list[_Target]
    shards: int  # as the header records it: 0 for a plain filter
    plan: Plan
    share: Share | None  # a shard's capacity from the total (sharded filters)
    capacity: int | None
    params: dict[str, Any]
    applied: int
    source: int
    promote: bool
    create: bool
    seed: int | None = None
    layouts: list[Layout] = field(default_factory=list)

    @classmethod
    def make(
        cls,
        targets: list[_Target],
        shards: int,
        plan: Plan,
        share: Share | None,
        capacity: int | None,
        params: dict[str, Any],
        *,
        replace: bool,
        promote: bool,
        applied: int,
        source: int,
    ) -> _Job:
        """Every parameter checked as reserve() checks them, before any I/O."""
        plan(1 if capacity is None else capacity, **params)  # every option, named if wrong
        job = cls(
            targets,
            shards,
            plan,
            share,
            capacity,
            dict(params),
            _check_id("applied", applied, fmt.MAX_CHANGE_ID),
            _check_id("source", source, fmt.MAX_SOURCE),
            bool(promote),
            not replace,
            params.get("seed"),
        )
        return job

    def _capacity(self, count: int) -> int:
        total = self.capacity if self.capacity is not None else max(1, count)
        return self.share(total, self.shards) if self.share else total

    def prepare_op(self) -> Op:
        """Before reading the input: refuse an existing filter (when creating one) and pick
        the seed; returns it."""
        if self.create and self.promote:
            reply = yield _Batch([("EXISTS", t.live(0)) for t in self.targets])
            if any(reply):
                raise FilterExistsError(f"{self.targets[0].name}: filter exists")
        elif self.seed is None and self.shards:
            # A sharded filter replaced keeps its seed, as its staging copy does (sharded.py):
            # an item routes to the same shard in both, so a lookup between two shards'
            # promotes still finds it.
            self.seed = yield from _live_seed_op(self.targets[0], self.shards)
        if self.seed is None:
            self.seed = self.plan(1, **self.params).seed  # drawn as reserve() draws it
        return self.seed

    def _build(
        self, sink: Hashes, shard: int, layout: Layout, capacity: int, name: str
    ) -> BuiltFilter:
        # The hashes are handed over here, in the worker: build() holds the only reference,
        # and frees each array as soon as it is done with it.
        return build(
            *sink.take(shard),
            layout,
            name=name,
            capacity=capacity,
            error_rate=self.params.get("error_rate"),
            shards=self.shards,
            applied=self.applied,
            source=self.source,
        )

    def run_op(self, sink: Hashes) -> Op:
        """Build, upload and (unless told not to) promote every target."""
        params = {**self.params, "seed": self.seed}
        capacity = self._capacity(sink.count)
        layout = self.plan(capacity, **params)
        try:
            for i, target in enumerate(self.targets):
                work = partial(self._build, sink, i, layout, capacity, target.name)
                built: BuiltFilter = yield _Work(work)
                self.layouts.append(built.layout)
                yield from _upload_op(target, built)
                del built
            if not self.promote:
                return
            if self.create and len(self.targets) > 1:  # no shard swapped in if one exists
                reply = yield _Batch([("EXISTS", t.live(0)) for t in self.targets])
                if any(reply):
                    raise FilterExistsError(f"{self.targets[0].name}: filter exists")
            for target, layout in zip(self.targets, self.layouts, strict=True):
                yield from _promote_op(target, layout, self.create)
        except BaseException as exc:
            if not isinstance(exc, GeneratorExit):
                yield from _cleanup(self.targets)
            raise


def _live_seed_op(target: _Target, shards: int) -> Generator[Step, Any, int | None]:
    """The seed of the live sharded filter (read from shard 0, verified), None if none."""
    reads = [(command, *args) for command, args in fmt.probe_reads(target.live(0))]
    reply = yield _Batch([("EXISTS", target.live(0)), *reads])
    if not reply[0]:
        return None
    stored = fmt.Stored(target.live(0), *reply[1:4])
    layout = fmt.verify_stored(target.name, [stored])
    recorded = fmt.unpack_header(stored.header).shards
    if recorded != shards:
        raise InvalidParameterError(
            f"{target.name}: the filter has {recorded} shard(s); this handle was opened with "
            f"shards={shards}"
        )
    return layout.seed


# -- drivers --------------------------------------------------------------------------------


_END = object()


def _chunks(items: Iterable[Any]) -> Iterator[list[Any]]:
    """The input in lists of about CHUNK_ITEMS items: from items, or from batches of items
    (lists or tuples, as a database cursor hands them out)."""
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


async def _achunks(items: AsyncIterable[Any]) -> Any:
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


# One command goes on its own, not in a pipeline: redis-py's pipeline error messages quote the
# command, and promote's quoted source would be taken for the script's own error reply.


def _send(redis: Any, batch: _Batch) -> Any:
    if len(batch.commands) == 1:
        return [redis.execute_command(*batch.commands[0])]
    pipe = redis.pipeline(transaction=False)
    for c in batch.commands:
        pipe.execute_command(*c)
    return pipe.execute()


async def _asend(redis: Any, batch: _Batch) -> Any:
    if len(batch.commands) == 1:
        return [await redis.execute_command(*batch.commands[0])]
    pipe = redis.pipeline(transaction=False)
    for c in batch.commands:
        pipe.execute_command(*c)
    return await pipe.execute()


def _run(redis: Any, op: Op) -> Any:
    try:
        step = next(op)
        while True:
            try:
                reply = step.run() if isinstance(step, _Work) else _send(redis, step)
            except BaseException as exc:  # back into the op, which cleans up and re-raises
                step = op.throw(exc)
            else:
                step = op.send(reply)
    except StopIteration as done:
        return done.value


async def _arun(redis: Any, op: Op) -> Any:
    try:
        step = next(op)
        while True:
            try:
                if isinstance(step, _Work):
                    reply = await asyncio.to_thread(step.run)
                else:
                    reply = await _asend(redis, step)
            except BaseException as exc:
                step = op.throw(exc)
            else:
                step = op.send(reply)
    except StopIteration as done:
        return done.value


BULK_OPTIONS = ("replace", "promote", "applied", "source")


def _job(
    handle: Any, capacity: int | None, plan: Plan, share: Share | None, options: dict[str, Any]
) -> _Job:
    """The job for a plain or sharded handle (guard/filter.py, guard/sharded.py); ``plan``
    refuses an option it does not know, as reserve() does."""
    params = {k: v for k, v in options.items() if k not in BULK_OPTIONS}
    flags = {
        "replace": options.get("replace", False),
        "promote": options.get("promote", True),
        "applied": options.get("applied", 0),
        "source": options.get("source", 0),
    }
    shards = getattr(handle, "shards", None)
    if shards is not None and (flags["applied"] or flags["source"]):
        # As reserve(): only a plain filter follows a change log (guard/changes.py).
        raise InvalidParameterError("a sharded filter takes no applied/source")
    staging = handle.staging()
    if flags["promote"] and staging.key(0) == handle.key(0):
        # A staging handle's own staging copy is itself: promoting it onto "its live keys"
        # would delete the build.
        raise InvalidParameterError(
            "bulk_load on a staging copy writes it and stops there: pass promote=False, then "
            "call its promote()"
        )
    if shards is None:
        targets = [_Target(handle.name, handle.key, staging.key)]
    else:
        targets = [
            _Target(handle.name, partial(handle.key, i), partial(staging.key, i))
            for i in range(shards)
        ]
    return _Job.make(targets, shards or 0, plan, share, capacity, params, **flags)


def bulk_load(
    handle: Any,
    items: Items,
    capacity: int | None = None,
    *,
    plan: Plan,
    share: Share | None = None,
    **options: Any,
) -> Any:
    """Make ``handle``'s filter (SyncCuckooFilter or SyncShardedCuckooFilter) from ``items``.

    ``plan`` and ``share`` are the facade's sizing (reserve()'s layout planner; a shard's
    capacity from the total): the handles' own bulk_load methods pass them, so that the
    builder imports no facade.

    ``items``: str/bytes items, or lists of them, streamed (the filter is a multiset: each
    occurrence is stored). ``capacity`` (the total, for a sharded filter) and the options
    ``reserve()`` takes; capacity None sizes the filter for the items read. And:

    * ``replace=False``: True swaps out an existing filter atomically (else FilterExistsError,
      raised before the input is read, and checked again by the swap itself);
    * ``promote=True``: False leaves the build in the staging copy (``handle.staging()``) for
      the caller to change and promote;
    * ``applied=0``, ``source=0``: the change-log position the items reflect (stored format
      version 3: sub-filter 0's header).

    Returns the info of the filter written (the staging copy's when not promoted).
    """
    job = _job(handle, capacity, plan, share, options)
    sink = Hashes(_run(handle.redis, job.prepare_op()), len(job.targets))
    for chunk in _chunks(items):
        sink.add(chunk)
    _run(handle.redis, job.run_op(sink))
    return (handle if job.promote else handle.staging()).info()


async def abulk_load(
    handle: Any,
    items: Items | AsyncIterable[Any],
    capacity: int | None = None,
    *,
    plan: Plan,
    share: Share | None = None,
    **options: Any,
) -> Any:
    """``bulk_load`` for CuckooFilter and ShardedCuckooFilter; ``items`` may be an async
    iterable too. Hashing and placement run in a worker thread, off the event loop."""
    job = _job(handle, capacity, plan, share, options)
    sink = Hashes(await _arun(handle.redis, job.prepare_op()), len(job.targets))
    if isinstance(items, AsyncIterable):
        async for chunk in _achunks(items):
            await asyncio.to_thread(sink.add, chunk)
    else:
        chunks = _chunks(items)
        while chunk := await asyncio.to_thread(next, chunks, None):
            await asyncio.to_thread(sink.add, chunk)
    await _arun(handle.redis, job.run_op(sink))
    return await (handle if job.promote else handle.staging()).info()
