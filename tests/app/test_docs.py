"""The curl examples of docs/service.md and README.md, run as they stand against a real uvicorn."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from devkit.keys import delete_prefixed_at
from devkit.processes import HttpProcess, free_port

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "service.md"
README = ROOT / "README.md"
BLOCK = re.compile(r"^```bash\n(.*?)^```", re.S | re.M)
EXPECT = re.compile(r"^# → (\d{3})\b", re.M)
API_KEY = "docs-example-key"


def examples(doc: Path = DOC) -> list[str]:
    return BLOCK.findall(doc.read_text())


@pytest.fixture
def server(request: pytest.FixtureRequest, backend: str, tmp_path: Path) -> Iterator[str]:
    """uvicorn app.main:app on a free port, configured through GUARD_* variables only."""
    port = free_port()
    prefix = f"test:docs:{uuid.uuid4().hex[:12]}:"
    redis_url = request.getfixturevalue("app_redis_url") if backend == "redis" else "memory://"
    env = {
        **os.environ,
        "GUARD_REDIS_URL": redis_url,
        "GUARD_KEY_PREFIX": prefix,
        "GUARD_DATABASE_URL": f"sqlite:///{tmp_path}/records.db",
        "GUARD_API_KEY": API_KEY,
        "GUARD_DEMO_RECORDS": "100",
    }
    argv = [sys.executable, "-m", "uvicorn", "app.main:app", "--host", "127.0.0.1",
            "--port", str(port), "--log-level", "warning"]  # fmt: skip
    app = HttpProcess.start(
        argv, port=port, env=env, log=tmp_path / "uvicorn.log", timeout=20, cwd=ROOT
    )
    try:
        yield f"127.0.0.1:{port}"
    finally:
        app.stop()
        if backend == "redis":
            delete_prefixed_at(redis_url, prefix)


def test_doc_has_an_example_for_every_route() -> None:
    text = "\n".join(examples())
    for needle in [
        "/health", "/metrics", "/stats", "-X PUT localhost:8000/filters/users ",
        "localhost:8000/filters/users\n", "localhost:8000/filters\n", "/add", "/check",
        "/filters/users/delete", "-X PUT localhost:8000/filters/users/items/",
        "localhost:8000/filters/users/items/dave\n",
        "-X DELETE localhost:8000/filters/users/items/", "-X DELETE localhost:8000/filters/users ",
        "/records/user-42", "-X PUT localhost:8000/records/", "-X DELETE localhost:8000/records/",
        "/rebuild",
    ]:  # fmt: skip
        assert needle in text, needle


def test_every_example_runs(server: str, tmp_path: Path) -> None:
    blocks = examples()
    assert len(blocks) >= 20
    run_blocks(blocks, server, tmp_path)


def test_readme_examples_run(server: str, tmp_path: Path) -> None:
    blocks = examples(README)
    assert len(blocks) >= 2
    run_blocks(blocks, server, tmp_path)


def run_blocks(blocks: list[str], server: str, tmp_path: Path) -> None:
    codes_file = tmp_path / "codes"
    # Each curl also writes its status code to a file, which the test compares with the
    # "# → NNN" comments of the block, in order.
    prelude = (
        'curl() { command curl -sS -o /dev/null -w \'%{http_code}\\n\' "$@" >> "$CODES"; }\n'
        "set -e\n"
    )
    for block in blocks:
        expected = EXPECT.findall(block)
        assert expected, f"example without '# → status':\n{block}"
        codes_file.write_text("")
        script = prelude + block.replace("localhost:8000", server)
        run = subprocess.run(
            ["bash", "-c", script],
            env={**os.environ, "GUARD_API_KEY": API_KEY, "CODES": str(codes_file)},
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert run.returncode == 0, f"{block}\n{run.stderr}"
        assert codes_file.read_text().split() == expected, block


@pytest.mark.parametrize("backend", ["redis"])
def test_full_filter_example_answers_as_documented(server: str, tmp_path: Path) -> None:
    """The 507 example's body: its figure is a placeholder (it varies with the random seed)
    and the rest of the message is what the service says."""
    (block,) = [b for b in examples() if "# → 507" in b]
    documented = re.search(r'# → 507 \{"detail": "([^"]*)"', block)[1]  # type: ignore[index]
    assert not re.search(r"\d+ of 200", documented), "a figure that varies, printed as fixed"
    prelude = 'curl() { command curl -sS "$@"; echo; }\nset -e\n'
    run = subprocess.run(
        ["bash", "-c", prelude + block.replace("localhost:8000", server)],
        env={**os.environ, "GUARD_API_KEY": API_KEY}, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    answer = json.loads(run.stdout.strip().splitlines()[-1])
    pattern = re.escape(documented).replace("N", r"\d+")
    assert re.fullmatch(pattern, answer["detail"]), (documented, answer["detail"])
    assert answer["results"][0] is True and answer["results"][-1] is False
