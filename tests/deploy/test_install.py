"""Every install comes from uv.lock: README's commands, .ci/run and the Dockerfile agree, the
lock agrees with pyproject.toml, and the library installs without the service's stack."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIBRARY_DEPS = {"redis", "mmh3", "numpy"}


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return [
        line for block in re.findall(r"```sh\n(.*?)```", text, re.S) for line in block.splitlines()
    ]


def locked_version(name: str) -> str:
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    (version,) = [p["version"] for p in lock["package"] if p["name"] == name]
    return str(version)


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    tests = [c for c in readme_commands() if "pytest" in c]
    assert len(tests) == 1 and tests[0] in ci, tests


def test_every_install_is_locked_and_pins_the_locked_uv() -> None:
    uv = locked_version("uv")
    installs = [
        *[c for c in readme_commands() if "uv " in c],
        *[c for c in (ROOT / ".ci" / "run").read_text().splitlines() if "uv " in c],
        *[c for c in (ROOT / "Dockerfile").read_text().splitlines() if "uv " in c],
    ]
    assert len(installs) >= 4, installs
    for line in installs:
        if "pip install uv" in line:
            assert f"pip install uv=={uv}" in line, (line, uv)
        if re.search(r"\buv (run|sync)\b", line):
            assert "--locked" in line, line
    assert not any("pip install -e" in c or "pip install ." in c for c in installs)


def test_lock_agrees_with_pyproject() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "uv", "lock", "--check", "--offline"],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr


def test_the_library_needs_only_its_own_dependencies() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[\[<>=~; ]", d, maxsplit=1)[0] for d in project["dependencies"]}
    assert names == LIBRARY_DEPS
    allowed = LIBRARY_DEPS | {"guard"} | set(sys.stdlib_module_names)
    for path in sorted((ROOT / "guard").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                tops = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                tops = [node.module.split(".")[0]]
            else:
                continue
            assert set(tops) <= allowed, f"{path.relative_to(ROOT)}:{node.lineno} imports {tops}"
