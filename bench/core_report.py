"""Markdown for the core benchmark: one table per section, verdicts, and the whole report."""

from __future__ import annotations

from typing import Any

from bench import core
from bench.markdown import n, pct, table, verdict
from bench.suite import Measured, environment_table, generated_by
from guard import layout


def spread(values: list[float], digits: int = 3) -> str:
    return f"{core.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


# -- verdicts, shared by the tables and the summary -------------------------------------------


def load_verdicts(runs: list[core.FillRun]) -> dict[int, tuple[float, bool]]:
    out = {}
    for b, target in core.PAPER_LOAD.items():
        loads = [r.load for r in runs if r.b == b]
        out[b] = (core.median(loads), core.median(loads) >= target)
    return out


def fpr_ok(run: core.FprRun) -> bool:
    return 1 / core.FPR_TOLERANCE <= run.ratio <= core.FPR_TOLERANCE


def fpr_verdict(run: core.FprRun) -> str:
    """met / NOT met; inconclusive when too few false positives were seen to tell."""
    if fpr_ok(run):
        return verdict(True)
    low, high = run.ratio_ci
    if low <= core.FPR_TOLERANCE and high >= 1 / core.FPR_TOLERANCE:
        return "inconclusive (too few lookups: the 95 % interval overlaps the target)"
    return verdict(False)


def memory_verdict(rows: list[core.MemoryRow]) -> tuple[float, float, bool]:
    ratios = [r.ratio for r in rows]
    mean = sum(ratios) / len(ratios)
    # "Never near 2x": no single capacity may cost as much as power-of-two rounding can.
    return mean, max(ratios), mean <= core.MEMORY_TARGET and max(ratios) < 1.5


def worst_fit(runs: list[core.FillRun]) -> core.FillRun:
    return min(runs, key=lambda r: r.fit)


# -- sections ---------------------------------------------------------------------------------


