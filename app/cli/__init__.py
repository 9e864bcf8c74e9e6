"""The `guard` command line: filters (create/info/list/check/drop/load/export/import), the
service (serve/where/demo/attack) and the change feed (follow). `main` is the console-script
entry point. A command's module is imported when the command runs (app/cli/common.py)."""

from __future__ import annotations

from app.cli.common import cli


def main() -> None:
    cli(prog_name="guard")


__all__ = ["cli", "main"]
