"""The `guard` command line: filters (create/info/list/drop/load/export/import), the service
(serve/demo/attack) and the change feed (follow). `main` is the console-script entry point."""

from __future__ import annotations

from app.cli import feed, filters, rules, service  # noqa: F401  (they register their commands on `cli`)
from app.cli.common import cli


def main() -> None:
    cli(prog_name="guard")


__all__ = ["cli", "main"]
