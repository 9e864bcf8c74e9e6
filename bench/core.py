"""The core benchmark: how full, how wrong, how big and how fast a guard filter is on real Redis.

Every figure comes from one run against one server, so the ratios (to GET, to theory, to the
paper) compare like with like. Keys live under a per-run prefix (bench/suite.py `Target`) and
are deleted at the end; nothing here flushes a database, because the server may be shared.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import redis

from bench.suite import Target
from guard import layout as fmt
from guard.errors import FilterFullError
from guard.filter import FilterInfo, SyncCuckooFilter
from guard.hashing import alt_bucket, fingerprint, fix_g, item_hash
from guard.layout import Layout
from guard.ops import insert_chunk
from guard.reads import ReadPlan

MAX_KICKS = 500
FP_BITS = 16
# Load at the first failed insert the cuckoo paper reports (Fan et al., CoNEXT 2014) for
# 500 kicks; guard aims at these. Bucket size 1 has no target, it is shown for information.
PAPER_LOAD = {2: 0.84, 4: 0.95, 8: 0.98}
FPR_TOLERANCE = 1.2
# The memory yardstick: 16-bit fingerprints in a b=4 table at the paper's 95 % load.
IDEAL_BITS = FP_BITS / 0.95
MEMORY_TARGET = 1.15
# The measurement of RedisBloom (CF.RESERVE, filled to failure) on this machine.
REDISBLOOM_REFERENCE = (
    (2, 0.47, 16.95, 0.0073),
    (4, 0.79, 10.12, 0.0246),
)
# Items insert_many sends per script call at MAX_KICKS (guard/filter.py's _insert_op rule);
# at a low load the script's work limit (guard/ops.py: KICK_BUDGET) lets it take them all.
INSERT_PER_CALL = insert_chunk(MAX_KICKS)


@dataclass(frozen=True)
class Scale:
    slots: int  # table size of the load-at-failure and false-positive fills
    seeds: int
    fit_capacities: tuple[int, ...]  # nominal capacities of the capacity-fit sweep
    # (largest capacity, seeds) tiers of the fit sweep: small tables vary most, so they get
    # many seeds; capacities past the last tier get one.
    fit_seeds: tuple[tuple[int, int], ...]
    fpr_lookups: tuple[int, int]  # (min, max) absent lookups per fingerprint width
    memory_points: int
    ops: int  # pipelined commands per throughput measurement
    loop_ops: int  # single blocking calls per throughput measurement
    repeats: int  # read-only throughput measurements are repeated; the median is kept


FULL = Scale(
    slots=100_000,
    seeds=5,
    fit_capacities=(100, 316, 1_000, 3_162, 10_000, 31_623, 100_000, 316_228, 1_000_000),
    fit_seeds=((1_000, 40), (10_000, 5)),
    fpr_lookups=(1_000_000, 4_000_000),
    memory_points=13,
    ops=20_000,
    loop_ops=5_000,
    repeats=5,
)
QUICK = Scale(
    slots=10_000,
    seeds=5,
    fit_capacities=(100, 316, 1_000, 3_162, 10_000),
    fit_seeds=((1_000, 20), (10_000, 3)),
    fpr_lookups=(100_000, 100_000),
    memory_points=13,
    ops=4_000,
    loop_ops=1_000,
    repeats=3,
)


# -- helpers -----------------------------------------------------------------------------------


def keys(tag: str, start: int, stop: int) -> list[str]:
    return [f"{tag}:{i}" for i in range(start, stop)]


def reserve_fixed(
    cf: SyncCuckooFilter, capacity: int, b: int, f: int = FP_BITS, **params: Any
) -> FilterInfo:
    """A fixed-size filter (expansion 0) kicking up to MAX_KICKS times: what every fill and
    timing here measures."""
    return cf.reserve(
        capacity, fingerprint_bits=f, bucket_size=b, max_kicks=MAX_KICKS, expansion=0, **params
    )


def fill(cf: SyncCuckooFilter, tag: str, batch: int = 20_000) -> int:
    """Insert distinct keys until the first failure; return how many went in before it.

    The order of items is fixed, and each insert's result depends only on the table and the
    item, so the count does not depend on how the items are batched.
    """
    added = 0
    while True:
        try:
            added += sum(cf.insert_many(keys(tag, added, added + batch)))
        except FilterFullError as full:
            return added + sum(full.results)


def fill_to(cf: SyncCuckooFilter, tag: str, start: int, stop: int, batch: int = 20_000) -> None:
    for a in range(start, stop, batch):
        cf.insert_many(keys(tag, a, min(stop, a + batch)))


def capacity_for_slots(slots: int, b: int) -> int:
    """The capacity whose table holds about ``slots`` slots (allocator slack adds some)."""
    return math.ceil(slots * fmt.TARGET_LOAD[b])


def slack(capacity: int, b: int, f: int = FP_BITS) -> float:
    """Room beyond what TARGET_LOAD asks for: 0 means ``capacity`` needs exactly that load."""
    return fmt.buckets_for(capacity, b, f) * b * fmt.TARGET_LOAD[b] / capacity - 1


def tight_capacity(nominal: int, b: int) -> int:
    """The capacity within 10 % of ``nominal`` with the least allocator slack: the worst case."""
    lo, hi = int(nominal * 0.9), int(nominal * 1.1)
    return min(range(lo, hi + 1, max(1, nominal // 2000)), key=lambda c: slack(c, b))


def theory_fpr(load: float, f: int, b: int) -> float:
    """Chance that an absent item matches one of the 2b slots it is compared with."""
    return 1 - (1 - load / (2**f - 1)) ** (2 * b)


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95 % Wilson score interval of a binomial proportion (good for small counts too)."""
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), centre + half


