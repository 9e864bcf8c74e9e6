"""`python -m bench.bulk` runs end to end on a small file and writes its report (no timing
asserts: the figures are measured, not judged, here)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_small_run_writes_the_report(tmp_path: Path) -> None:
    out = tmp_path / "bench-bulk.md"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.bulk", "--items", "30000", "--sample", "5000",
         "--out", str(out)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = out.read_text()
    for heading in (
        "## Targets",
        "## `guard load --create`, 30,000 keys from a file (child process)",
        "## library `bulk_load`, 30,000 keys from the file, capacity = keys",
        "## `insert_many` vs the builder",
        "## asyncio, a records rebuild's shape",
        "## answers of the CLI-built filter",
    ):
        assert heading in doc, heading
    assert "| zero false negatives | 0 | yes |" in doc
    assert "Command: `python -m bench.bulk --items 30000 --sample 5000" in doc
