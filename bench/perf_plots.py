"""The figures of `python -m bench perf`, drawn with matplotlib's file-only Agg backend."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display on servers and CI; must precede pyplot

import matplotlib.pyplot as plt

from bench import core

COST_PNG = "perf-server-cost.png"
HTTP_PNG = "perf-http.png"
ACCURACY_PNG = "perf-accuracy.png"
SCALING_PNG = "perf-scaling.png"


def server_cost(rows: list[Any], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(9, 4.8))
    ys = range(len(rows))
    ax.barh(
        [y - 0.2 for y in ys], [r.usec_per_item for r in rows], 0.4, label="commandstats us/item"
    )
    ax.barh(
        [y + 0.2 for y in ys], [r.cpu_usec_per_item for r in rows], 0.4, label="INFO cpu us/item"
    )
    ax.set_yticks(list(ys), [r.name for r in rows])
    ax.set_xscale("log")
    ax.invert_yaxis()
    ax.set_xlabel("server microseconds per item (log)")
    ax.set_title("Server cost per operation")
    ax.grid(True, axis="x", which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def http(results: dict[str, list[Any]], path: Path) -> None:
    rows = results["main"] + results["batching"]
    labels = [f"{w.label} (c={w.connections})" for w in rows]
    fig, (rps, p99) = plt.subplots(1, 2, figsize=(13, 5.5), sharey=True)
    rps.barh(labels, [w.rps for w in rows], color="C0")
    rps.set_xlabel("requests/s")
    p99.barh(labels, [w.p99_ms for w in rows], color="C3")
    p99.set_xlabel("p99 latency, ms")
    rps.invert_yaxis()
    for ax in (rps, p99):
        ax.grid(True, axis="x", alpha=0.3)
    fig.suptitle("HTTP, one uvicorn worker (wrk)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def accuracy(rows: list[Any], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.8))
    for b, marker in ((2, "o"), (4, "s"), (8, "^")):
        pts = [r for r in rows if r.b == b]
        ax.plot(
            [r.measured or r.theory for r in pts],
            [r.bits_per_item for r in pts],
            marker,
            label=f"guard b={b} (f=8/12/16)",
        )
    for b, _load, bits, fpr in core.REDISBLOOM_REFERENCE:
        ax.plot([fpr], [bits], "kx", ms=9)
        ax.annotate(
            f"RedisBloom b={b}", (fpr, bits), textcoords="offset points", xytext=(5, 5), fontsize=8
        )
    xs = [10 ** (-k / 10) for k in range(6, 60)]
    ax.plot(xs, [math.log2(1 / x) for x in xs], "--", color="grey", label="lower bound log2(1/eps)")
    ax.set_xscale("log")
    ax.set_xlabel("false-positive rate (measured)")
    ax.set_ylabel("bits per item stored")
    ax.set_title("Space vs accuracy, filled to first failure")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def scaling(rows: list[Any], path: Path) -> None:
    xs = [r.items for r in rows]
    fig, (cost, mem) = plt.subplots(1, 2, figsize=(11, 4.2))
    cost.plot(xs, [r.single_usec for r in rows], "o-", label="lookup, server us/call")
    cost.plot(
        xs, [r.batched_usec_per_item for r in rows], "s-", label="lookup_many, server us/item"
    )
    cost.plot(
        xs,
        [r.p50_ms * 1000 / 100 for r in rows],
        "^:",
        label="cf.lookup() p50 round trip (x100 us)",
    )
    cost.set_ylim(bottom=0)
    cost.set_title("Lookup cost vs filter size")
    mem.plot(xs, [r.memory_bytes / 2**20 for r in rows], "o-")
    mem.set_yscale("log")
    mem.set_ylabel("MiB (MEMORY USAGE)")
    mem.set_title("Memory, error_rate 0.001")
    for ax in (cost, mem):
        ax.set_xscale("log")
        ax.set_xlabel("items")
        ax.grid(True, which="both", alpha=0.3)
    cost.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(results: dict[str, Any], folder: Path) -> None:
    """Every figure whose section was measured, into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    if results.get("server_cost"):
        server_cost(results["server_cost"], folder / COST_PNG)
    if results.get("http"):
        http(results["http"], folder / HTTP_PNG)
    if results.get("accuracy"):
        accuracy(results["accuracy"], folder / ACCURACY_PNG)
    if results.get("scaling"):
        scaling(results["scaling"], folder / SCALING_PNG)
