"""The suites `python -m bench` runs, each assembled from its measure and report modules: the
sections in the order they run, the report, the figures and the exit status.

A new suite file with ``measure(target, quick) -> rows`` and ``report(rows) -> markdown``
plugs in as one `Entry` in SUITES, e.g.::

    "mutations": Entry(
        "cost of inserts and deletes, by load",
        module_suite("mutations", "Mutations", mutations),
        report="docs/bench-mutations.md",
    ),
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

from bench import (
    bulk,
    cluster,
    core,
    core_report,
    feed,
    gateway,
    mutations,
    outages,
    perf,
    perf_http,
    perf_report,
    reliability,
    repair,
    startup,
)
from bench.suite import Measured, Section, Suite, open_target, single_section
from devkit import churn

SHARED_URL = "redis://127.0.0.1:6379/13"  # the machine's shared server, a database of its own


@dataclass(frozen=True)
class Entry:
    """A suite as `python -m bench <name>` offers it."""

    help: str
    open: Callable[[argparse.Namespace], AbstractContextManager[Suite]]
    report: str | None = None  # the committed report a full run rewrites (--out's default)
    # --redis-url's default (None: a private redis-server); False: the suite starts its own.
    redis_url: str | bool | None = None
    quick: bool = True  # whether --quick (small sizes) is offered
    options: tuple[tuple[str, dict[str, Any]], ...] = ()  # more argparse options


@contextmanager
def core_suite(a: argparse.Namespace) -> Iterator[Suite]:
    scale = core.QUICK if a.quick else core.FULL
    with open_target(a.redis_url, "core") as t:
        sections = [
            ("memory", lambda: core.measure_memory(t, scale)),
            ("error_rates", lambda: core.measure_error_rates(t)),
            ("load", lambda: core.measure_load(t, scale)),
            ("fit", lambda: core.measure_fit(t, scale)),
            ("fpr", lambda: core.measure_fpr(t, scale)),
            ("throughput", lambda: core.measure_throughput(t, scale)),
        ]

        def plots(m: Measured, folder: Any) -> None:
            from bench import core_plots  # matplotlib only when files are written

            core_plots.write(m.results, folder)

        yield Suite(
            "core",
            [
                Section(name, measure, lambda rows, name=name: core_report.section(name, rows))
                for name, measure in sections
            ],
            lambda m: core_report.document(m, env=t.env, redisbloom=t.redisbloom, scale=scale),
            summary=lambda m: core_report.summary(m.results),
            plots=plots,
        )


def module_version(t: Any) -> str:
    for module in t.r.module_list():
        fields = {(k.decode() if isinstance(k, bytes) else k): v for k, v in module.items()}
        if fields.get("name") in (b"bf", "bf"):
            return str(fields.get("ver"))
    return "?"


@contextmanager
def perf_suite(a: argparse.Namespace) -> Iterator[Suite]:
    s = perf.QUICK if a.quick else perf.FULL
    module: list[str] = []
    if a.redisbloom:
        if a.redis_url:
            raise SystemExit("--redisbloom starts the bench's own server: drop --redis-url")
        if not os.path.isfile(a.redisbloom):
            raise SystemExit(f"--redisbloom: no such file {a.redisbloom}")
        module = ["--loadmodule", os.path.abspath(a.redisbloom)]
    with open_target(a.redis_url, "perf", *module) as t:
        if a.redisbloom and not t.redisbloom:
            raise SystemExit(f"--redisbloom: {a.redisbloom} did not load as RedisBloom")
        if a.redisbloom:
            t.env["RedisBloom module"] = f"{module[1]} (MODULE LIST: bf {module_version(t)})"
        t.env["wrk"] = perf_http.wrk_path() or "not installed: HTTP section skipped"
        services: list[perf.Services] = []  # running while the HTTP sections are measured

        def start() -> None:
            if perf_http.have_wrk():
                services.append(perf.start_services(t))

        def stop() -> None:
            while services:
                services.pop().stop()

        def plots(m: Measured, folder: Any) -> None:
            from bench import perf_plots

            perf_plots.write(m.results, folder)

        def section(
            name: str, measure: Callable[[], Any], setup: Callable[[], None] | None = None
        ) -> Section:
            return Section(name, measure, lambda rows: perf_report.section(name, rows), setup)

        try:
            yield Suite(
                "perf",
                [
                    section("server_cost", lambda: perf.measure_server_cost(t, s)),
                    section("throughput", lambda: perf.measure_throughput(t, s)),
                    section(
                        "http",
                        lambda: perf.measure_http(s, services[0]) if services else None,
                        setup=start,
                    ),
                    section(
                        "attack",
                        lambda: perf.measure_attack(t, s, services[0]) if services else None,
                    ),
                    # The services stop first: they would share the CPUs with what follows.
                    section("accuracy", lambda: perf.measure_accuracy(t, s), setup=stop),
                    section("scaling", lambda: perf.measure_scaling(t, s)),
                ],
                lambda m: perf_report.document(m, env=t.env, redisbloom=t.redisbloom),
                summary=lambda m: perf_report.summary(m.results),
                plots=plots,
            )
        finally:
            stop()


@contextmanager
def cluster_suite(a: argparse.Namespace) -> Iterator[Suite]:
    items = 30_000 if a.quick else 300_000
    seconds = 2.0 if a.quick else 6.0
    procs = 1 if a.quick else 2
    # 0: the same shards on one plain redis-server (no cluster client).
    configurations = {"1 master": 1, "3 masters": 3, "plain redis-server": 0}

    def results(m: Measured) -> dict[int, dict[str, Any]]:
        return {masters: m.results[name] for name, masters in configurations.items()}

    print(cluster.HEAD, flush=True)
    yield Suite(
        "cluster",
        [
            Section(
                name,
                lambda masters=masters: cluster.measure_on(masters, items, seconds, procs),
                lambda res, masters=masters: cluster.rows(masters, res),
            )
            for name, masters in configurations.items()
        ],
        lambda m: cluster.report(results(m), items, seconds),
        summary=lambda m: "\n".join(cluster.comparison(results(m))),
    )


@contextmanager
def outages_suite(a: argparse.Namespace) -> Iterator[Suite]:
    intro = outages.intro(a.runs)
    print(intro, outages.HEAD, sep="\n", flush=True)
    names = [outages.case_name(mode, fail_open) for mode, fail_open in outages.CASES]
    yield Suite(
        "outages",
        [
            Section(
                name,
                lambda mode=mode, fail_open=fail_open: outages.measure(mode, fail_open, a.runs),
                lambda cases, name=name: outages.row(name, cases),
            )
            for name, (mode, fail_open) in zip(names, outages.CASES, strict=True)
        ],
        lambda m: "\n".join(
            [intro, "", outages.HEAD, *(outages.row(k, m.results[k]) for k in names), ""]
        ),
    )


@contextmanager
def reliability_suite(a: argparse.Namespace) -> Iterator[Suite]:
    plan = churn.make_plan(a.redis_url, a.capacity, a.workers, a.ops, a.load, a.check_every)
    print(f"python -m bench reliability on {a.redis_url} (pid {os.getpid()})", flush=True)
    yield Suite(
        "reliability",
        [Section("churn", lambda: churn.run(plan, a.capacity), reliability.render)],
        lambda m: reliability.render(m.results["churn"]) + "\n",
        status=lambda m: 1 if m.results["churn"].failures() else 0,
    )


def module_suite(
    name: str, title: str, module: Any
) -> Callable[[argparse.Namespace], AbstractContextManager[Suite]]:
    """A suite file whose ``measure(target, quick=)`` needs nothing but --quick, as a suite
    of one section on --redis-url (or a private redis-server)."""
    return lambda a: single_section(
        name, title, a.redis_url, lambda t: module.measure(t, quick=a.quick), module.report
    )


def bulk_suite(a: argparse.Namespace) -> AbstractContextManager[Suite]:
    sizes = {**(bulk.QUICK if a.quick else bulk.FULL)}
    sizes.update({k: v for k, v in (("count", a.items), ("sample", a.sample)) if v})
    return single_section(
        "bulk", "Bulk builds", a.redis_url, lambda t: bulk.measure(t, **sizes), bulk.report
    )


def feed_suite(a: argparse.Namespace) -> AbstractContextManager[Suite]:
    sizes = {**(feed.QUICK if a.quick else feed.FULL)}
    if a.rows:
        sizes["rebuild_rows"] = a.rows
    return single_section(
        "feed",
        "Change feed: what it costs writers, lag from commit to filter, records rebuilds",
        a.redis_url,
        lambda t: feed.measure(t, pg_prefix=a.pg_prefix, **sizes),
        feed.report,
    )


@contextmanager
def repair_suite(a: argparse.Namespace) -> Iterator[Suite]:
    sizes = {**(repair.QUICK if a.quick else repair.FULL)}
    if a.runs:
        sizes["runs"] = a.runs
    rows, runs, seconds = sizes["rows"], sizes["runs"], sizes["seconds"]
    names = [repair.case_name(f, k) for f, k in repair.CASES]
    sections = [
        Section(
            name,
            lambda f=f, k=k: repair.measure_fault(f, k, rows, runs, a.pg_prefix),
            lambda res, f=f, k=k: repair.table(repair.FAULT_HEAD, [repair.fault_row(f, k, res)]),
        )
        for name, (f, k) in zip(names, repair.CASES, strict=True)
    ]
    costs = {"cost (SQLite)": "sqlite", "cost (PostgreSQL)": "postgres"}
    sections += [
        Section(
            name,
            lambda k=k: repair.measure_cost(k, rows, seconds, a.pg_prefix),
            repair.cost_table,
        )
        for name, k in costs.items()
    ]
    with open_target(None, "repair") as t:  # the environment rows; faults use own servers
        env = t.env
    yield Suite(
        "repair",
        sections,
        lambda m: repair.document(m, env, rows, runs, seconds),
    )


SUITES: dict[str, Entry] = {
    "core": Entry(
        "load at failure, false positives, memory and throughput on a real Redis",
        core_suite,
        report="docs/bench-core.md",
        redis_url=SHARED_URL,
    ),
    "perf": Entry(
        "cost per request and per key: server, library, HTTP",
        perf_suite,
        report="docs/benchmarks.md",
        options=(
            (
                "--redisbloom",
                {
                    "metavar": "PATH",
                    "default": None,
                    "help": "RedisBloom module (.so) for the private server: CF.* measured live",
                },
            ),
        ),
    ),
    "cluster": Entry(
        "sharded filter on 1 vs 3 Redis Cluster masters",
        cluster_suite,
        report="docs/bench-cluster.md",
        redis_url=False,
    ),
    "outages": Entry(
        "request latency and recovery while Redis is stopped or frozen",
        outages_suite,
        redis_url=False,
        quick=False,
        options=(("--runs", {"type": int, "default": 3, "help": "runs per case"}),),
    ),
    "bulk": Entry(
        "bulk builds: 10M keys from a file to a promoted filter, against insert_many",
        bulk_suite,
        report="docs/bench-bulk.md",
        options=(
            ("--items", {"type": int, "default": None, "help": "keys in the file (10M)"}),
            ("--sample", {"type": int, "default": None, "help": "keys for insert_many (200k)"}),
        ),
    ),
    "mutations": Entry(
        "cost of inserts and deletes against a minimal Lua floor, by load; the longest call",
        module_suite("mutations", "Mutations against the floor", mutations),
        report="docs/bench-mutations.md",
    ),
    "feed": Entry(
        "change feed: what guarding costs writers (pgbench), commit-to-filter lag, rebuilds",
        feed_suite,
        report="docs/bench-feed.md",
        options=(
            ("--rows", {"type": int, "default": None, "help": "rows rebuilt (1M)"}),
            (
                "--pg-prefix",
                {"default": "bench_feed_", "help": "prefix of the PostgreSQL databases made"},
            ),
        ),
    ),
    "repair": Entry(
        "the watchdog: detection and repair time per fault, and what the audit costs",
        repair_suite,
        report="docs/bench-repair.md",
        redis_url=False,
        options=(
            ("--runs", {"type": int, "default": None, "help": "runs per fault (3)"}),
            (
                "--pg-prefix",
                {"default": "bench_repair_", "help": "prefix of the PostgreSQL databases made"},
            ),
        ),
    ),
    "gateway": Entry(
        "the guard as nginx's auth_request hop: blocked rate, added latency, the route's rate",
        module_suite("gateway", "The guard behind nginx", gateway),
        report="docs/bench-gateway.md",
    ),
    "startup": Entry(
        "start-up time of guard commands, and `guard load --create` of 1M keys end to end",
        module_suite("startup", "Start-up time of the guard command", startup),
        report="docs/bench-startup.md",
    ),
    "reliability": Entry(
        "worker processes churn one filter near full; checks for false negatives",
        reliability_suite,
        redis_url=SHARED_URL,
        quick=False,
        options=(
            ("--capacity", {"type": int, "default": 100_000}),
            ("--workers", {"type": int, "default": 8}),
            ("--ops", {"type": int, "default": 20_000, "help": "operations per worker"}),
            ("--load", {"type": float, "default": 0.93, "help": "target load factor"}),
            (
                "--check-every",
                {"type": int, "default": 1, "help": "re-check after every n-th mutation"},
            ),
        ),
    ),
}
