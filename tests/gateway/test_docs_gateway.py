"""docs/gateway.md shows the files the tests run, as they are, and the answers the tests see."""

from __future__ import annotations

import re

from app.rules import read_rules
from devkit.gateways import DEPLOY, RULES
from tests.gateway.test_route import HOSTILE

DOC = DEPLOY.parent / "docs" / "gateway.md"
EMBEDDED = re.compile(r"<!-- file: (\S+) -->\n```\w*\n(.*?)```\n", re.S)


def test_every_deploy_file_is_shown_as_it_is() -> None:
    shown = dict(EMBEDDED.findall(DOC.read_text()))
    files = {
        str(p.relative_to(DEPLOY.parent))
        for p in DEPLOY.rglob("*")
        if p.is_file() and p.parent.name != "postgres"
    }
    assert set(shown) == files
    for path, text in shown.items():
        assert (DEPLOY.parent / path).read_text() == text, path


def test_hostile_header_answers_are_documented() -> None:
    doc = DOC.read_text()
    for name, _route, _headers, (status, decision), reason in HOSTILE:
        assert reason in doc, name
        if reason:
            row = next(line for line in doc.splitlines() if f"| `{reason}` |" in line)
            assert f"| {status} {decision} |" in row, (name, row)


def test_rules_check_output_is_what_the_command_prints() -> None:
    doc = DOC.read_text()
    for rule in read_rules(RULES):
        assert f"  {rule.describe()}\n" in doc, rule.name
