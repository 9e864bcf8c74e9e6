"""Command line: ``python -m bench <suite> [--quick] [--out PATH] [--redis-url URL] ...``, one
subcommand per suite in bench/suites.py (``python -m bench --help`` lists them)."""

from __future__ import annotations

import argparse
import sys

from bench import suite
from bench.suites import SUITES


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    sub = top.add_subparsers(dest="command", required=True)
    for name, entry in SUITES.items():
        p = sub.add_parser(name, help=entry.help)
        if entry.redis_url is not False:
            default = entry.redis_url or None
            p.add_argument(
                "--redis-url",
                default=default,
                help=f"default {default}" if default else "default: a private redis-server",
            )
        if entry.quick:
            p.add_argument(
                "--quick",
                action="store_true",
                help="small sizes (about a minute); writes no report unless --out is given",
            )
        p.add_argument(
            "--out",
            default=None,
            help=f"report path (a full run's default: {entry.report}; plots go to its img/)"
            if entry.report
            else "report path (default: print only)",
        )
        for flag, options in entry.options:
            p.add_argument(flag, **options)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    entry = SUITES[args.command]
    args.quick = getattr(args, "quick", False)
    # A quick run is a smoke test: it must not overwrite the committed full results.
    out = args.out if args.out is not None else (None if args.quick else entry.report)
    return suite.run(entry.open(args), quick=args.quick, out=out)


if __name__ == "__main__":
    sys.exit(main())
