"""Markdown every report uses: tables, numbers and verdicts."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


def table(headers: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def n(x: int) -> str:
    return f"{x:,}"


def pct(x: float, digits: int = 2) -> str:
    return f"{100 * x:.{digits}f} %"


def f2(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f}"


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("**met**" if ok else "**NOT met**")


@dataclass(frozen=True)
class Row:
    """One figure of a suite's report (``figures_report``), under its section."""

    section: str
    figure: str
    value: float
    unit: str
    note: str = ""


def figures_report(
    doc: str,
    targets: list[tuple[str, str, bool]],
    notes: str,
    rows: list[Row],
    value: Any,
) -> str:
    """A suite's report of figure rows (each with .section, .figure, .note; ``value(row)``
    formats its value): the module docstring's text between its first paragraph and "The
    pipeline", the targets, the notes, then one table per section."""
    out = [doc.split("\n\n", 1)[1].split("\n\nThe pipeline")[0].strip(), ""]
    out += ["## Targets", "", "| target | measured | met |", "| --- | ---: | --- |"]
    out += [f"| {t} | {v} | {'yes' if ok else '**no**'} |" for t, v, ok in targets]
    out += ["", notes]
    section = None
    for row in rows:
        if row.section != section:
            section = row.section
            out += ["", f"## {section}", "", "| figure | value | note |", "| --- | ---: | --- |"]
        out.append(f"| {row.figure} | {value(row)} | {row.note} |")
    return "\n".join(out)
