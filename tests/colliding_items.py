"""Two items a filter cannot tell apart: same fingerprint, same bucket pair, found with the
library's own hashing for a known seed."""

from __future__ import annotations

from guard import hashing
from guard.layout import Layout
from guard.params import FilterParams

# A small, fixed-size, seeded filter: 8-bit fingerprints make a collision quick to find.
PARAMS: dict[str, int] = {"fingerprint_bits": 8, "bucket_size": 4, "expansion": 0, "seed": 7}
CAPACITY = 1000


def layout() -> Layout:
    return FilterParams(capacity=CAPACITY, **PARAMS).layout()


def colliding_pair(lay: Layout | None = None) -> tuple[str, str]:
    """Two distinct items with the same (primary bucket, fingerprint) in the first sub-filter,
    hence the same alternate bucket too."""
    lay = lay or layout()
    seen: dict[tuple[int, int], str] = {}
    for n in range(1_000_000):
        item = f"item-{n}"
        h, g = hashing.item_hash(item, lay.seed)
        fp = hashing.fingerprint(hashing.fix_g(g, lay.fp_bits), lay.fp_bits)
        slot = (h % lay.buckets0, fp)
        if slot in seen:
            return seen[slot], item
        seen[slot] = item
    raise AssertionError("no collision found")
