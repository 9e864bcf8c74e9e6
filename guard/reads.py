"""Script-free lookups: one BITFIELD_RO per sub-filter reads the header and the buckets.

A lookup only reads, and one Redis command is atomic by itself, so no script is needed: each
command carries the header fields, the trailer and the item's two buckets, and is checked here
exactly as the scripts check a header (docs/format.md). Every command validates itself, so a
chunked batch cannot mix two layouts; several sub-filters are read in one MULTI.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from guard import hashing
from guard import layout as fmt
from guard.layout import Layout

# (type, bit offset) of the header fields sub-filter 0 is checked by, in Layout.args() order
# after magic: bucket_size, fp_bits, fp_step, expansion, subfilters, max_kicks, buckets0, seed,
# then the version.
_HEADER0 = (
    ("u32", 0),
    ("u8", 40),
    ("u8", 48),
    ("u8", 56),
    ("u8", 64),
    ("u8", 72),
    ("u16", 128),
    ("u32", 96),
    ("u32", 160),
    ("u8", 32),
)
_HEADER_N = (("u32", 0), ("u8", 80))
MAX_GETS = 2000


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
        per_command = max(1, (MAX_GETS - len(_HEADER0) - 1) // (2 * b))
        fixed = [(h, hashing.fix_g(g, layout.fp_bits)) for h, g in hashes]
        self.commands: list[_Command] = []
        for n in range(layout.subfilters):
            m, f = layout.buckets(n), layout.fp_bits_at(n)
            ftype = f"u{f}"
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
                    fp = hashing.fingerprint(g, f)
                    i1 = h % m
                    i2 = hashing.alt_bucket(i1, hashing.fingerprint(g, layout.fp_bits), m)
                    fps.append(fp)
                    for i in (i1, i2):
                        base = fmt.HEADER_BYTES * 8 + i * b * f
                        for s in range(b):
                            args += ("GET", ftype, base + s * f)
                self.commands.append(_Command(n, idx, fps, args))

    def evaluate(self, replies: Sequence[Sequence[int]]) -> list[bool]:
        """Results per item; raises Stale or BadHeader when a header check fails."""
        found = [False] * self.count
        width = 2 * self.layout.bucket_size
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
            for j, (k, fp) in enumerate(zip(cmd.items, cmd.fps, strict=True)):
                if not found[k]:
                    slots = reply[skip + j * width : skip + (j + 1) * width]
                    found[k] = fp in slots
        return found

    def _check_header0(self, key: str, reply: Sequence[int]) -> None:
        if reply[0] != fmt.MAGIC:
            raise BadHeader(key, f"bad magic in {key}")
        if reply[9] != fmt.VERSION:
            raise BadHeader(key, "unsupported format version")
        stored = [int(x) for x in reply[1:9]]
        if stored != self.layout.args():
            raise Stale(Layout(*stored))
        if reply[len(_HEADER0)] != fmt.TRAILER:
            raise BadHeader(key, f"truncated: {key}")