def memory_bytes(r: redis.Redis, cf: SyncCuckooFilter) -> int:
    subfilters = cf.info().subfilters
    return sum(int(r.memory_usage(cf.key(n), samples=0) or 0) for n in range(subfilters))


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def pow2_bytes(capacity: int, b: int = 2, f: int = 8) -> int:
    """RedisBloom's table for ``capacity`` by its sizing rule, rounded to a jemalloc class."""
    buckets = next_pow2(math.ceil(capacity / b))
    return fmt.allocator_size(buckets * b * f // 8)


def log_space(lo: int, hi: int, points: int) -> list[int]:
    return [round(lo * (hi / lo) ** (k / (points - 1))) for k in range(points)]


def each(fn: Callable[[Any], Any], items: list[Any]) -> None:
    for x in items:
        fn(x)


# -- 1. load at the first failed insert -------------------------------------------------------


@dataclass(frozen=True)
class FillRun:
    b: int
    capacity: int
    slots: int
    seed: int
    items: int  # inserted before the first failure
    # Only for runs that fell short of capacity: hops from the failed item's buckets to the
    # nearest free slot (the kick walk missed it), or None when no free slot is reachable.
    free_slot_hops: int | None = None

    @property
    def load(self) -> float:
        return self.items / self.slots

    @property
    def fit(self) -> float:
        return self.items / self.capacity

    @property
    def why_short(self) -> str:
        if self.fit >= 1:
            return ""
        if self.free_slot_hops is None:
            return "no free slot reachable"
        return f"free slot {self.free_slot_hops} hops away"


def read_table(r: redis.Redis, cf: SyncCuckooFilter, slots: int, f: int) -> list[int]:
    """Sub-filter 0's slots, decoded in one pass (layout.unpack_table is quadratic)."""
    data = r.get(cf.key(0)) or b""
    table = data[fmt.HEADER_BYTES : -1]
    bits = format(int.from_bytes(table, "big"), f"0{len(table) * 8}b")
    return [int(bits[k * f : (k + 1) * f], 2) for k in range(slots)]


def free_slot_hops(
    r: redis.Redis, cf: SyncCuckooFilter, failed: str, seed: int, buckets: int, b: int, f: int
) -> int | None:
    """Breadth-first search from the failed item's two buckets to a bucket with a free slot.

    From a full bucket, any of its prints may move to its other bucket: a reachable free slot
    means the random kick walk missed a path; none means the table was really stuck.
    """
    table = read_table(r, cf, buckets * b, f)
    h, g = item_hash(failed, seed)
    fp = fingerprint(fix_g(g, f), f)
    first = h % buckets
    start = {first, alt_bucket(first, fp, buckets)}
    hops, frontier = dict.fromkeys(start, 0), deque(start)
    while frontier:
        i = frontier.popleft()
        bucket = table[i * b : (i + 1) * b]
        if 0 in bucket:
            return hops[i]
        for print_ in bucket:
            j = alt_bucket(i, print_, buckets)  # one sub-filter: the prefix is the whole print
            if j not in hops:
                hops[j] = hops[i] + 1
                frontier.append(j)
    return None


def fill_run(target: Target, b: int, capacity: int, seed: int, f: int = FP_BITS) -> FillRun:
    cf = target.filter(f"fill-b{b}-f{f}-c{capacity}-s{seed}")
    info = reserve_fixed(cf, capacity, b, f, seed=seed)
    tag = f"in{seed}"
    try:
        items = fill(cf, tag)
        hops = None
        if items < capacity:
            failed = keys(tag, items, items + 1)[0]
            hops = free_slot_hops(target.r, cf, failed, seed, info.buckets, b, f)
    finally:
        cf.drop()
    return FillRun(b, capacity, info.buckets * b, seed, items, hops)


def measure_load(target: Target, s: Scale) -> list[FillRun]:
    return [
        fill_run(target, b, capacity_for_slots(s.slots, b), seed)
        for b in (1, 2, 4, 8)
        for seed in range(1, s.seeds + 1)
    ]


def measure_fit(target: Target, s: Scale) -> list[FillRun]:
    """Fill filters reserved at the tightest capacities: does ``capacity`` always fit?"""
    runs = []
    for b in (2, 4, 8):
        for nominal in s.fit_capacities:
            seeds = next((k for upto, k in s.fit_seeds if nominal <= upto), 1)
            capacity = tight_capacity(nominal, b)
            runs.extend(fill_run(target, b, capacity, seed) for seed in range(1, seeds + 1))
    return runs


# -- 2. false positives -----------------------------------------------------------------------


@dataclass(frozen=True)
class FprRun:
    f: int
    b: int
    load: float
    lookups: int
    false_positives: int

    @property
    def measured(self) -> float:
        return self.false_positives / self.lookups

    @property
    def theory(self) -> float:
        return theory_fpr(self.load, self.f, self.b)

    @property
    def ratio(self) -> float:
        return self.measured / self.theory

    @property
    def ratio_ci(self) -> tuple[float, float]:
        lo, hi = wilson(self.false_positives, self.lookups)
        return lo / self.theory, hi / self.theory


def measure_fpr(target: Target, s: Scale) -> list[FprRun]:
    b, seed = 4, 1
    runs = []
    for f in (8, 12, 16):
        cf = target.filter(f"fpr-f{f}")
        info = reserve_fixed(cf, capacity_for_slots(s.slots, b), b, f, seed=seed)
        try:
            items = fill(cf, "fpr")
            load = items / (info.buckets * b)
            # Enough lookups to expect ~200 false positives (a +-14 % 95 % interval), within
            # the scale's bounds; the interval is reported whatever the count.
            want = math.ceil(200 / theory_fpr(load, f, b))
            lookups = min(max(want, s.fpr_lookups[0]), s.fpr_lookups[1])
            hits = 0
            # Absent keys share no prefix with the inserted ones ("fpr:<i>").
            for a in range(0, lookups, 100_000):
                hits += sum(cf.lookup_many(keys("absent", a, min(lookups, a + 100_000))))
        finally:
            cf.drop()
        runs.append(FprRun(f, b, load, lookups, hits))
    return runs


# -- 3. memory --------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryRow:
    capacity: int
    slots: int
    used_bytes: int  # MEMORY USAGE, summed over sub-filter keys
    pow2_bytes: int  # RedisBloom's rule, computed
    redisbloom_bytes: int | None  # measured, only when the module is loaded

    @property
    def bits_per_item(self) -> float:
        return 8 * self.used_bytes / self.capacity

    @property
    def ratio(self) -> float:
        return self.bits_per_item / IDEAL_BITS

    @property
    def pow2_bits_per_item(self) -> float:
        return 8 * self.pow2_bytes / self.capacity


@dataclass(frozen=True)
class ErrorRateRow:
    error_rate: float
    expansion: int
    capacity: int
    fp_bits: int
    used_bytes: int
    load_at_capacity: float

    @property
    def bits_per_item(self) -> float:
        return 8 * self.used_bytes / self.capacity

    @property
    def lower_bound(self) -> float:
        return math.log2(1 / self.error_rate)

    @property
    def fpr_at_capacity(self) -> float:
        # For a growing filter this is sub-filter 0 only; its bound leaves room for the rest.
        return theory_fpr(self.load_at_capacity, self.fp_bits, 4)


def measure_memory(target: Target, s: Scale) -> list[MemoryRow]:
    rows = []
    for capacity in log_space(10_000, 1_000_000, s.memory_points):
        cf = target.filter(f"mem-{capacity}")
        info = reserve_fixed(cf, capacity, 4)
        try:
            used = memory_bytes(target.r, cf)
        finally:
            cf.drop()
        rb = None
        if target.redisbloom:
            key = f"{target.prefix}rb-{capacity}"
            target.r.execute_command("CF.RESERVE", key, capacity, "BUCKETSIZE", 2)
            rb = int(target.r.memory_usage(key, samples=0) or 0)
            target.r.delete(key)
        rows.append(MemoryRow(capacity, info.buckets * 4, used, pow2_bytes(capacity), rb))
    return rows


def measure_error_rates(target: Target) -> list[ErrorRateRow]:
    capacity, rows = 100_000, []
    for expansion in (0, 2):
        for eps in (1e-2, 1e-3, 1e-4):
            cf = target.filter(f"eps-{expansion}-{eps:g}")
            info = cf.reserve(capacity, error_rate=eps, bucket_size=4, expansion=expansion)
            try:
                used = memory_bytes(target.r, cf)
            finally:
                cf.drop()
            load = capacity / (info.buckets * 4)
            rows.append(ErrorRateRow(eps, expansion, capacity, info.fingerprint_bits, used, load))
    return rows


# -- 4. throughput ----------------------------------------------------------------------------

# Commands a client sends itself; commands scripts call (BITFIELD...) are counted in these too.
TOP_LEVEL = ("get", "evalsha", "bitfield_ro", "script|exists", "script|load")


@dataclass(frozen=True)
class Throughput:
    key: str  # what the reports look the row up by
    name: str
    items: int  # items (or commands) done
    seconds: float
    calls: dict[str, int]  # commandstats call deltas
    usec: dict[str, int]  # commandstats usec deltas
    expected_calls: dict[str, int]  # calls this client made, to spot other clients' traffic

    @property
    def per_second(self) -> float:
        return self.items / self.seconds

    @property
    def server_usec_per_item(self) -> float:
        return sum(self.usec.get(c, 0) for c in TOP_LEVEL) / self.items

    @property
    def bitfields_per_item(self) -> float:
        return self.calls.get("bitfield", 0) / self.items

    @property
    def foreign_calls(self) -> int:
        """Calls in the window that this client did not make (another client's traffic)."""
        return sum(max(0, self.calls.get(c, 0) - n) for c, n in self.expected_calls.items())


def commandstats(r: redis.Redis) -> dict[str, tuple[int, int]]:
    stats = r.info("commandstats")
    return {k.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"])) for k, v in stats.items()}


@dataclass(frozen=True)
class Case:
    key: str
    name: str
    items: int
    work: Callable[[], object]
    expected: dict[str, int]  # commands this client sends, per commandstats name


def measure_once(r: redis.Redis, case: Case) -> Throughput:
    before = commandstats(r)
    t0 = time.perf_counter()
    case.work()
    seconds = time.perf_counter() - t0
    after = commandstats(r)
    calls = {k: v[0] - before.get(k, (0, 0))[0] for k, v in after.items()}
    usec = {k: v[1] - before.get(k, (0, 0))[1] for k, v in after.items()}
    return Throughput(case.key, case.name, case.items, seconds, calls, usec, case.expected)


def measure_interleaved(r: redis.Redis, cases: list[Case], repeats: int) -> list[Throughput]:
    """Median of ``repeats`` timings per case, taking the cases in turn in every round.

    The machine and the server are shared, so load from elsewhere comes and goes; taking the
    cases in turn spreads it over all of them instead of one, which keeps the ratios honest.
    """
    for case in cases:
        case.work()  # warm-up: first-call costs (script cache, allocations) are not steady state
    rounds = [[measure_once(r, c) for c in cases] for _ in range(repeats)]
    medians = []
    for k in range(len(cases)):
        runs = sorted((rnd[k] for rnd in rounds), key=lambda t: t.seconds)
        medians.append(runs[len(runs) // 2])
    return medians


def pipelined(r: redis.Redis, total: int, depth: int, add: Callable[[Any, int], None]) -> list[Any]:
    replies: list[Any] = []
    for start in range(0, total, depth):
        pipe = r.pipeline(transaction=False)
        for i in range(start, min(total, start + depth)):
            add(pipe, i)
        replies.extend(pipe.execute())
    return replies


def measure_throughput(target: Target, s: Scale) -> list[Throughput]:
    r, b, seed = target.r, 4, 7
    depth = 100

    get_key = f"{target.prefix}get"
    r.set(get_key, b"x" * 16)
    one_sha = r.script_load("return 1")

    # The filter all filter measurements use: a fixed table, filled to 40 % before timing.
    cf = target.filter("tput")
    info = reserve_fixed(cf, capacity_for_slots(s.slots, b), b, seed=seed)
    slots = info.buckets * b
    fill_to(cf, "tput", 0, int(0.4 * slots))

    # The lookup read itself (one self-validating BITFIELD_RO per item, guard/reads.py), as a
    # pipelining client would send it. Commands are built before timing: this row is the
    # server and protocol cost alone.
    lay = Layout(b, FP_BITS, 0, 0, 1, MAX_KICKS, info.buckets, seed)
    plans = [ReadPlan(lay, [item_hash(k, seed)], cf.key) for k in keys("absent", 0, s.ops)]

    def raw_lookup(p: Any, i: int) -> None:
        p.execute_command("BITFIELD_RO", *plans[i].commands[0].args)

    # A header mismatch would make that row measure nothing useful: check once.
    first = pipelined(r, depth, depth, raw_lookup)
    for plan, reply in zip(plans, first, strict=False):
        plan.evaluate([reply])

    loop_keys = keys("absent", 0, s.loop_ops)
    cases = [
        Case(
            "get",
            f"GET, pipelines of {depth}",
            s.ops,
            lambda: pipelined(r, s.ops, depth, lambda p, _i: p.get(get_key)),
            {"get": s.ops},
        ),
        Case(
            "evalsha",
            f"EVALSHA `return 1`, pipelines of {depth}",
            s.ops,
            lambda: pipelined(r, s.ops, depth, lambda p, _i: p.evalsha(one_sha, 0)),
            {"evalsha": s.ops},
        ),
        Case(
            "lookup_read",
            f"lookup read, 1 item per BITFIELD_RO, pipelines of {depth}",
            s.ops,
            lambda: pipelined(r, s.ops, depth, raw_lookup),
            {"bitfield_ro": s.ops},
        ),
        Case(
            "lookup",
            "cf.lookup(), one call at a time",
            s.loop_ops,
            lambda: each(cf.lookup, loop_keys),
            {"bitfield_ro": s.loop_ops},
        ),
    ]
    for batch in (100, 1000):
        total = max(batch, s.ops * 5 // batch * batch)
        batches = [keys("absent", a, a + batch) for a in range(0, total, batch)]
        cases.append(
            Case(
                f"lookup_many_{batch}",
                f"cf.lookup_many(), batches of {batch}",
                total,
                lambda bs=batches: each(cf.lookup_many, bs),
                {
                    "bitfield_ro": len(batches)
                    * len(ReadPlan(lay, [(0, 0)] * batch, cf.key).commands)
                },
            )
        )
    results = measure_interleaved(r, cases, s.repeats)

    # Inserts change the filter, so they run once: from 40 % to 60 % load (50 % on average).
    start, stop = int(0.4 * slots), int(0.6 * slots)
    insert_batches = [keys("tput", a, min(stop, a + 1000)) for a in range(start, stop, 1000)]
    results.append(
        measure_once(
            r,
            Case(
                "insert_many_1000",
                "cf.insert_many(), batches of 1000, load 40 -> 60 %",
                stop - start,
                lambda: each(cf.insert_many, insert_batches),
                {"evalsha": sum(math.ceil(len(x) / INSERT_PER_CALL) for x in insert_batches)},
            ),
        )
    )
    single = keys("tput", stop, stop + s.loop_ops)
    results.append(
        measure_once(
            r,
            Case(
                "insert",
                "cf.insert(), one call at a time, load ~60 %",
                len(single),
                lambda: each(cf.insert, single),
                {"evalsha": len(single)},
            ),
        )
    )
    cf.drop()
    r.delete(get_key)
    return results


# -- grouping ----------------------------------------------------------------------------------


def iter_groups(runs: list[FillRun]) -> Iterator[tuple[tuple[int, int], list[FillRun]]]:
    """FillRuns grouped by (bucket size, capacity), in first-seen order."""
    groups: dict[tuple[int, int], list[FillRun]] = {}
    for run_ in runs:
        groups.setdefault((run_.b, run_.capacity), []).append(run_)
    yield from groups.items()


def median(values: list[float]) -> float:
    return statistics.median(values)
