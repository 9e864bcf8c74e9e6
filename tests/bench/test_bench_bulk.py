"""`python -m bench bulk --quick` runs end to end through the shared pipeline on a small file
and writes its report (no timing asserts: the figures are measured, not judged, here)."""

from __future__ import annotations

from pathlib import Path

from tests.bench.test_bench_smoke import assert_common_header, bench


def test_quick_run_writes_the_report(tmp_path: Path) -> None:
    out = tmp_path / "bench-bulk.md"
    bench("bulk", "--quick", "--items", "30000", "--sample", "5000", "--out", str(out))
    doc = out.read_text()
    assert_common_header(doc, "bulk")
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
