"""`python -m bench perf --quick` runs end to end and produces its report (no timing asserts)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class TestPerfQuick:
    """The quick benchmark against a private redis-server it starts itself."""

    def test_quick_run_writes_report_and_plots(self, tmp_path: Path) -> None:
        # Fails rather than skips: .ci/run installs wrk, and a skipped smoke test proves nothing.
        assert shutil.which("wrk"), "wrk is missing: apt-get install wrk (as .ci/run does)"
        out = tmp_path / "benchmarks.md"
        proc = subprocess.run(
            [sys.executable, "-m", "bench", "perf", "--quick", "--out", str(out)],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        doc = out.read_text()
        for heading in (
            "## Targets",
            "## Server cost per operation",
            "## Library throughput, one Python process",
            "## HTTP, one uvicorn worker",
            "### Auto-batching",
            "## Attack shielding",
            "## Accuracy and space",
            "## Scaling",
            "## README headline table",
        ):
            assert heading in doc, heading
        assert "| lookup, server us per call |" in doc
        assert "baseline: FastAPI + one Redis GET" in doc
        for png in ("perf-server-cost", "perf-http", "perf-accuracy", "perf-scaling"):
            assert (tmp_path / "img" / f"{png}.png").stat().st_size > 0
        assert "## targets" in proc.stdout
