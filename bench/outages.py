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


def main(runs: int) -> int:
    print(
        f"GUARD_REDIS_TIMEOUT={TIMEOUT} s, GUARD_REDIS_COOLDOWN={COOLDOWN} s, Redis down 2 s, "
        f"8 clients; load average at start {os.getloadavg()[0]:.2f}; {runs} run(s) per case"
    )
    print("| case | recovery | longest record read | longest filter check | longest add |")
    print("| --- | --- | --- | --- | --- |")
    for mode in ("stop", "freeze"):
        for fail_open in (True, False):
            cases = [asyncio.run(one_case(mode, fail_open)) for _ in range(runs)]

            def span(key: str, cases: list[dict[str, float]] = cases) -> str:
                lo, hi = min(c[key] for c in cases), max(c[key] for c in cases)
                return f"{lo:.2f} s" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f} to {hi:.2f} s"

            reads = [{"read": max(c["present"], c["absent"])} | c for c in cases]
            print(
                f"| {mode}, {'open' if fail_open else 'closed'} | {span('recovery')} "
                f"| {span('read', reads)} | {span('check')} | {span('add')} |"
            )
    return 0
