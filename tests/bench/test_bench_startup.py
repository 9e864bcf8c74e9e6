"""`python -m bench startup --quick` runs end to end through the shared pipeline and writes its
report (no timing asserts: the figures are measured, not judged, here)."""

from __future__ import annotations

from pathlib import Path

from tests.bench.test_bench_smoke import assert_common_header, bench


def test_quick_run_writes_the_report(tmp_path: Path) -> None:
    out = tmp_path / "bench-startup.md"
    bench("startup", "--quick", "--out", str(out))
    doc = out.read_text()
    assert_common_header(doc, "startup")
    for heading in (
        "## bytecode cached (as after a command's first run)",
        "## no bytecode cache (PYTHONDONTWRITEBYTECODE=1)",
        "## `guard load NAME FILE --create`, 100,000 keys, end to end (bytecode cached)",
    ):
        assert heading in doc, heading
    section = doc.split("## bytecode cached", 1)[1].split("\n## ", 1)[0]
    figures = [line.split("|")[1].strip() for line in section.splitlines()[4:] if line]
    assert figures == [
        "python -c pass",
        "python -c 'import guard'",
        "python -c 'import typer, redis'",
        "guard --help",
        "guard check NAME ITEM",
    ]
