"""`python -m bench mutations`: what each mutation script costs Redis, against a floor, in one run.

Our filter (b=4, f=16, fixed size, max_kicks 500) and the floor (bench/floor.lua: the least a
Lua/BITFIELD cuckoo filter of the same geometry does) are filled to the same load, side by
side on the same server; then insert, insert_many, delete and delete_many run at 50 % and
90 % load, each op's window for ours right beside the floor's (which goes first alternates),
several rounds. The figure is the server's main-thread CPU per item (INFO cpu: the thread
that runs scripts; not commandstats, which counts time the thread was descheduled, on a
machine shared by other processes); the ratio is the median of the rounds' ratios.

Then, at 95 % load, every script call of single and batched inserts and deletes is timed
alone: main-thread CPU between two INFO calls, less the same pair's cost with nothing between;
and client-side wall time, which also counts any wait for a CPU on a shared machine. The
worst call seen is the figure. Last, the cost of one kick step, from inserts that fail in a
full table (each takes max_kicks steps and changes nothing), from which guard/ops.py's
KICK_BUDGET is calibrated; and a failing insert at the largest max_kicks a filter may have:
one item's own chain, the least a call can be cut to.

The pipeline (bench/suite.py) gives the server: a private redis-server unless --redis-url.
``measure(target, quick)`` returns the rows, ``report(rows)`` the markdown.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from bench import core
from bench.markdown import f2, table, verdict
from bench.suite import Target
from guard import FilterFullError, SyncCuckooFilter
from guard.hashing import item_hash
from guard.layout import MAX_KICKS_LIMIT
from guard.ops import BATCH_CHUNK, INSERT_CHUNK, KICK_BUDGET

B, F, MAX_KICKS, SEED = 4, 16, core.MAX_KICKS, 11
BATCH = 100  # items per insert_many / delete_many call, and per floor call
DEPTH = 100  # single-item calls per pipeline
T_RATIO = 1.3  # issue 15: each mutation at most 1.3x the floor
T_WORST_MS = 5.0  # issue 15: no script call holds Redis longer than this
FLOOR = (Path(__file__).parent / "floor.lua").read_text()


@dataclass(frozen=True)
class Scale:
    slots: int  # table size of both filters
    rounds: int  # alternating windows per (op, load); the median ratio is kept
    worst_calls: int  # single calls timed one by one at 95 % load


FULL = Scale(2**17, 11, 3000)
QUICK = Scale(2**13, 3, 300)


@dataclass
class CostRow:
    op: str  # insert, insert_many, delete, delete_many
    load: int  # percent
    ours: list[float] = field(default_factory=list)  # CPU us per item, per round
    floor: list[float] = field(default_factory=list)

    @property
    def ratios(self) -> list[float]:
        return [a / b for a, b in zip(self.ours, self.floor, strict=True) if b > 0]

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios)


@dataclass
class WorstRow:
    what: str  # e.g. "insert, single"
    calls: int
    cpu_ms: list[float]  # main-thread CPU per call
    wall_ms: list[float]  # client-side latency per call

    def worst(self) -> float:
        return max(self.cpu_ms)

    def p99(self) -> float:
        return sorted(self.cpu_ms)[int(0.99 * (len(self.cpu_ms) - 1))]


@dataclass
class Rows:
    slots: int
    costs: list[CostRow]
    worst: list[WorstRow]
    kick_step_usec: float  # CPU per kick step, from failing inserts
    failed_insert_usec: float
    direct_insert_usec: float
    limit_insert_usec: float  # a failing insert at max_kicks = MAX_KICKS_LIMIT


def main_cpu(r: redis.Redis) -> float:
    """Seconds of CPU of Redis's main thread (the one that runs scripts)."""
    info = r.info("cpu")
    return float(info["used_cpu_user_main_thread"]) + float(info["used_cpu_sys_main_thread"])


def cpu_window(r: redis.Redis, items: int, work: Callable[[], object]) -> float:
    """Main-thread CPU per item of ``work``, in microseconds."""
    before = main_cpu(r)
    work()
    return (main_cpu(r) - before) * 1e6 / items


# -- the floor ----------------------------------------------------------------------------------


