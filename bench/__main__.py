"""Command line: ``python -m bench core [--redis-url URL] [--quick] [--out PATH]``,
``python -m bench reliability [--redis-url URL] [--capacity N] [--workers N] [--ops N]``,
``python -m bench outages [--runs N]``."""

from __future__ import annotations

import argparse
import sys

DEFAULT_URL = "redis://127.0.0.1:6379/13"
DEFAULT_OUT = "docs/bench-core.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    core = sub.add_parser(
        "core",
        help="load at failure, false positives, memory and throughput on a real Redis",
    )
    core.add_argument("--redis-url", default=DEFAULT_URL, help=f"default {DEFAULT_URL}")
    core.add_argument(
        "--quick",
        action="store_true",
        help="small sizes (under a minute); writes no files by default",
    )
    core.add_argument(
        "--out",
        default=None,
        help=f"report path (default {DEFAULT_OUT} for a full run; plots go to its img/ folder)",
    )
    rel = sub.add_parser(
        "reliability",
        help="worker processes churn one filter near full; checks for false negatives",
    )
    rel.add_argument("--redis-url", default=DEFAULT_URL, help=f"default {DEFAULT_URL}")
    rel.add_argument("--capacity", type=int, default=100_000)
    rel.add_argument("--workers", type=int, default=8)
    rel.add_argument("--ops", type=int, default=20_000, help="operations per worker")
    rel.add_argument("--load", type=float, default=0.93, help="target load factor")
    rel.add_argument(
        "--check-every", type=int, default=1, help="re-check after every n-th mutation"
    )
    perf = sub.add_parser("perf", help="cost per request and per key: server, library, HTTP")
    perf.add_argument("--redis-url", default=None, help="default: a private redis-server")
    perf.add_argument("--quick", action="store_true", help="small sizes (under a minute)")
    perf.add_argument("--out", default=None, help="report path (full run: docs/benchmarks.md)")
    out = sub.add_parser(
        "outages", help="request latency and recovery while Redis is stopped or frozen"
    )
    out.add_argument("--runs", type=int, default=3, help="runs per case")
    clu = sub.add_parser("cluster", help="sharded filter on 1 vs 3 Redis Cluster masters")
    clu.add_argument("--quick", action="store_true", help="small sizes; writes no file")
    clu.add_argument("--out", default=None, help="default docs/bench-cluster.md (full run)")
    args = parser.parse_args(argv)
    if args.command == "cluster":
        from bench import cluster

        default = None if args.quick else "docs/bench-cluster.md"
        return cluster.main(quick=args.quick, out=args.out if args.out is not None else default)
    if args.command == "outages":
        from bench import outages

        return outages.main(args.runs)
    if args.command == "perf":
        from bench import perf as perf_bench

        out = args.out if args.out is not None else (None if args.quick else perf_bench.DEFAULT_OUT)
        return perf_bench.run(args.redis_url, quick=args.quick, out=out)
    if args.command == "reliability":
        from bench import reliability

        return reliability.main(
            args.redis_url, args.capacity, args.workers, args.ops, args.load, args.check_every
        )

    from bench import runner  # imported late: --help needs no Redis client

    # A quick run is a smoke test: it must not overwrite the committed full results.
    out = args.out if args.out is not None else (None if args.quick else DEFAULT_OUT)
    return runner.run(args.redis_url, quick=args.quick, out=out)


if __name__ == "__main__":
    sys.exit(main())
