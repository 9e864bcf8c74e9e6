"""`python -m bench mutations --quick` runs end to end through the shared pipeline and writes its
report: every mutation at 50 % and 90 % load against the floor, the longest calls at 95 %, the
kick step (no timing asserts: the figures are measured, not judged, here)."""

from __future__ import annotations

from pathlib import Path

from tests.bench.test_bench_smoke import assert_common_header, bench, table_rows


def test_quick_run_writes_the_report(tmp_path: Path) -> None:
    out = tmp_path / "bench-mutations.md"
    bench("mutations", "--quick", "--out", str(out))
    doc = out.read_text()
    assert_common_header(doc, "mutations")
    costs = table_rows(doc, "## Server CPU per item, against the floor")
    assert costs == ["insert", "insert_many", "delete", "delete_many"] * 2
    worst = table_rows(doc, "## The longest script call at 95 % load")
    assert [row.split(",")[0].split("(")[0] for row in worst] == [
        "insert",
        "insert_many",
        "delete",
        "delete_many",
    ]
    assert "one kick step, CPU µs" in table_rows(doc, "## One kick step")
