"""Concurrency across processes: N workers churn one filter near full and check for false negatives.

Each worker (its own process, its own connection, a `SyncCuckooFilter`) inserts items of its
own, deletes some of them again and looks items up, mixed at random; after every insert or
delete it looks up every item it still holds (`lookup_many`). A single `False` there is a false
negative. At the end the filter's item count must equal successful inserts minus deletes, and
no delete may have missed. `tests/reliability/test_concurrency.py` runs a bounded size;
`python -m bench reliability` runs the bigger one whose output goes in docs/reliability.md.
"""

from __future__ import annotations

import multiprocessing as mp
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from guard import FilterFullError, SyncCuckooFilter
from guard.connect import connect

ABSENT_PER_LOOKUP = 10  # never-inserted items per lookup op: measures false positives
OWN_PER_LOOKUP = 10


@dataclass
class WorkerResult:
    worker: int
    inserts: int = 0  # acknowledged inserts
    full: int = 0  # inserts refused with FilterFullError (nothing added)
    deletes: int = 0  # acknowledged deletes
    missed_deletes: int = 0  # delete of a live item that found nothing: a false negative
    lookups: int = 0
    checks: int = 0  # full re-checks of the worker's live items
    items_checked: int = 0
    false_negatives: int = 0
    absent_lookups: int = 0
    false_positives: int = 0
    seconds: float = 0.0
    live: list[str] = field(default_factory=list)
    first_failure: str = ""


@dataclass(frozen=True)
class Plan:
    url: str
    prefix: str
    name: str
    workers: int
    ops: int  # operations per worker
    quota: int  # live items per worker once ramped up
    check_every: int = 1  # full re-check after every n-th mutation (1 = after each)
    seed: int = 0


def worker(plan: Plan, wid: int, barrier: Any, out: Any) -> None:
    """One worker process; puts its WorkerResult on `out`."""
    client = connect(plan.url, socket_timeout=30)
    cf = SyncCuckooFilter(client, plan.name, prefix=plan.prefix)
    rng = random.Random(plan.seed * 1000 + wid)
    res = WorkerResult(wid)
    live: list[str] = []
    serial = 0
    mutations = 0
    barrier.wait()
    start = time.perf_counter()
    try:
        for _ in range(plan.ops):
            roll = rng.random()
            ramping = len(live) < plan.quota
            if live and roll < 0.25:
                res.lookups += 1
                own = [live[rng.randrange(len(live))] for _ in range(OWN_PER_LOOKUP)]
                absent = [f"absent-{wid}-{rng.getrandbits(64):x}" for _ in range(ABSENT_PER_LOOKUP)]
                got = cf.lookup_many(own + absent)
                lost = [x for x, ok in zip(own, got[:OWN_PER_LOOKUP], strict=True) if not ok]
                if lost and not res.first_failure:
                    res.first_failure = f"lookup lost {lost[:3]}"
                res.false_negatives += len(lost)
                res.absent_lookups += ABSENT_PER_LOOKUP
                res.false_positives += sum(got[OWN_PER_LOOKUP:])
                continue
            insert = not live or (rng.random() < (0.95 if ramping else 0.5))
            if insert:
                item = f"w{wid}-{serial}"
                serial += 1
                try:
                    cf.insert(item)
                except FilterFullError:
                    res.full += 1  # nothing was added (a failed kick chain is undone)
                else:
                    res.inserts += 1
                    live.append(item)
            else:
                k = rng.randrange(len(live))
                live[k], live[-1] = live[-1], live[k]
                item = live.pop()
                if cf.delete(item):
                    res.deletes += 1
                else:
                    res.missed_deletes += 1
                    if not res.first_failure:
                        res.first_failure = f"delete of live {item!r} found nothing"
            mutations += 1
            if live and mutations % plan.check_every == 0:
                got = cf.lookup_many(live)
                res.checks += 1
                res.items_checked += len(live)
                lost = [x for x, ok in zip(live, got, strict=True) if not ok]
                if lost and not res.first_failure:
                    res.first_failure = f"after mutation {mutations}: lost {lost[:3]}"
                res.false_negatives += len(lost)
    except Exception as exc:  # reported, not swallowed: the parent fails on first_failure
        res.first_failure = f"{type(exc).__name__}: {exc}"
    res.seconds = time.perf_counter() - start
    res.live = live
    out.put(res)
    client.close()


@dataclass
class RunResult:
    plan: Plan
    slots: int
    capacity: int
    workers: list[WorkerResult]
    info: dict[str, Any]
    final_check_missing: int
    wall_seconds: float

    @property
    def expected_items(self) -> int:
        return sum(w.inserts - w.deletes for w in self.workers)

    def total(self, name: str) -> int:
        return sum(getattr(w, name) for w in self.workers)

    def failures(self) -> list[str]:
        """Everything that breaks the guarantees; empty when all held."""
        out = [f"worker {w.worker}: {w.first_failure}" for w in self.workers if w.first_failure]
        if self.info["items"] != self.expected_items:
            out.append(f"filter holds {self.info['items']} items, expected {self.expected_items}")
        if self.info["missed_deletes"]:
            out.append(f"filter counted {self.info['missed_deletes']} missed deletes")
        if self.final_check_missing:
            out.append(f"final check: {self.final_check_missing} live items missing")
        return out


def run(plan: Plan, capacity: int, bucket_size: int = 4, fingerprint_bits: int = 16) -> RunResult:
    """Create the filter (fixed size), run the workers, verify, drop the filter."""
    client = connect(plan.url, socket_timeout=30)
    cf = SyncCuckooFilter(client, plan.name, prefix=plan.prefix)
    try:
        info = cf.reserve(
            capacity, bucket_size=bucket_size, fingerprint_bits=fingerprint_bits, expansion=0,
            seed=plan.seed,
        )  # fmt: skip
        ctx = mp.get_context("spawn")
        barrier = ctx.Barrier(plan.workers)
        out = ctx.Queue()
        procs = [
            ctx.Process(target=worker, args=(plan, w, barrier, out)) for w in range(plan.workers)
        ]
        start = time.perf_counter()
        for p in procs:
            p.start()
        results = [out.get(timeout=1800) for _ in procs]
        for p in procs:
            p.join(timeout=60)
        wall = time.perf_counter() - start
        results.sort(key=lambda r: r.worker)
        final = cf.info()
        live = [x for r in results for x in r.live]
        missing = sum(not ok for ok in cf.lookup_many(live)) if live else 0
        return RunResult(
            plan, info.buckets * bucket_size, capacity, results, final.as_dict(), missing, wall
        )
    finally:
        cf.drop()
        client.close()


def ramp_quota(slots: int, workers: int, target_load: float) -> int:
    return -(-int(slots * target_load) // workers)


def slots_for(capacity: int, bucket_size: int = 4, fingerprint_bits: int = 16) -> int:
    from guard.params import FilterParams

    layout = FilterParams(
        capacity=capacity, fingerprint_bits=fingerprint_bits, bucket_size=bucket_size,
        expansion=0, seed=0,
    ).layout()  # fmt: skip
    return layout.buckets0 * bucket_size


def make_plan(
    url: str, capacity: int, workers: int, ops: int, target_load: float, check_every: int = 1,
    seed: int = 1, prefix: str | None = None,
) -> Plan:  # fmt: skip
    slots = slots_for(capacity)
    return Plan(
        url=url,
        prefix=prefix or f"bench:rel:{uuid.uuid4().hex[:8]}:",
        name="churn",
        workers=workers,
        ops=ops,
        quota=ramp_quota(slots, workers, target_load),
        check_every=check_every,
        seed=seed,
    )
