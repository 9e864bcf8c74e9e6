"""Markdown every report uses: tables, numbers and verdicts."""

from __future__ import annotations

import math
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
