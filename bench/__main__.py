"""Command line: ``python -m bench core [--redis-url URL] [--quick] [--out PATH]``."""

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
    args = parser.parse_args(argv)

    from bench import runner  # imported late: --help needs no Redis client

    # A quick run is a smoke test: it must not overwrite the committed full results.
    out = args.out if args.out is not None else (None if args.quick else DEFAULT_OUT)
    return runner.run(args.redis_url, quick=args.quick, out=out)


if __name__ == "__main__":
    sys.exit(main())
