"""`guard demo` and `guard serve` as a user runs them: real processes, embedded Redis."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_demo_runs_on_a_fresh_machine(tmp_path: Path) -> None:
    """No GUARD_* settings at all: embedded Redis, seeded records; it exits 0 by itself and
    reports blocked reads and database queries saved."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GUARD_")}
    run = subprocess.run(
        [sys.executable, "-m", "app.cli", "demo", "--duration", "3", "--records", "500"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr + run.stdout
    out = run.stdout
    for label in ("requests", "blocked by the filter", "passed to the app", "database queries",
                  "database queries saved", "false positives (observed)",
                  "false-positive rate (estimate)"):  # fmt: skip
        assert label in out, out
    blocked = int(re.search(r"the filter blocked ([\d,]+) reads", out)[1].replace(",", ""))  # type: ignore[index]
    assert blocked > 100
    assert not list(tmp_path.iterdir())  # its scratch data went to a temporary directory
