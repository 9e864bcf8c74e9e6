"""The core benchmark's two figures, drawn with matplotlib's file-only Agg backend."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display on servers and CI; must precede pyplot

import matplotlib.pyplot as plt

from bench import core
from guard import layout

MEMORY_PNG = "bench-core-memory.png"
LOAD_PNG = "bench-core-load.png"


def memory(rows: list[core.MemoryRow], path: Path) -> None:
    caps = [r.capacity for r in rows]
    pow2_slots = [core.next_pow2(-(-c // 2)) * 2 / c for c in caps]
    fig, (bits, slots) = plt.subplots(1, 2, figsize=(11, 4.2))
    bits.plot(caps, [r.bits_per_item for r in rows], "o-", label="guard, f=16, b=4 (MEMORY USAGE)")
    bits.plot(
        caps, [r.pow2_bits_per_item for r in rows], "s--", label="pow2 rule, f=8, b=2 (computed)"
    )
    if any(r.redisbloom_bytes for r in rows):
        bits.plot(
            caps,
            [8 * (r.redisbloom_bytes or 0) / r.capacity for r in rows],
            "^:",
            label="RedisBloom (MEMORY USAGE)",
        )
    bits.axhline(core.IDEAL_BITS, color="grey", lw=1, label="16 bits at 95 % load")
    bits.axhline(
        core.IDEAL_BITS * core.MEMORY_TARGET, color="grey", lw=1, ls=":", label="target (x1.15)"
    )
    bits.set_ylabel("bits per requested item")
    bits.set_ylim(bottom=0)
    bits.set_title("Memory per item at the requested capacity")
    # The two schemes use different fingerprint widths; table slots per item compares sizing.
    slots.plot(caps, [r.slots / r.capacity for r in rows], "o-", label="guard")
    slots.plot(caps, pow2_slots, "s--", label="pow2 rule (computed)")
    slots.axhline(1 / 0.95, color="grey", lw=1, label="1 / 0.95")
    slots.set_ylabel("table slots per requested item")
    slots.set_ylim(0, max(2.2, *pow2_slots))
    slots.set_title("Sizing overhead, independent of fingerprint width")
    for ax in (bits, slots):
        ax.set_xscale("log")
        ax.set_xlabel("requested capacity (items)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def load(runs: list[core.FillRun], path: Path) -> None:
    sizes = sorted({r.b for r in runs})
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for x, b in enumerate(sizes):
        loads = [r.load for r in runs if r.b == b]
        ax.scatter([x] * len(loads), loads, color="C0", alpha=0.6, zorder=3)
        ax.hlines(core.median(loads), x - 0.25, x + 0.25, color="C0", lw=2, zorder=3)
        if b in core.PAPER_LOAD:
            ax.hlines(core.PAPER_LOAD[b], x - 0.3, x + 0.3, color="C3", ls="--")
        ax.hlines(layout.TARGET_LOAD[b], x - 0.3, x + 0.3, color="C2", ls=":")
    # Legend entries drawn once, off the data.
    ax.plot([], [], "o", color="C0", label="seeds (bar: median)")
    ax.plot([], [], "--", color="C3", label="paper target")
    ax.plot([], [], ":", color="C2", label="guard TARGET_LOAD")
    ax.set_xticks(range(len(sizes)), [f"b={b}" for b in sizes])
    ax.set_ylabel("load factor at first failed insert")
    ax.set_title("Load at first failure (f=16, 500 kicks, fixed size)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(results: dict[str, Any], folder: Path) -> None:
    """Every figure whose section was measured, into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    if "memory" in results:
        memory(results["memory"], folder / MEMORY_PNG)
    if "load" in results:
        load(results["load"], folder / LOAD_PNG)
