"""`guard rules check FILE`: a route rules file checked as the service checks it at start-up,
and what each rule guards, one line each."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from app.cli.common import cli, console, settings
from app.rules import service_rules

rules_cli = typer.Typer(
    name="rules",
    help="Route rules (GUARD_RULES): which requests the guard checks (docs/gateway.md).",
    no_args_is_help=True,
)
cli.add_typer(rules_cli)


@rules_cli.command()
def check(
    file: Annotated[Path, typer.Argument(help="A rules file: .yaml, .yml or .toml.")],
) -> None:
    """Check FILE as `guard serve` would with GUARD_RULES=FILE and the other GUARD_* settings
    (exit 1 and one line naming the rule and field if it would refuse it), and print what
    each rule guards, in the order they are tried."""
    rules = service_rules(settings(rules=str(file))).rules
    tables = sorted({f"{r.table}.{r.key_column}" for r in rules if r.follows_table})
    fed = sorted({r.filter for r in rules if not r.follows_table})
    console.print(
        f"{file}: {len(rules)} rule{'s' if len(rules) != 1 else ''}; follows "
        f"{', '.join(tables) or 'no table'}; filters fed through the API: "
        f"{', '.join(fed) or 'none'}",
        markup=False,
        highlight=False,
    )
    for rule in rules:
        console.print(f"  {rule.describe()}", markup=False, highlight=False)