def memory_table(rows: list[core.MemoryRow]) -> str:
    live = any(r.redisbloom_bytes is not None for r in rows)
    headers = [
        "capacity",
        "slots",
        "MEMORY USAGE (bytes)",
        "bits/item",
        "ratio to 16/0.95",
        "slots/item",
        "pow2 rule bytes (computed)",
        "pow2 bits/item (computed)",
        "pow2 slots/item (computed)",
    ]
    if live:
        headers.append("RedisBloom MEMORY USAGE (measured)")
    body = []
    for r in rows:
        pow2_slots = core.next_pow2(-(-r.capacity // 2)) * 2
        row = [
            n(r.capacity),
            n(r.slots),
            n(r.used_bytes),
            f"{r.bits_per_item:.2f}",
            f"{r.ratio:.3f}",
            f"{r.slots / r.capacity:.3f}",
            n(r.pow2_bytes),
            f"{r.pow2_bits_per_item:.2f}",
            f"{pow2_slots / r.capacity:.3f}",
        ]
        if live:
            row.append(n(r.redisbloom_bytes or 0))
        body.append(row)
    mean, worst, ok = memory_verdict(rows)
    sentence = (
        f"\nMean ratio to {core.IDEAL_BITS:.2f} bits/item: **{mean:.3f}** (target <= "
        f"{core.MEMORY_TARGET}), worst {worst:.3f} (must stay well below 2): {verdict(ok)}."
    )
    return table(headers, body) + "\n" + sentence


def reference_table() -> str:
    rows = [
        [b, f"{load:.2f}", f"{bits:.2f}", pct(fpr)]
        for b, load, bits, fpr in core.REDISBLOOM_REFERENCE
    ]
    return table(["bucket size", "load at failure", "bits/item", "FPR"], rows)


def error_rate_table(rows: list[core.ErrorRateRow]) -> str:
    body = [
        [
            f"{r.error_rate:g}",
            "fixed (0)" if r.expansion == 0 else f"growing ({r.expansion})",
            r.fp_bits,
            f"{r.bits_per_item:.2f}",
            f"{r.lower_bound:.2f}",
            f"{r.bits_per_item / r.lower_bound:.2f}",
            f"{r.load_at_capacity:.3f}",
            f"{r.fpr_at_capacity:.2e}",
        ]
        for r in rows
    ]
    headers = [
        "error_rate",
        "expansion",
        "fingerprint bits",
        "bits/item (MEMORY USAGE)",
        "lower bound log2(1/eps)",
        "ratio",
        "load at capacity",
        "theory FPR at capacity",
    ]
    return table(headers, body)


def load_table(runs: list[core.FillRun]) -> str:
    verdicts = load_verdicts(runs)
    body = []
    for (b, capacity), group in core.iter_groups(runs):
        target = core.PAPER_LOAD.get(b)
        body.append(
            [
                b,
                n(group[0].slots),
                n(capacity),
                len(group),
                spread([r.load for r in group]),
                f">= {target}" if target else "(info)",
                verdict(verdicts[b][1]) if target else "-",
                f"{layout.TARGET_LOAD[b]}",
                spread([r.fit for r in group]),
                short_reasons(group) or "-",
            ]
        )
    headers = [
        "bucket size",
        "slots",
        "capacity",
        "seeds",
        "load at 1st failure: median (min-max)",
        "paper",
        "verdict",
        "TARGET_LOAD",
        "items / capacity: median (min-max)",
        "runs short of capacity: seed, load, why",
    ]
    return table(headers, body)


def short_reasons(runs: list[core.FillRun]) -> str:
    return "; ".join(f"s{r.seed} {r.load:.3f}: {r.why_short}" for r in runs if r.fit < 1)


def fit_table(runs: list[core.FillRun]) -> str:
    body = []
    for (b, capacity), group in core.iter_groups(runs):
        fits = [r.fit for r in group]
        body.append(
            [
                b,
                n(capacity),
                n(group[0].slots),
                pct(core.slack(capacity, b), 2),
                len(group),
                f"{min(fits):.3f}",
                f"{core.median(fits):.3f}",
                spread([r.load for r in group]),
                "yes" if min(fits) >= 1 else f"**NO** ({sum(f < 1 for f in fits)} short)",
                short_reasons(group) or "-",
            ]
        )
    headers = [
        "bucket size",
        "capacity",
        "slots",
        "slack",
        "seeds",
        "items/capacity min",
        "median",
        "load at failure",
        "capacity fits",
        "short runs: seed, load, why",
    ]
    return table(headers, body)


def fpr_table(runs: list[core.FprRun]) -> str:
    body = []
    for r in runs:
        lo, hi = r.ratio_ci
        body.append(
            [
                r.f,
                r.b,
                f"{r.load:.4f}",
                n(r.lookups),
                n(r.false_positives),
                f"{r.measured:.3e}",
                f"{r.theory:.3e}",
                f"{r.ratio:.3f}",
                f"{lo:.2f}-{hi:.2f}",
                fpr_verdict(r),
            ]
        )
    headers = [
        "fingerprint bits",
        "bucket size",
        "load",
        "absent lookups",
        "false positives",
        "measured FPR",
        "theory 1-(1-load/(2^f-1))^(2b)",
        "ratio",
        "95 % interval of ratio",
        f"within {core.FPR_TOLERANCE}x",
    ]
    return table(headers, body)


def get_rate(rows: list[core.Throughput]) -> float:
    """Items/s of the pipelined GET row: the yardstick of every other row."""
    return {t.key: t for t in rows}["get"].per_second


def throughput_table(rows: list[core.Throughput]) -> str:
    base = get_rate(rows)
    body = [
        [
            t.name,
            n(t.items),
            f"{t.per_second:,.0f}",
            f"{t.per_second / base:.3f}",
            f"{t.server_usec_per_item:.2f}",
            f"{t.calls.get('evalsha', 0) / t.items:.3f}",
            f"{t.bitfields_per_item:.2f}",
            n(t.foreign_calls),
        ]
        for t in rows
    ]
    headers = [
        "operation",
        "items",
        "items/s",
        "ratio to GET",
        "server us/item",
        "EVALSHA/item",
        "BITFIELD/item",
        "other clients' calls",
    ]
    return table(headers, body)


TITLES = {
    "memory": "Memory as Redis allocates it (b=4, 16-bit fingerprints, expansion=0)",
    "error_rates": "Sizing by error_rate (capacity 100,000, b=4)",
    "load": "Load factor at the first failed insert (expansion=0, max_kicks=500, f=16)",
    "fit": "Does `capacity` fit? Tightest capacities (least allocator slack), filled to failure",
    "fpr": "False-positive rate of a filter filled to failure (b=4)",
    "throughput": "Throughput, one Python process, real Redis",
}
RENDER = {
    "memory": memory_table,
    "error_rates": error_rate_table,
    "load": load_table,
    "fit": fit_table,
    "fpr": fpr_table,
    "throughput": throughput_table,
}


def section(name: str, data: Any) -> str:
    return f"\n## {TITLES[name]}\n\n{RENDER[name](data)}\n"


def summary_lines(results: dict[str, Any]) -> list[str]:
    lines = []
    if "load" in results:
        for b, (load, ok) in load_verdicts(results["load"]).items():
            lines.append(
                f"Load at first failure, b={b}: median {load:.3f} vs paper "
                f">= {core.PAPER_LOAD[b]}: {verdict(ok)}"
            )
    if "fit" in results:
        runs = results["fit"] + results.get("load", [])
        # b=1 has no target load and no promise; it is reported apart.
        for label, group in (
            ("b=2, 4, 8", [r for r in runs if r.b in core.PAPER_LOAD]),
            ("b=1 (info)", [r for r in runs if r.b not in core.PAPER_LOAD]),
        ):
            if not group:
                continue
            w = worst_fit(group)
            fits = all(r.fit >= 1 for r in group)
            lines.append(
                f"`capacity` items fit in a fixed filter, {label}, every run: "
                f"{'yes' if fits else '**NO**'} (worst: b={w.b}, capacity {n(w.capacity)}, "
                f"seed {w.seed}: {w.fit:.3f} of capacity)"
            )
    for r in results.get("fpr", []):
        lines.append(
            f"FPR f={r.f}, b={r.b}: {r.measured:.3e} vs theory {r.theory:.3e}, ratio "
            f"{r.ratio:.3f} (95 % {r.ratio_ci[0]:.2f}-{r.ratio_ci[1]:.2f}): "
            f"within {core.FPR_TOLERANCE}x {fpr_verdict(r)}"
        )
    if "memory" in results:
        mean, worst, ok = memory_verdict(results["memory"])
        lines.append(
            f"Memory: mean {mean:.3f}x of {core.IDEAL_BITS:.2f} bits/item (target <= "
            f"{core.MEMORY_TARGET}), worst {worst:.3f}x: {verdict(ok)}"
        )
    if "throughput" in results:
        rows = results["throughput"]
        base = get_rate(rows)
        for t in rows:
            if t.key == "get":
                continue
            lines.append(f"{t.name}: {t.per_second:,.0f} items/s ({t.per_second / base:.2f}x GET)")
    return lines


def summary(results: dict[str, Any]) -> str:
    return "\n## Summary\n\n" + "\n".join(f"- {x}" for x in summary_lines(results))


ABOUT = {
    "memory": """\
`MEMORY USAGE key SAMPLES 0` summed over the filter's keys, after `reserve(capacity,
fingerprint_bits=16, bucket_size=4, expansion=0)`; bits/item is `8 * bytes / capacity` at the
requested capacity, and the ratio compares it with 16 bits at 95 % load. The *pow2 rule*
columns are **computed, not measured**: RedisBloom's sizing (buckets =
next_pow2(ceil(capacity / 2)), 8-bit fingerprints, 2 slots a bucket) rounded to the same jemalloc
size class. Its fingerprints are half as wide, so *slots/item* is the like-for-like column: the
table space each scheme reserves per requested item. guard's saw-tooth is jemalloc's size
classes (four per doubling): the table is widened to fill its class, so the extra bytes are
slots (a lower load and false-positive rate), not waste; the power-of-two rule swings from
1x to 2x of the items asked for.""",
    "error_rates": """\
The fingerprint width `reserve(error_rate=...)` chooses, the memory it costs per requested item,
and the information-theoretic lower bound log2(1/eps) bits/item. *Theory FPR at capacity* is
the false-positive rate the formula gives once `capacity` items are in (sub-filter 0 only for a
growing filter, whose extra bit pays for the sub-filters it may add).""",
    "load": """\
Each filter is reserved with `capacity = ceil(slots * TARGET_LOAD[b])` for about {slots:,} slots
(allocator slack adds some), then filled with distinct keys by `insert_many` until the first
`FilterFullError`; `FilterFullError.results` tells how many were added. Load = items / slots.
The paper figures (Fan et al., CoNEXT 2014, 500 kicks) are the targets; b=1 is for information.
The last column is the fraction of the requested `capacity` that went in before the failure.""",
    "fit": """\
The sizing divides capacity by `TARGET_LOAD[b]` and then widens the table to fill its jemalloc
size class, so the room beyond `capacity` ranges from 0 to ~25 %. These capacities were chosen,
near each nominal size, to leave the *least* slack: the worst case for "capacity items fit".
Small tables vary most, so they get more seeds: {tiers}; larger ones, one seed. For a run
that fell short, a breadth-first search over the final table tells why: *free slot N hops away*
means a path existed that the random kick walk (max_kicks=500) did not find; *no free slot
reachable* means the buckets the item could reach were all full, which only more room fixes.""",
    "fpr": """\
The `b=4` filter is filled to failure, then `lookup_many` asks for keys never inserted. The
number of lookups aims at ~200 expected false positives (bounded by the run's scale); the 95 %
interval (Wilson) of the measured/theory ratio is shown so a small count is read honestly.""",
    "throughput": """\
One Python process, redis-py with hiredis, server on the same 2-CPU machine (so client and
server compete for it, and other work on the machine shows up as noise). Read-only rows are
the median of {repeats} timings, the rows taken in turn in each round after one warm-up; insert
rows run once (they change the filter). Items/s counts items (commands for the GET and EVALSHA
rows); *ratio to GET* divides by the pipelined GET row. Pipelined GET and `return 1` are bound
by redis-py's per-command Python cost, not by the server, so they land close to each other.
*Server us/item* is the change in `INFO commandstats` usec of GET, EVALSHA, BITFIELD_RO and
SCRIPT EXISTS over the window (commands a script calls are inside its EVALSHA time), divided by
items. The server is shared, so *other clients' calls* counts calls in the window this process
did not make: non-zero means the server columns include a little of someone else's work. The
lookup-read row sends the library's own lookup read (one self-validating BITFIELD_RO,
guard/reads.py) per item, built before timing; the `cf.*` rows include hashing and the
library's Python. The filter has {tput_slots:,} slots, b=4, 16-bit fingerprints, 40 % full
before the timed rows; lookups are of absent keys.""",
}


def document(m: Measured, *, env: dict[str, str], redisbloom: bool, scale: core.Scale) -> str:
    results, s = m.results, scale
    # The throughput filter's table: the same sizing measure_throughput() reserves.
    tput_slots = layout.buckets_for(core.capacity_for_slots(s.slots, 4), 4, core.FP_BITS) * 4
    about = {
        k: v.format(
            slots=s.slots,
            seeds=s.seeds,
            tiers=", ".join(f"{k} up to capacity {upto:,}" for upto, k in s.fit_seeds),
            repeats=s.repeats,
            tput_slots=tput_slots,
        )
        for k, v in ABOUT.items()
    }
    parts = [
        "# guard core benchmark",
        "",
        generated_by("core", m),
        summary(results),
        "",
        "## How to reproduce",
        "",
        "```sh",
        "pip install -e '.[dev]'            # redis[hiredis], mmh3, matplotlib",
        "python -m bench core                # full run (~5 min): writes this file and docs/img/",
        "python -m bench core --quick        # smoke run (<1 min): prints, writes nothing",
        "python -m bench core --redis-url redis://host:6379/13 --out /tmp/bench.md",
        "# measure exactly the committed guard while guard/ is being edited:",
        "git archive HEAD guard | tar -x -C /tmp/snap && cd /tmp &&",
        "  PYTHONPATH=/tmp/snap:$REPO python -m bench core --out $REPO/docs/bench-core.md",
        "```",
        "",
        "Keys go under a per-run prefix (`bench:core:<pid>-<random>:`) in the URL's database "
        "(default 13) and are deleted at the end; nothing is flushed.",
        "",
        "## Environment",
        "",
        environment_table(
            env,
            m,
            RedisBloom="loaded (its live column is measured)"
            if redisbloom
            else "not loaded on this server (`MODULE LIST`), so no RedisBloom column is "
            "measured live",
        ),
    ]
    for name in ("load", "fit", "fpr", "memory", "error_rates", "throughput"):
        if name not in results:
            continue
        parts += [section(name, results[name]).rstrip(), "", about[name]]
        if name == "memory":
            parts += [
                "",
                "![bits per item vs capacity](img/bench-core-memory.png)",
                "",
                "The issue's reference measurement of RedisBloom on this machine (filled to "
                "failure; quoted, not measured by this run):",
                "",
                reference_table(),
            ]
        if name == "load":
            parts += ["", "![load at first failure](img/bench-core-load.png)"]
    parts.append("")
    return "\n".join(parts)