class Floor:
    """bench/floor.lua on one key, with the same m and hashing seed as our filter."""

    def __init__(self, r: redis.Redis, key: str, buckets: int) -> None:
        self.r, self.key, self.m = r, key, buckets
        self.sha = r.script_load(FLOOR)
        r.delete(key)
        r.setrange(key, buckets * B * F // 8 - 1, b"\0")

    def args(self, op: str, items: list[str]) -> list[Any]:
        out: list[Any] = [op, self.m, MAX_KICKS]
        for x in items:
            h, g = item_hash(x, SEED)
            out += (h % self.m, (g >> (32 - F)) or 1)
        return out

    def call(self, op: str, items: list[str], pipe: Any = None) -> Any:
        return (pipe or self.r).evalsha(self.sha, 1, self.key, *self.args(op, items))

    def singles(self, op: str, items: list[str]) -> None:
        for a in range(0, len(items), DEPTH):
            pipe = self.r.pipeline(transaction=False)
            for x in items[a : a + DEPTH]:
                self.call(op, [x], pipe)
            pipe.execute()

    def batches(self, op: str, items: list[str]) -> list[int]:
        out: list[int] = []
        for a in range(0, len(items), BATCH):
            out += self.call(op, items[a : a + BATCH])
        return out

    def load(self) -> float:
        """Share of non-zero slots (read with GETRANGE, client-side)."""
        raw = self.r.get(self.key) or b""
        slots = len(raw) // 2
        used = sum(1 for k in range(0, len(raw), 2) if raw[k] or raw[k + 1])
        return used / max(1, slots)


# -- ours ---------------------------------------------------------------------------------------


def our_singles(cf: SyncCuckooFilter, method: str, items: list[str]) -> None:
    """Single-item calls of the library's own API, ``DEPTH`` to a pipeline."""
    for a in range(0, len(items), DEPTH):
        pipe = cf.pipeline()
        for x in items[a : a + DEPTH]:
            getattr(pipe, method)(x)
        pipe.execute()


def our_batches(cf: SyncCuckooFilter, method: str, items: list[str]) -> None:
    for a in range(0, len(items), BATCH):
        getattr(cf, method)(items[a : a + BATCH])


def fill(cf: SyncCuckooFilter, floor: Floor, tag: str, start: int, stop: int) -> None:
    """The same items into both filters."""
    core.fill_to(cf, tag, start, stop)
    for a in range(start, stop, 20 * BATCH):
        floor.batches("i", core.keys(tag, a, min(stop, a + 20 * BATCH)))


def measure_costs(
    r: redis.Redis, cf: SyncCuckooFilter, floor: Floor, load: int, s: Scale, tag: str
) -> list[CostRow]:
    """Each op's window for ours and for the floor's, one right after the other (which goes
    first alternates by round), so that both see the same machine; each round adds about 1 %
    load with its inserts and takes it out with its deletes."""
    m = max(BATCH, s.slots // 100 // BATCH * BATCH)
    runs: dict[str, dict[str, Callable[[list[str]], object]]] = {
        "ours": {
            "insert": lambda x: our_singles(cf, "insert", x),
            "delete": lambda x: our_singles(cf, "delete", x),
            "insert_many": lambda x: our_batches(cf, "insert_many", x),
            "delete_many": lambda x: our_batches(cf, "delete_many", x),
        },
        "floor": {
            "insert": lambda x: floor.singles("i", x),
            "delete": lambda x: floor.singles("d", x),
            "insert_many": lambda x: floor.batches("i", x),
            "delete_many": lambda x: floor.batches("d", x),
        },
    }
    rows = {op: CostRow(op, load) for op in ("insert", "insert_many", "delete", "delete_many")}
    for k in range(s.rounds):
        single = core.keys(f"{tag}-s{k}", 0, m)
        many = core.keys(f"{tag}-m{k}", 0, m)
        sides = ["ours", "floor"] if k % 2 == 0 else ["floor", "ours"]
        for op, items in (
            ("insert", single),
            ("delete", single),
            ("insert_many", many),
            ("delete_many", many),
        ):
            for side in sides:
                usec = cpu_window(r, len(items), functools.partial(runs[side][op], items))
                getattr(rows[op], side).append(usec)
    return list(rows.values())


# -- the worst call -----------------------------------------------------------------------------


class TimedRedis(redis.Redis):
    """A client that times each script call it sends alone: main-thread CPU between an INFO
    before and one after (less ``idle``, the same pair's cost with nothing between) and
    client-side wall time."""

    idle = 0.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cpu_ms: list[float] = []
        self.wall_ms: list[float] = []

    def execute_command(self, *args: Any, **options: Any) -> Any:
        if str(args[0]).upper() not in ("EVALSHA", "EVAL"):
            return super().execute_command(*args, **options)
        before = main_cpu(self)
        t0 = time.perf_counter()
        try:
            return super().execute_command(*args, **options)
        finally:
            wall = time.perf_counter() - t0
            self.cpu_ms.append(max(0.0, (main_cpu(self) - before) * 1e3 - self.idle))
            self.wall_ms.append(wall * 1e3)

    def calibrate(self) -> None:
        pairs = []
        for _ in range(200):
            before = main_cpu(self)
            pairs.append((main_cpu(self) - before) * 1e3)
        self.idle = statistics.median(pairs)

    def take(self, what: str) -> WorstRow:
        row = WorstRow(what, len(self.cpu_ms), self.cpu_ms, self.wall_ms)
        self.cpu_ms, self.wall_ms = [], []
        return row


def put_back(cf: SyncCuckooFilter, items: list[str]) -> None:
    with contextlib.suppress(FilterFullError):  # a few fewer items: about the same load
        cf.insert_many(items)


def measure_worst(target: Target, s: Scale) -> list[WorstRow]:
    """Every script call of inserts and deletes at 95 % load, timed alone."""
    r = TimedRedis.from_url(target.url)
    assert isinstance(r, TimedRedis)
    r.calibrate()
    cf = SyncCuckooFilter(r, "worst", prefix=target.prefix)
    plain = target.filter("worst")
    info = core.reserve_fixed(plain, core.capacity_for_slots(s.slots, B), B, seed=SEED)
    slots = info.buckets * B
    core.fill_to(plain, "w", 0, int(0.95 * slots))
    rows = []
    items = core.keys("w95", 0, s.worst_calls)
    for x in items:  # each insert taken out again: the load stays at 95 %
        try:
            added = cf.insert(x)
        except FilterFullError:
            added = False
        if added:
            plain.delete(x)
    rows.append(r.take("insert, single"))
    batch = min(INSERT_CHUNK, 5 * BATCH)
    many = core.keys("w95m", 0, max(batch, s.worst_calls // batch * batch))
    for a in range(0, len(many), batch):
        part = many[a : a + batch]
        try:
            results = cf.insert_many(part)
        except FilterFullError as full:
            results = full.results
        plain.delete_many([x for x, ok in zip(part, results, strict=True) if ok])
    rows.append(r.take(f"insert_many({batch})"))
    present = core.keys("w", 0, max(3 * BATCH_CHUNK, s.worst_calls // 3))
    for x in present[: s.worst_calls // 3]:  # each delete put back: the load stays at 95 %
        cf.delete(x)
        put_back(plain, [x])
    rows.append(r.take("delete, single"))
    for a in range(0, len(present), BATCH_CHUNK):  # one script call each
        part = present[a : a + BATCH_CHUNK]
        cf.delete_many(part)
        put_back(plain, part)
    rows.append(r.take(f"delete_many({BATCH_CHUNK})"))
    plain.drop()
    r.close()
    return rows


def failing_inserts(target: Target, slots: int, max_kicks: int, tries: int) -> float:
    """CPU per insert, in us, of inserts into a fixed filter filled to its first failure: each
    takes max_kicks steps and changes nothing (a failed chain is put back)."""
    cf = target.filter(f"kicks{max_kicks}")
    cf.reserve(
        core.capacity_for_slots(slots, B),
        fingerprint_bits=F,
        bucket_size=B,
        max_kicks=max_kicks,
        expansion=0,
        seed=SEED,
    )
    core.fill(cf, "k")
    items = core.keys("k-fail", 0, tries)

    def attempt() -> None:
        for a in range(0, len(items), DEPTH):
            pipe = cf.pipeline()
            for x in items[a : a + DEPTH]:
                pipe.insert(x)
            pipe.execute(raise_on_error=False)

    usec = cpu_window(target.r, len(items), attempt)
    cf.drop()
    return usec


def measure_kick_step(target: Target, s: Scale) -> tuple[float, float, float, float]:
    """CPU of a failing insert (max_kicks steps, nothing written) and of a direct one: the
    difference over max_kicks is one kick step's cost. Also a failing insert at the largest
    max_kicks a filter may have (guard/layout.py), the longest single insert there is.
    Returns (step, failed, direct, failed at the limit) in us."""
    cf = target.filter("direct")
    slots = min(s.slots, 2**14)
    core.reserve_fixed(cf, core.capacity_for_slots(slots, B), B, seed=SEED)
    empty = core.keys("k-direct", 0, 500)
    direct = cpu_window(target.r, len(empty), lambda: our_singles(cf, "insert", empty))
    cf.drop()
    failed = failing_inserts(target, slots, MAX_KICKS, 500)
    at_limit = failing_inserts(target, slots, MAX_KICKS_LIMIT, 50)
    return (failed - direct) / MAX_KICKS, failed, direct, at_limit


def measure(target: Target, quick: bool = False) -> Rows:
    s = QUICK if quick else FULL
    r = target.r
    cf = target.filter("cost")
    info = core.reserve_fixed(cf, core.capacity_for_slots(s.slots, B), B, seed=SEED)
    slots = info.buckets * B
    floor = Floor(r, f"{target.prefix}floor", info.buckets)
    costs: list[CostRow] = []
    fill(cf, floor, "in", 0, slots // 2)
    costs += measure_costs(r, cf, floor, 50, s, "at50")
    fill(cf, floor, "in", slots // 2, int(0.9 * slots))
    costs += measure_costs(r, cf, floor, 90, s, "at90")
    cf.drop()
    r.delete(floor.key)
    worst = measure_worst(target, s)
    step, failed, direct, at_limit = measure_kick_step(target, s)
    return Rows(slots, costs, worst, step, failed, direct, at_limit)


# -- the report ---------------------------------------------------------------------------------


def report(rows: Rows) -> str:
    out = [(__doc__ or "").split("\n\n", 1)[1].split("\n\nThe pipeline")[0].strip(), ""]
    out += [f"Both tables: {rows.slots:,} slots (b={B}, f={F}); batches of {BATCH}.", ""]
    out += ["## Server CPU per item, against the floor", ""]
    body = []
    for c in rows.costs:
        ratios = sorted(c.ratios)
        body.append(
            [
                c.op,
                f"{c.load} %",
                f2(statistics.median(c.ours)),
                f2(statistics.median(c.floor)),
                f2(c.ratio),
                f"{f2(ratios[0])}-{f2(ratios[-1])}",
                verdict(c.ratio <= T_RATIO),
            ]
        )
    out.append(
        table(
            [
                "op",
                "load",
                "ours (µs/item)",
                "floor (µs/item)",
                "ratio (median)",
                "ratio range",
                f"<= {T_RATIO}x",
            ],
            body,
        )
    )
    out += ["", "## The longest script call at 95 % load", ""]
    body = [
        [
            w.what,
            str(w.calls),
            f"{w.worst():.3f}",
            f"{w.p99():.3f}",
            f"{max(w.wall_ms):.3f}",
            verdict(w.worst() <= T_WORST_MS),
        ]
        for w in rows.worst
    ]
    out.append(
        table(
            [
                "calls",
                "timed",
                "worst CPU (ms)",
                "p99 CPU (ms)",
                "worst wall, client (ms)",
                f"<= {T_WORST_MS:g} ms",
            ],
            body,
        )
    )
    out += [
        "",
        "## One kick step",
        "",
        table(
            ["figure", "value"],
            [
                ["failing insert (max_kicks steps), CPU µs", f2(rows.failed_insert_usec)],
                ["direct insert, CPU µs", f2(rows.direct_insert_usec)],
                [
                    f"failing insert at max_kicks {MAX_KICKS_LIMIT:,} (the limit), CPU ms",
                    f2(rows.limit_insert_usec / 1000),
                ],
                ["one kick step, CPU µs", f2(rows.kick_step_usec)],
                ["KICK_BUDGET (guard/ops.py), steps", f"{KICK_BUDGET:,}"],
                ["KICK_BUDGET at this step cost, ms", f2(KICK_BUDGET * rows.kick_step_usec / 1000)],
            ],
        ),
    ]
    return "\n".join(out)
