"""`python -m bench perf`: what a guard costs per request and per key, measured in one run.

Server cost per operation (INFO commandstats and INFO cpu), library throughput from one Python
process, HTTP through uvicorn beside two baselines served the same way, auto-batching on and
off, an attack of absent keys, accuracy and space per (fingerprint bits, bucket size), and
scaling to 10^7 items. Every target is a ratio of two figures measured side by side in this
run; the machine is shared, so absolute numbers drift and the load average is recorded.

By default a private redis-server is started on a free port, so commandstats and CPU time are
this run's alone; `--redis-url` measures a server of your own (keys under a unique prefix,
deleted at the end; nothing is flushed or reset).
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import secrets
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import redis

from bench import core, perf_http
from bench.minimal import MinimalLookup, agrees
from bench.perf_apps import coalesce_switch
from bench.suite import Target
from devkit.processes import HttpProcess
from guard import CuckooFilter, FilterExistsError, FilterParams, SyncCuckooFilter
from guard.connect import connect_async
from guard.hashing import item_hash
from guard.layout import TAG_BYTES, pack_header, string_bytes

# The reference figures, measured on this machine (Redis 7.0.15, loopback, 2 cores).
REF_USEC = {
    "GET": 0.06,
    "CF.EXISTS": 0.23,
    "CF.MEXISTS (10 items)": 0.68,
    "EVALSHA `return 1`": 0.72,
    "Lua lookup, two redis.call GETRANGE": 4.5,
    "BITFIELD_RO, both buckets": 0.6,
}
REF_RATE = {"GET pipelined": 160_000, "CF.EXISTS pipelined": 175_000, "CF.MEXISTS x100": 540_000}
REF_HTTP = {"bare FastAPI route": 4_000, "FastAPI + one Redis GET": 1_900}

# Targets (ratios measured in the same run).
T_LOOKUP_VS_CF = 3.0
T_MLOOKUP_VS_MEXISTS = 3.0
T_INSERT90_VS_ADD = 5.0
T_LOOKUP_MANY_VS_MEXISTS = 0.5
T_PIPELINED_VS_GET = 0.8
T_LOOKUP_VS_MINIMAL = 0.8  # a minimal client sending the same BITFIELD_RO (bench/minimal.py)
T_BLOCKED_VS_GET = 3.0
T_ITEM_VS_CF = 1.2  # a FastAPI route doing CF.EXISTS (a GET when RedisBloom is absent)
T_ITEM_VS_GET = 1.0
T_BATCHING_GAIN = 1.3
T_ATTACK_FP = 1.5
T_LEGIT_P99 = 1.2


@dataclass(frozen=True)
class PerfScale:
    cost_slots: int  # table of the server-cost filter
    cost_ops: int  # operations per server-cost window
    repeats: int  # read-only windows repeated, median kept
    tput_items: int  # items per throughput timing
    http_seconds: int  # wrk takes whole seconds
    http_rounds: int  # 5: a p99 under 1 ms at one connection moves 10 % between rounds
    attack_requests: int
    accuracy_slots: int
    accuracy_lookups: int
    scaling_sizes: tuple[int, ...]


FULL = PerfScale(2**17, 4_000, 3, 20_000, 3, 5, 100_000, 2**15, 300_000, (10**4, 10**6, 10**7))
QUICK = PerfScale(2**13, 500, 1, 2_000, 1, 1, 5_000, 2**11, 20_000, (10**4, 10**5))


# -- pipelining the library's own operations ----------------------------------------------------


def run_pipelined(
    cf: SyncCuckooFilter, method: str, items: list[str], depth: int = 100
) -> list[Any]:
    """``method`` (a single-item operation of the filter's own API, guard/facade.py) of each
    item, through the library's pipeline, ``depth`` at a time: the commands and the decoding
    of replies are the library's; ``cf.pipeline()`` only shares the round trips. The items
    are taken as they are, as the minimal client takes them (a list of (method, item) pairs
    made in the timed window would charge the library for the bench's own allocations)."""
    results: list[Any] = []
    for a in range(0, len(items), depth):
        pipe = cf.pipeline()
        queue = getattr(pipe, method)
        for item in items[a : a + depth]:
            queue(item)
        results += pipe.execute()
    return results


# -- 1. server cost per operation ---------------------------------------------------------------


@dataclass(frozen=True)
class Cost:
    key: str  # what the report looks the row up by
    name: str
    group: str  # "single" or "batched"
    command: str  # the commandstats entry that holds the cost
    calls: int
    items: int
    usec: int  # commandstats usec delta of `command`
    cpu_seconds: float  # INFO cpu delta over the window: the main thread's (user + sys)
    load: str
    table_load: float | None = None  # the filter's load when the window began
    subfilters: int | None = None  # the filter's sub-filters when the window ended

    @property
    def usec_per_call(self) -> float:
        return self.usec / max(1, self.calls)

    @property
    def usec_per_item(self) -> float:
        return self.usec / max(1, self.items)

    @property
    def cpu_usec_per_item(self) -> float:
        return self.cpu_seconds * 1e6 / max(1, self.items)


def server_cpu(r: redis.Redis) -> float:
    """CPU seconds of the server's main thread (Redis 7), else of the whole process.

    Commands run on the main thread; commandstats times them by the wall clock, which counts
    time the server was descheduled on this shared machine (a long script can lose a tick to
    another process and be charged for it), where the thread's own CPU time does not.
    """
    info = r.info("cpu")
    if "used_cpu_user_main_thread" in info:
        return float(info["used_cpu_user_main_thread"]) + float(info["used_cpu_sys_main_thread"])
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def cost_window(
    r: redis.Redis,
    key: str,
    name: str,
    group: str,
    command: str,
    items: int,
    work: Callable[[], object],
    table: Callable[[], tuple[float, int]] | None = None,
) -> Cost:
    """One timed window; ``table()`` says the filter's (load, sub-filters), read outside it."""
    load = f"{os.getloadavg()[0]:.2f}"
    table_load = table()[0] if table is not None else None
    before, cpu0 = core.commandstats(r), server_cpu(r)
    work()
    cpu1, after = server_cpu(r), core.commandstats(r)
    calls = after.get(command, (0, 0))[0] - before.get(command, (0, 0))[0]
    usec = after.get(command, (0, 0))[1] - before.get(command, (0, 0))[1]
    subfilters = table()[1] if table is not None else None
    return Cost(
        key, name, group, command, calls, items, usec, cpu1 - cpu0, load, table_load, subfilters
    )


def median_cost(costs: list[Cost]) -> Cost:
    return sorted(costs, key=lambda c: c.usec_per_item)[len(costs) // 2]


def reserve_exact(cf: SyncCuckooFilter, slots: int, b: int = 4, seed: int | None = None) -> None:
    """A fixed-size filter of exactly ``slots`` slots (a power of two), as RedisBloom makes.

    ``reserve()`` sizes a table to fill its allocator size class, which is never a power of
    two of buckets; RedisBloom's always is. So that both filters hold the same slots, the bench
    writes ours that size itself, in the stored format (docs/format.md) and the way
    guard/lua/reserve.lua does: the string at its full length in one step (its tag), then
    the header.
    """
    params = FilterParams(
        capacity=slots,
        fingerprint_bits=core.FP_BITS,
        bucket_size=b,
        max_kicks=core.MAX_KICKS,
        expansion=0,
        seed=seed,
    )
    made = replace(params.layout(), buckets0=slots // b)
    key, r = cf.key(0), cf.redis
    if r.exists(key):
        raise FilterExistsError(f"{cf.name}: filter exists", filter=cf.name)
    total = string_bytes(made.buckets0, made.bucket_size, made.fp_bits)
    with r.pipeline() as p:  # one MULTI, as the script is atomic
        p.setrange(key, total - TAG_BYTES, made.tag(0))
        p.setrange(key, 0, pack_header(made, slots, None))
        p.execute()


def filter_table(cf: SyncCuckooFilter) -> Callable[[], tuple[float, int]]:
    def read() -> tuple[float, int]:
        info = cf.info()
        return info.load_factor, info.subfilters

    return read


class RedisBloomFilter:
    """A CF.* filter the same shape as the bench's own: the same slots, bucket size 4, as
    many kicks (MAXITERATIONS), fixed size (EXPANSION 0: a failed add is an error, never a
    second sub-filter; ``table()`` reads CF.INFO to show it), filled with the same keys."""

    def __init__(self, r: redis.Redis, key: str, slots: int, b: int = 4) -> None:
        self.r, self.key, self.slots = r, key, slots
        r.execute_command(
            "CF.RESERVE", key, slots, "BUCKETSIZE", b, "MAXITERATIONS", core.MAX_KICKS,
            "EXPANSION", 0,
        )  # fmt: skip
        info = self.info()
        if info[b"Number of buckets"] * b != slots:
            raise RuntimeError(f"CF.RESERVE made {info[b'Number of buckets']} buckets of {b}")

    def info(self) -> dict[bytes, int]:
        reply = self.r.execute_command("CF.INFO", self.key)
        if isinstance(reply, dict):
            return {k if isinstance(k, bytes) else str(k).encode(): v for k, v in reply.items()}
        return dict(zip(reply[::2], reply[1::2], strict=True))

    def table(self) -> tuple[float, int]:
        info = self.info()
        items = info[b"Number of items inserted"]
        return items / self.slots, int(info[b"Number of filters"])

    def fill_to(self, tag: str, start: int, stop: int) -> None:
        core.pipelined(
            self.r, stop - start, 1000,
            lambda p, i: p.execute_command("CF.ADD", self.key, f"{tag}:{start + i}"),
        )  # fmt: skip

    def add(self, items: list[str], depth: int) -> None:
        core.pipelined(
            self.r, len(items), depth, lambda p, i: p.execute_command("CF.ADD", self.key, items[i])
        )

    def insert(self, items: list[str], batch: int) -> None:
        for a in range(0, len(items), batch):
            part = items[a : a + batch]
            self.r.execute_command("CF.INSERT", self.key, "NOCREATE", "ITEMS", *part)

    def delete(self, items: list[str], depth: int) -> None:
        core.pipelined(
            self.r, len(items), depth, lambda p, i: p.execute_command("CF.DEL", self.key, items[i])
        )

    def exists(self, items: list[str], depth: int) -> None:
        core.pipelined(
            self.r, len(items), depth,
            lambda p, i: p.execute_command("CF.EXISTS", self.key, items[i]),
        )  # fmt: skip

    def mexists(self, items: list[str], batch: int) -> list[Any]:
        return [
            self.r.execute_command("CF.MEXISTS", self.key, *items[a : a + batch])
            for a in range(0, len(items), batch)
        ]


def measure_server_cost(target: Target, s: PerfScale) -> list[Cost]:
    r, b = target.r, 4
    n, depth, batch = s.cost_ops, 100, 1000
    get_key = f"{target.prefix}get"
    r.set(get_key, b"x" * 16)
    one_sha = r.script_load("return 1")
    cf = target.filter("cost")
    slots = s.cost_slots
    reserve_exact(cf, slots, b, seed=11)
    core.fill_to(cf, "in", 0, slots // 2)
    table = filter_table(cf)
    rb = RedisBloomFilter(r, f"{target.prefix}rb-cost", slots) if target.redisbloom else None
    if rb is not None:
        rb.fill_to("in", 0, slots // 2)
    absent = core.keys("absent", 0, n)
    absent_many = core.keys("absent-m", 0, max(batch, n * 5 // batch * batch))

    Table = Callable[[], tuple[float, int]] | None
    Window = tuple[str, str, str, str, int, Callable[[], object], Table]

    def reads() -> list[Window]:
        out: list[Window] = [
            (
                "get",
                "GET",
                "single",
                "get",
                n,
                lambda: core.pipelined(r, n, depth, lambda p, _i: p.get(get_key)),
                None,
            ),
            (
                "evalsha",
                "EVALSHA `return 1`",
                "single",
                "evalsha",
                n,
                lambda: core.pipelined(r, n, depth, lambda p, _i: p.evalsha(one_sha, 0)),
                None,
            ),
            (
                "lookup",
                "lookup (1 BITFIELD_RO per item) at 50 % load",
                "single",
                "bitfield_ro",
                n,
                lambda: run_pipelined(cf, "lookup", absent, depth),
                table,
            ),
            (
                "lookup_many",
                f"lookup_many at 50 % load, batches of {batch}",
                "batched",
                "bitfield_ro",
                len(absent_many),
                lambda: [
                    cf.lookup_many(absent_many[a : a + batch])
                    for a in range(0, len(absent_many), batch)
                ],
                table,
            ),
        ]
        if rb is not None:
            out += [
                (
                    "cf_exists",
                    "CF.EXISTS at 50 % load",
                    "single",
                    "cf.exists",
                    n,
                    lambda: rb.exists(absent, depth),
                    rb.table,
                ),
                (
                    "cf_mexists",
                    f"CF.MEXISTS at 50 % load, batches of {batch}",
                    "batched",
                    "cf.mexists",
                    len(absent_many),
                    lambda: rb.mexists(absent_many, batch),
                    rb.table,
                ),
            ]
        return out

    rows: list[Cost] = []
    cases = reads()
    for case in cases:
        case[5]()  # warm-up
    rounds = [[cost_window(r, *c) for c in cases] for _ in range(s.repeats)]
    rows += [median_cost([rnd[k] for rnd in rounds]) for k in range(len(cases))]

    # Each window adds about 1 % load, and the deletes take it out again.
    m = max(100, slots // 100)

    def mutations(load: int, start: int) -> list[Cost]:
        single = core.keys("in", start, start + m)
        many = core.keys("in", start + m, start + 3 * m)
        out = [
            cost_window(
                r,
                f"insert_{load}",
                f"insert at {load} % load",
                "single",
                "evalsha",
                m,
                lambda: run_pipelined(cf, "insert", single, depth),
                table,
            ),
            cost_window(
                r,
                f"insert_many_{load}",
                f"insert_many at {load} % load, batches of {batch}",
                "batched",
                "evalsha",
                len(many),
                lambda: [cf.insert_many(many[a : a + batch]) for a in range(0, len(many), batch)],
                table,
            ),
            cost_window(
                r,
                f"delete_{load}",
                f"delete at {load} % load",
                "single",
                "evalsha",
                m,
                lambda: run_pipelined(cf, "delete", single, depth),
                table,
            ),
            cost_window(
                r,
                f"delete_many_{load}",
                f"delete_many at {load} % load, batches of {batch}",
                "batched",
                "evalsha",
                len(many),
                lambda: [cf.delete_many(many[a : a + batch]) for a in range(0, len(many), batch)],
                table,
            ),
        ]
        if rb is not None:
            out += redisbloom_mutations(r, rb, load, single, many, depth, batch)
        return out

    rows += mutations(50, slots // 2)
    core.fill_to(cf, "in90", 0, int(0.9 * slots) - cf.info().items)
    if rb is not None:
        rb.fill_to("in90", 0, int(0.9 * slots) - round(rb.table()[0] * slots))
    rows += mutations(90, 10 * slots)
    cf.drop()
    r.delete(get_key)
    if rb is not None:
        r.delete(rb.key)
    return rows


def redisbloom_mutations(
    r: redis.Redis,
    rb: RedisBloomFilter,
    load: int,
    single: list[str],
    many: list[str],
    depth: int,
    batch: int,
) -> list[Cost]:
    """CF.* doing what the library's mutation windows do, with the same keys at the same load."""
    return [
        cost_window(
            r,
            f"cf_add_{load}",
            f"CF.ADD at {load} % load",
            "single",
            "cf.add",
            len(single),
            lambda: rb.add(single, depth),
            rb.table,
        ),
        cost_window(
            r,
            f"cf_insert_{load}",
            f"CF.INSERT at {load} % load, batches of {batch}",
            "batched",
            "cf.insert",
            len(many),
            lambda: rb.insert(many, batch),
            rb.table,
        ),
        cost_window(
            r,
            f"cf_del_{load}",
            f"CF.DEL at {load} % load",
            "single",
            "cf.del",
            len(single),
            lambda: rb.delete(single, depth),
            rb.table,
        ),
        cost_window(
            r,
            f"cf_del_many_{load}",
            f"CF.DEL at {load} % load, pipelines of {batch} (no batched delete)",
            "batched",
            "cf.del",
            len(many),
            lambda: rb.delete(many, batch),
            rb.table,
        ),
    ]


# -- 2. library throughput from one Python process ------------------------------------------------


def measure_throughput(target: Target, s: PerfScale) -> list[core.Throughput]:
    r, b = target.r, 4
    n, depth = s.tput_items, 100
    get_key = f"{target.prefix}tget"
    r.set(get_key, b"x" * 16)
    cf = target.filter("tput")
    seed, slots = 7, s.cost_slots
    reserve_exact(cf, slots, b, seed=seed)
    core.fill_to(cf, "in", 0, slots // 2)
    rb = RedisBloomFilter(r, f"{target.prefix}rb-tput", slots) if target.redisbloom else None
    if rb is not None:
        rb.fill_to("in", 0, slots // 2)  # the same keys, the same load
    absent = core.keys("absent", 0, n)
    # What the library's single lookup costs beyond its command: a client sending the same
    # BITFIELD_RO with nothing around it, checked to answer as the library does.
    minimal = MinimalLookup(r, cf.key(), seed)
    mixed = core.keys("in", 0, 500) + absent[:500]
    agrees(r, minimal, mixed, cf.lookup_many(mixed))
    loop = asyncio.new_event_loop()
    # Packed by hiredis, as the service's client is (guard/packing.py): GET and lookups alike.
    ar = connect_async(target.url)
    handles: dict[str, CuckooFilter] = {}
    if coalesce_switch():
        handles["on"] = CuckooFilter(ar, "tput", prefix=target.prefix, coalesce=True)
        handles["off"] = CuckooFilter(ar, "tput", prefix=target.prefix, coalesce=False)
    else:
        handles["off"] = CuckooFilter(ar, "tput", prefix=target.prefix)

    async def concurrent(acf: CuckooFilter, inflight: int = 100) -> None:
        async def worker(k: int) -> None:
            for x in absent[k::inflight]:
                await acf.lookup(x)

        await asyncio.gather(*(worker(k) for k in range(inflight)))

    async def aget_pipelined() -> None:
        for a in range(0, n, depth):
            async with ar.pipeline(transaction=False) as pipe:
                for _ in range(min(depth, n - a)):
                    pipe.get(get_key)
                await pipe.execute()

    cases = [
        core.Case(
            "get_sync",
            f"GET, pipelines of {depth} (sync)",
            n,
            lambda: core.pipelined(r, n, depth, lambda p, _i: p.get(get_key)),
            {},
        ),
        core.Case(
            "get_asyncio",
            f"GET, pipelines of {depth} (asyncio)",
            n,
            lambda: loop.run_until_complete(aget_pipelined()),
            {},
        ),
        core.Case(
            "minimal_sync",
            f"minimal client, the same BITFIELD_RO, pipelines of {depth} (sync)",
            n,
            lambda: minimal.pipelined(r, absent, depth),
            {},
        ),
        core.Case(
            "minimal_asyncio",
            "minimal client, the same BITFIELD_RO, 100 in flight (asyncio)",
            n,
            lambda: loop.run_until_complete(minimal.concurrent(ar, absent)),
            {},
        ),
        core.Case(
            "lookup_pipelined",
            f"single lookups, pipelines of {depth} (sync, library ops pipelined)",
            n,
            lambda: run_pipelined(cf, "lookup", absent, depth),
            {},
        ),
    ]
    for mode, acf in handles.items():
        label = {"on": "auto-batching on", "off": "no batching"}[mode]
        cases.append(
            core.Case(
                f"lookup_asyncio_{mode}",
                f"cf.lookup(), 100 in flight (asyncio, {label})",
                n,
                lambda acf=acf: loop.run_until_complete(concurrent(acf)),
                {},
            )
        )
    for batch in (100, 1000):
        total = max(batch, n * 5 // batch * batch)
        items = core.keys("absent-m", 0, total)
        cases.append(
            core.Case(
                f"lookup_many_{batch}",
                f"lookup_many, batches of {batch} (sync)",
                total,
                lambda items=items, batch=batch: [
                    cf.lookup_many(items[a : a + batch]) for a in range(0, len(items), batch)
                ],
                {},
            )
        )
    if rb is not None:
        many = core.keys("absent-m", 0, max(100, n * 5 // 100 * 100))
        cases.append(
            core.Case(
                "cf_mexists_100",
                "CF.MEXISTS, batches of 100",
                len(many),
                lambda: rb.mexists(many, 100),
                {},
            )
        )
        cases.append(
            core.Case(
                "cf_exists",
                f"CF.EXISTS, pipelines of {depth}",
                n,
                lambda: rb.exists(absent, depth),
                {},
            )
        )
    try:
        # At least 3 timings per row even in a quick run: one is too easily a stalled one.
        results = core.measure_interleaved(r, cases, max(3, s.repeats))
    finally:
        loop.run_until_complete(ar.aclose())
        loop.close()
        cf.drop()
        r.delete(get_key)
        if rb is not None:
            r.delete(rb.key)
    # mmh3 hashing alone, for the record (the reference: ~10M/s).
    t0 = time.perf_counter()
    for x in absent:
        item_hash(x, 7)
    seconds = time.perf_counter() - t0
    results.append(core.Throughput("mmh3", "mmh3 item_hash alone", n, seconds, {}, {}, {}))
    return results


# -- 3. HTTP --------------------------------------------------------------------------------------


def batching_env(on: bool) -> dict[str, str]:
    """How to switch the service's auto-batching: its own GUARD_* setting once it has one."""
    from app.settings import Settings

    names = [f for f in Settings.model_fields if "coalesc" in f or "batching" in f]
    if names:
        return {f"GUARD_{names[0].upper()}": "true" if on else "false"}
    return {"PERF_COALESCE": "1" if on else "0"}


@dataclass
class Services:
    servers: dict[str, HttpProcess]
    workdir: Any
    batching: bool  # whether the "on"/"off" services differ

    def stop(self) -> None:
        for s in self.servers.values():
            s.stop()
        self.workdir.cleanup()


SERVICE_ROWS = 10_000
LEGIT_KEYS = 1_000  # present keys the tests read (warmed into the cache first)


def start_services(target: Target) -> Services:
    tmp = perf_http.temp_workdir()
    work = Path(tmp.name)
    servers: dict[str, HttpProcess] = {}
    batching = coalesce_switch()

    def service_env(tag: str, extra: dict[str, str]) -> dict[str, str]:
        return {
            "GUARD_REDIS_URL": target.url,
            "GUARD_KEY_PREFIX": f"{target.prefix}svc-{tag}:",
            "GUARD_DATABASE_URL": f"sqlite:///{work / tag}.db",
            "GUARD_DEMO_RECORDS": str(SERVICE_ROWS),
            "GUARD_API_KEY": "",
            "GUARD_LOG_LEVEL": "WARNING",
            **extra,
        }

    try:
        if target.redisbloom:
            cf_key = f"{target.prefix}rb-http"
            target.r.execute_command("CF.RESERVE", cf_key, 2 * LEGIT_KEYS)
            for i in range(1, LEGIT_KEYS + 1):
                target.r.execute_command("CF.ADD", cf_key, f"k{i}")
        base_env = {
            "PERF_REDIS_URL": target.url,
            "PERF_PREFIX": f"{target.prefix}base:",
            "PERF_CF_KEY": f"{target.prefix}rb-http" if target.redisbloom else "",
        }
        target.r.mset({f"{target.prefix}base:k{i}": b"v" for i in range(1, LEGIT_KEYS + 1)})
        apps = "bench.perf_apps:"
        servers["baseline"] = perf_http.start_uvicorn(
            "baseline", apps + "baseline", base_env, "/get/k1", work
        )

        def service(name: str, tag: str, extra: dict[str, str]) -> HttpProcess:
            env = service_env(tag, extra)
            return perf_http.start_uvicorn(name, apps + "service", env, "/health", work)

        servers["on"] = service("service", "on", batching_env(True))
        if batching:
            # The batching table compares two services with the same history, not the
            # main table's service, which has served many more requests by then.
            servers["batch-on"] = service("service-batch", "batch-on", batching_env(True))
            servers["off"] = service("service-nobatch", "off", batching_env(False))
        else:
            servers["batch-on"] = servers["off"] = servers["on"]
        servers["noguard"] = service("service-noguard", "noguard", {"PERF_GUARD": "0"})
    except BaseException:
        for s in servers.values():
            s.stop()
        tmp.cleanup()
        raise
    # Warm the present keys into each service's cache: the tables measure steady state.
    legit = [("legit", f"/records/user-{i}") for i in range(1, LEGIT_KEYS + 1)]
    for name in {"on", "batch-on", "off", "noguard"}:
        perf_http.http_load(servers[name].port, legit, 16)
    return Services(servers, tmp, batching)


def check_bodies(count: int = 8, items: int = 100) -> tuple[str, ...]:
    # Half present, half absent: the route's cost does not depend on the answers.
    out = []
    for k in range(count):
        keys = [f"user-{(k * items + i) % SERVICE_ROWS + 1}" for i in range(items // 2)]
        keys += [f"nope-{k}-{i}" for i in range(items - len(keys))]
        out.append('{"items": [' + ", ".join(f'"{x}"' for x in keys) + "]}")
    return tuple(out)


BASELINE_GET = "baseline: FastAPI + one Redis GET"


def http_cases() -> dict[str, list[perf_http.WrkCase]]:
    W = perf_http.WrkCase
    cf_label = "baseline: FastAPI + one CF.EXISTS (one GET when RedisBloom is absent)"
    bodies = check_bodies()

    def svc(server: str, c: int) -> list[perf_http.WrkCase]:
        return [
            W(
                "item",
                "GET /filters/{name}/items/{item}",
                server,
                "/filters/records/items/user-%d",
                20_000,
                c,
            ),
            W(
                "check",
                "POST /filters/{name}/check, 100 items",
                server,
                "/filters/records/check?n=%d",
                1_000,
                c,
                "POST",
                bodies,
            ),
            W(
                "blocked",
                "GET /records/{absent} (blocked)",
                server,
                "/records/absent-%d",
                1_000_000_000,
                c,
            ),
            W("present", "GET /records/{present}", server, "/records/user-%d", LEGIT_KEYS, c),
        ]

    return {
        "main": [
            W("baseline_get", BASELINE_GET, "baseline", "/get/k%d", LEGIT_KEYS, 32),
            W("baseline_cf", cf_label, "baseline", "/cf/k%d", LEGIT_KEYS, 32),
            *svc("on", 32),
        ],
        "batching": [
            *(c for c in svc("batch-on", 64)[1:3]),
            *(c for c in svc("off", 64)[1:3]),
        ],
    }


@dataclass(frozen=True)
class LowLoad:
    """One route at one connection, batching on and off, requests taken in turns."""

    key: str  # the route's key in http_cases()
    route: str
    requests: int  # per side
    on_p50_ms: float
    on_p99_ms: float
    off_p50_ms: float
    off_p99_ms: float


def measure_low_load(services: Services, blocks: int) -> list[LowLoad]:
    ports = (services.servers["batch-on"].port, services.servers["off"].port)
    out = []
    for key, route, path_fmt, n in (
        ("item", "GET /filters/{name}/items/{item}", "/filters/records/items/user-%d", 20_000),
        ("blocked", "GET /records/{absent} (blocked)", "/records/absent-%d", 1_000_000_000),
    ):
        perf_http.interleaved_latency(ports, path_fmt, n, 2, 100)  # warm both
        on, off = perf_http.interleaved_latency(ports, path_fmt, n, blocks, 200)
        q = [statistics.quantiles(side, n=100) for side in (on, off)]
        out.append(
            LowLoad(
                key,
                route,
                len(on),
                q[0][49] * 1000,
                q[0][98] * 1000,
                q[1][49] * 1000,
                q[1][98] * 1000,
            )
        )
    return out


def measure_http(s: PerfScale, services: Services) -> dict[str, list[Any]]:
    work = Path(services.workdir.name)
    cases = http_cases()
    if not services.batching:
        cases["batching"] = [c for c in cases["batching"] if c.server == "batch-on"]
    flat = [(group, c) for group, cs in cases.items() for c in cs]
    # Warm-up: first requests build the middleware stack, connection pools and caches.
    warm = flat if s.http_rounds > 1 else list({c.server: (g, c) for g, c in flat}.values())
    for _, c in warm:
        perf_http.run_wrk(c, services.servers[c.server].url, 1, 1, work)
    rounds: list[list[perf_http.WrkResult]] = []
    for k in range(s.http_rounds):
        # Every other round runs the cases backwards, so that no case always follows the
        # same one (what runs just before can leave the machine busier).
        order = list(range(len(flat)))[:: 1 if k % 2 == 0 else -1]
        timed: dict[int, perf_http.WrkResult] = {}
        for i in order:
            c = flat[i][1]
            timed[i] = perf_http.run_wrk(
                c, services.servers[c.server].url, s.http_seconds, k + 1, work
            )
        rounds.append([timed[i] for i in range(len(flat))])
    out: dict[str, list[perf_http.WrkResult]] = {g: [] for g in cases}
    for i, (group, c) in enumerate(flat):
        runs = sorted((rnd[i] for rnd in rounds), key=lambda w: w.rps)
        # Throughput from the median round; each latency the median of its own over the
        # rounds, so one stalled second in one round does not decide a p99.
        mid = replace(
            runs[len(runs) // 2],
            p50_ms=statistics.median(w.p50_ms for w in runs),
            p99_ms=statistics.median(w.p99_ms for w in runs),
        )
        # The batching table shows the two services side by side.
        if group == "batching":
            mode = "on" if c.server == "batch-on" else "off"
            mid = replace(mid, batching=mode)
        out[group].append(mid)
    results: dict[str, list[Any]] = dict(out)
    if services.batching:
        results["low_load"] = measure_low_load(services, blocks=8 * s.http_rounds)
    return results


# -- 4. attack shielding ---------------------------------------------------------------------------


@dataclass(frozen=True)
class AttackRun:
    key: str  # "<guard|noguard>_<alone|attack>"
    name: str
    requests: int
    attack: int
    legit: int
    db_queries: int
    seconds: float
    legit_p50_ms: float
    legit_p99_ms: float
    attack_p99_ms: float
    statuses: dict[int, int]


@dataclass(frozen=True)
class AttackResult:
    runs: list[AttackRun]
    theory_fpr: float  # the service filter's estimated rate at its load (info.error_rate)
    filter_info: dict[str, Any]
    rb_like: tuple[int, int, float, bool]  # (false positives, lookups, theory, measured live)


def attack_requests(total: int, tag: str, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    out = []
    for i in range(total):
        if i % 10 == 0:
            out.append(("legit", f"/records/user-{rng.randint(1, LEGIT_KEYS)}"))
        else:
            out.append(("attack", f"/records/attack-{tag}-{i}"))
    return out


def attack_run(key: str, name: str, server: HttpProcess, reqs: list[tuple[str, str]]) -> AttackRun:
    before = perf_http.get_json(server, "/stats")["db_queries"]
    t0 = time.perf_counter()
    samples = perf_http.http_load(server.port, reqs, 32)
    seconds = time.perf_counter() - t0
    after = perf_http.get_json(server, "/stats")["db_queries"]
    legit = [x.seconds * 1000 for x in samples if x.kind == "legit"]
    attack = [x.seconds * 1000 for x in samples if x.kind == "attack"]
    statuses: dict[int, int] = {}
    for x in samples:
        statuses[x.status] = statuses.get(x.status, 0) + 1
    return AttackRun(
        key,
        name,
        len(samples),
        len(attack),
        len(legit),
        after - before,
        seconds,
        perf_http.percentile(legit, 50),
        perf_http.percentile(legit, 99),
        perf_http.percentile(attack, 99),
        statuses,
    )


def measure_attack(target: Target, s: PerfScale, services: Services) -> AttackResult:
    total = s.attack_requests
    tag = secrets.token_hex(3)
    mixed = attack_requests(total, tag, 1)
    legit_only = [x for x in mixed if x[0] == "legit"]
    on, noguard = services.servers["on"], services.servers["noguard"]
    info = perf_http.get_json(on, "/filters/records")
    runs = [
        attack_run("guard_alone", "guard: legitimate reads alone", on, legit_only),
        attack_run("guard_attack", "guard: attack + 10 % legitimate", on, mixed),
        attack_run("noguard_alone", "no guard: legitimate reads alone", noguard, legit_only),
        attack_run("noguard_attack", "no guard: attack + 10 % legitimate", noguard, mixed),
    ]
    # RedisBloom's default filter (8-bit fingerprints, b=2) over the same rows and capacity,
    # asked the same absent keys. Live CF.* when the module is loaded; otherwise guard's own
    # filter with that geometry (the false-positive rate is a property of the geometry).
    attack_keys = [p.removeprefix("/records/") for kind, p in mixed if kind == "attack"]
    rows = [f"user-{i}" for i in range(1, SERVICE_ROWS + 1)]
    capacity = int(info["capacity"])
    if target.redisbloom:
        key = f"{target.prefix}rb-attack"
        target.r.execute_command("CF.RESERVE", key, capacity)
        core.pipelined(
            target.r, len(rows), 1000, lambda p, i: p.execute_command("CF.ADD", key, rows[i])
        )
        hits = 0
        for a in range(0, len(attack_keys), 1000):
            hits += sum(target.r.execute_command("CF.MEXISTS", key, *attack_keys[a : a + 1000]))
        slots = core.next_pow2(math.ceil(capacity / 2)) * 2
        target.r.delete(key)
        rb = (hits, len(attack_keys), core.theory_fpr(len(rows) / slots, 8, 2), True)
    else:
        cf = target.filter("rb-like")
        rb_info = cf.reserve(capacity, fingerprint_bits=8, bucket_size=2, expansion=0)
        for a in range(0, len(rows), 5000):
            cf.insert_many(rows[a : a + 5000])
        hits = sum(cf.lookup_many(attack_keys))
        load = len(rows) / (rb_info.buckets * 2)
        cf.drop()
        rb = (hits, len(attack_keys), core.theory_fpr(load, 8, 2), False)
    return AttackResult(runs, float(info["error_rate"]), info, rb)


# -- 5. accuracy and space -------------------------------------------------------------------------


@dataclass(frozen=True)
class AccuracyRow:
    f: int
    b: int
    slots: int
    items: int
    memory_bytes: int
    lookups: int
    false_positives: int

    @property
    def load(self) -> float:
        return self.items / self.slots

    @property
    def bits_per_item(self) -> float:
        return 8 * self.memory_bytes / self.items

    @property
    def measured(self) -> float:
        return self.false_positives / self.lookups

    @property
    def theory(self) -> float:
        return core.theory_fpr(self.load, self.f, self.b)

    @property
    def lower_bound(self) -> float:
        eps = self.measured or self.theory
        return math.log2(1 / eps)


def measure_accuracy(target: Target, s: PerfScale) -> list[AccuracyRow]:
    rows = []
    for f in (8, 12, 16):
        for b in (2, 4, 8):
            cf = target.filter(f"acc-f{f}-b{b}")
            info = core.reserve_fixed(
                cf, core.capacity_for_slots(s.accuracy_slots, b), b, f, seed=3
            )
            try:
                items = core.fill(cf, "acc")
                used = core.memory_bytes(target.r, cf)
                hits = 0
                for a in range(0, s.accuracy_lookups, 50_000):
                    stop = min(s.accuracy_lookups, a + 50_000)
                    hits += sum(cf.lookup_many(core.keys("never", a, stop)))
            finally:
                cf.drop()
            rows.append(AccuracyRow(f, b, info.buckets * b, items, used, s.accuracy_lookups, hits))
    return rows


# -- 6. scaling ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScaleRow:
    items: int
    memory_bytes: int
    fill_seconds: float
    single_usec: float  # commandstats usec per single-item BITFIELD_RO
    batched_usec_per_item: float
    p50_ms: float  # one cf.lookup() round trip, sync
    p99_ms: float

    @property
    def bits_per_item(self) -> float:
        return 8 * self.memory_bytes / self.items


def parallel_fill(
    target: Target, name: str, total: int, batch: int = 10_000, workers: int = 3
) -> None:
    """insert_many from a few threads: client hashing overlaps the server's scripts."""

    def part(a: int) -> None:
        cf = target.filter(name)
        cf.insert_many(core.keys("k", a, min(total, a + batch)))

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(part, range(0, total, batch)))


def measure_scaling(target: Target, s: PerfScale) -> list[ScaleRow]:
    rows = []
    probes = core.keys("absent", 0, 2_000 if s is FULL else 500)
    for size in s.scaling_sizes:
        name = f"scale-{size}"
        cf = target.filter(name)
        cf.reserve(size, error_rate=0.001, bucket_size=4, expansion=0)
        try:
            t0 = time.perf_counter()
            parallel_fill(target, name, size)
            fill_seconds = time.perf_counter() - t0
            used = core.memory_bytes(target.r, cf)

            def lookups(work: Callable[[], object]) -> Cost:
                return cost_window(target.r, "", "", "", "bitfield_ro", len(probes), work)

            single = lookups(lambda cf=cf: run_pipelined(cf, "lookup", probes))
            batched = lookups(lambda cf=cf: cf.lookup_many(probes))
            lat = []
            for x in probes[:1000]:
                t = time.perf_counter()
                cf.lookup(x)
                lat.append((time.perf_counter() - t) * 1000)
        finally:
            cf.drop()
        rows.append(
            ScaleRow(
                size,
                used,
                fill_seconds,
                single.usec_per_call,
                batched.usec_per_item,
                perf_http.percentile(lat, 50),
                perf_http.percentile(lat, 99),
            )
        )
    return rows
