"""Outage figures: how long requests wait while Redis is stopped or frozen, and how long after
it is back until every answer is healthy.

The tests (tests/reliability/test_outages.py) check what the scheduler cannot change: no 500,
the right fail-open/closed answers, at most one Redis timeout waited per request (counted), a
healthy service afterwards. How many seconds that takes depends on the machine's load, so the
figures are measured here, with the same service, Redis and load as the test, and go into
docs/reliability.md.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path

from devkit.outage import COOLDOWN, TIMEOUT, Load, Stack, outage, recovery_seconds

KINDS = ("present", "absent", "check", "add")


async def one_case(mode: str, fail_open: bool) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="guard-bench-outage-") as tmp:
        stack = Stack(Path(tmp))
        try:
            app = stack.start_app(fail_open=str(fail_open).lower())
            load = Load(app.url)
            marks = await outage(stack, load, down=2.0, mode=mode)
        finally:
            stack.close()
    figures = {"recovery": recovery_seconds(load.samples, marks["back"])}
    for kind in KINDS:
        figures[kind] = max((s.seconds for s in load.samples if s.kind == kind), default=0.0)
    return figures


CASES = [(mode, fail_open) for mode in ("stop", "freeze") for fail_open in (True, False)]


def intro(runs: int) -> str:
    return (
        f"GUARD_REDIS_TIMEOUT={TIMEOUT} s, GUARD_REDIS_COOLDOWN={COOLDOWN} s, Redis down 2 s, "
        f"8 clients; load average at start {os.getloadavg()[0]:.2f}; {runs} run(s) per case"
    )


HEAD = (
    "| case | recovery | longest record read | longest filter check | longest add |\n"
    "| --- | --- | --- | --- | --- |"
)


def case_name(mode: str, fail_open: bool) -> str:
    return f"{mode}, {'open' if fail_open else 'closed'}"


def measure(mode: str, fail_open: bool, runs: int) -> list[dict[str, float]]:
    return [asyncio.run(one_case(mode, fail_open)) for _ in range(runs)]


def row(name: str, cases: list[dict[str, float]]) -> str:
    """The case's table row: each figure's range over the runs."""

    def span(key: str, cases: list[dict[str, float]] = cases) -> str:
        lo, hi = min(c[key] for c in cases), max(c[key] for c in cases)
        return f"{lo:.2f} s" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f} to {hi:.2f} s"

    reads = [{"read": max(c["present"], c["absent"])} | c for c in cases]
    return (
        f"| {name} | {span('recovery')} | {span('read', reads)} | {span('check')} | {span('add')} |"
    )
