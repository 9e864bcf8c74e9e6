"""`python -m bench gateway --quick` end to end: real nginx, the guard, wrk; its report has the
three comparisons the issue asks for (no timing asserts)."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.bench.test_bench_smoke import assert_common_header, bench, table_rows


def test_quick_run_writes_the_report(tmp_path: Path) -> None:
    for program in ("wrk", "nginx"):  # .ci/run installs both: fail, never skip
        assert shutil.which(program), f"{program} is missing (.ci/run installs it)"
    out = tmp_path / "bench-gateway.md"
    bench("gateway", "--quick", "--out", str(out))
    doc = out.read_text()
    assert_common_header(doc, "gateway")
    assert "nginx" in table_rows(doc, "## Environment")
    assert [row[:3] for row in table_rows(doc, "## Summary")] == [
        "(a)", "(b)", "(b)", "(b)", "(b)", "(c)", "(c)",
    ]  # fmt: skip
    for heading in (
        "## (a) Blocked requests",
        "## (b) Present keys: what the guard hop adds",
        "## (c) The authorisation route against a bare ASGI app",
    ):
        assert heading in doc, heading
    assert table_rows(doc, "## (c) The authorisation route") == [
        "route, present key", "route, absent key", "bare ASGI app, 204",
        "bare ASGI app, one Redis GET, 204",
    ]  # fmt: skip
    assert table_rows(doc, "## (b) Present keys")[:3] == [
        "present: nginx + guard -> backend", "present: nginx -> backend",
        "present: nginx + bare hop -> backend",
    ]  # fmt: skip
