"""Item hashing: the pure arithmetic shared, bit for bit, with the Lua scripts.

An item hashes (mmh3, 128 bits, seeded per filter) into two independent parts:
``h`` (52 bits) picks the primary bucket as ``h mod m``; ``g`` (32 bits) gives the fingerprint,
whose width may differ per sub-filter. Both stay below 2**53 so Lua's doubles hold them exactly.

Every function works on one item's values (ints) or on a batch's (int64 numpy arrays), the
same code either way: ``hash_batch`` picks the form, by the batch's size. numpy is imported by
the batch functions when first called: one item's lookup (`guard check`) never waits for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat
from typing import TYPE_CHECKING, TypeAlias, TypeVar, cast

import mmh3

if TYPE_CHECKING:
    import numpy as np

Ints = TypeVar("Ints", int, "np.ndarray")
Hashes: TypeAlias = "list[tuple[int, int]] | np.ndarray"  # (h, g) per item: tuples, or (n, 2)

# Batches of this many items or more are hashed (and their reads planned) with numpy; below,
# numpy's fixed cost per call is more than the work (hashing and planning cost the same at
# about 12 items, measured; one item: 0.6 us as ints, 6.6 us through an array).
VECTOR_MIN = 16

H_MASK = (1 << 52) - 1
G_MASK = 0xFFFFFFFF
# A Mersenne prime: products below 2**53 reduced by it stay exact in Lua's doubles.
P31 = 2147483647


def to_bytes(item: str | bytes) -> bytes:
    if isinstance(item, bytes):
        return item
    if isinstance(item, str):
        return item.encode("utf-8")
    raise TypeError(f"items must be str or bytes, not {type(item).__name__}")


def item_hash(item: str | bytes, seed: int) -> tuple[int, int]:
    """Return ``(h, g)`` for an item under a filter's seed."""
    x = mmh3.hash128(to_bytes(item), seed, signed=False)
    return x & H_MASK, (x >> 64) & G_MASK


def item_hashes(items: Sequence[str | bytes], seed: int, shards: int = 0) -> np.ndarray:
    """``item_hash`` of many items at once: an ``(n, 2)`` int64 array of ``(h, g)`` rows, and
    with ``shards`` a third column, each item's ``shard_of`` (a bulk build splits by it). One C
    call per item gives the same hash as a little-endian digest (``h`` in its first word, ``g``
    and the shard bits in its second), masked as whole arrays: a third of ``item_hash``'s cost."""
    import numpy as np

    digest = mmh3.mmh3_x64_128_digest
    try:
        data = b"".join(map(digest, items, repeat(seed)))
    except TypeError:  # the digest takes bytes only: str items are UTF-8 encoded first
        try:
            encoded = list(map(str.encode, cast("Sequence[str]", items)))  # all str: fastest
        except TypeError:
            encoded = [to_bytes(x) for x in items]  # mixed; anything else is refused here
        data = b"".join(map(digest, encoded, repeat(seed)))
    words = np.frombuffer(data, dtype="<u8").reshape(-1, 2)
    rows = words & np.array([H_MASK, G_MASK], dtype=np.uint64)
    if shards:
        rows = np.column_stack([rows, (words[:, 1] >> np.uint64(32)) % np.uint64(shards)])
    return rows.astype(np.int64)


def hash_batch(items: Sequence[bytes], seed: int) -> Hashes:
    """``(h, g)`` of each item: an array from VECTOR_MIN items, tuples below."""
    if len(items) >= VECTOR_MIN:
        return item_hashes(items, seed)
    return [item_hash(x, seed) for x in items]


def flat(hashes: Hashes) -> list[int]:
    """``h1, g1, h2, g2, ...``: how the scripts take a batch's hashes."""
    if isinstance(hashes, list):  # tested as a list: an array's test would import numpy
        return [x for pair in hashes for x in pair]
    return hashes.ravel().tolist()  # type: ignore[no-any-return]


def fix_g(g: Ints, f0: int) -> Ints:
    """Force the top ``f0`` bits of ``g`` to be non-zero: every sub-filter's fingerprint is a
    prefix of the same ``g``, so none is 0 (0 marks an empty slot), and a match in a wide
    sub-filter implies a match in every narrower one."""
    low = 1 << (32 - f0)  # the lowest g whose top f0 bits are not all 0
    return g + (g < low) * low


def fingerprint(g_fixed: Ints, f: int) -> Ints:
    return g_fixed >> (32 - f)


def mix(p: Ints) -> Ints:
    """A non-linear hash of a fingerprint prefix, written to be exact in Lua 5.1 doubles
    (and in int64: every product stays below 2**53)."""
    x = p % P31
    x = (x * 1103515 + 12345) % P31
    x = (x * (x % 65521 + 1)) % P31
    x = (x * 1664525 + 1013904223) % P31
    return x


def buckets(h: Ints, mixed: Ints, m: int) -> tuple[Ints, Ints]:
    """An item's two buckets in a table of ``m``: ``h mod m`` and its alternate, where
    ``mixed`` is ``mix`` of its sub-filter-0 fingerprint (the same in every sub-filter)."""
    i1 = h % m
    return i1, (mixed - i1) % m


def alt_bucket(i: Ints, prefix: Ints, m: int) -> Ints:
    """The other bucket of a fingerprint: ``(H(fp) - i) mod m`` is its own inverse for any m."""
    return (mix(prefix) - i) % m


def shard_of(item: bytes, seed: int, shards: int) -> int:
    """The shard of an item in a sharded filter: bits 96..127 of the same hash, neither ``h``
    (0..51) nor ``g`` (64..95), so it says nothing of the item's buckets or fingerprint there."""
    return (mmh3.hash128(item, seed, signed=False) >> 96) % shards
