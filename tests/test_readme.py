"""README.md's library examples run as written: each ```python block is a whole program, run
(twice: nothing it makes is in its way the second time) against a real redis-server of this
test's own, and each line it prints is what the comment beside its print() says."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from devkit.redis_server import RedisProcess

ROOT = Path(__file__).resolve().parents[1]
README_URL = "redis://localhost:6379/0"  # the examples' Redis, a reader's local server


def examples() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def promised(program: str) -> list[str]:
    """What each print() line promises to print: its comment, up to the first ':' or ' ('
    (what follows explains it)."""
    return [
        re.split(r":| \(", line.split("# ", 1)[1], maxsplit=1)[0].strip()
        for line in program.splitlines()
        if line.lstrip().startswith("print(") and "# " in line
    ]


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    server = RedisProcess.start()
    try:
        yield server.url
    finally:
        server.stop()


def test_the_readme_has_library_examples() -> None:
    programs = examples()
    assert programs and all(README_URL in p and promised(p) for p in programs)


@pytest.mark.parametrize("number", range(len(examples())))
def test_example_runs_as_written(number: int, redis_url: str, tmp_path: Path) -> None:
    program = examples()[number]
    script = tmp_path / "example.py"
    script.write_text(program.replace(README_URL, redis_url))
    for _ in range(2):
        run = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, timeout=60, cwd=tmp_path
        )
        assert run.returncode == 0, run.stderr
        assert run.stdout.splitlines() == promised(program)


# `pip install cuckoo-guard`, `pip install 'cuckoo-guard[server]'`: the package by its name,
# which only a package index could answer (a path or a wheel file is what can be installed).
FROM_AN_INDEX = re.compile(r"pip install +['\"]?cuckoo-guard\b")


@pytest.mark.parametrize(
    "doc", [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.name
)
def test_no_install_from_an_index_it_is_not_on(doc: Path) -> None:
    """The project is not published: every install the docs show is from a checkout or a
    built wheel."""
    lines = [line for line in doc.read_text().splitlines() if FROM_AN_INDEX.search(line)]
    assert not lines, lines
