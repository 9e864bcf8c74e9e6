"""Every install comes from uv.lock: README's commands, .ci/run and the Dockerfile agree, the
lock agrees with pyproject.toml, the library installs without the service's stack, and imports
flow one way: guard <- app <- app.cli; devkit <- tests, devkit <- bench."""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIBRARY_DEPS = {"redis", "mmh3", "numpy"}
# Each top-level package of the repository and the ones it may import (besides itself, the
# standard library and third-party packages). tests and bench share devkit, never each other.
LAYERS: dict[str, set[str]] = {
    "guard": set(),
    "app": {"guard"},
    # devkit starts the service (in process or as uvicorn) for tests and bench alike.
    "devkit": {"guard", "app"},
    "tests": {"guard", "app", "devkit"},
    "bench": {"guard", "app", "devkit"},
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import in ``path``, function-level ones too; relative imports
    resolved; ``from package import submodule`` names the submodule."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([base] if base else [])])
            for a in node.names:
                sub = f"{base}.{a.name}"
                is_module = (ROOT / sub.replace(".", "/")).with_suffix(".py").exists() or (
                    ROOT / sub.replace(".", "/") / "__init__.py"
                ).exists()
                out.append((node.lineno, sub if is_module else base))
    return out


def readme_layout() -> str:
    """The tree drawn in README.md's "Project layout" section."""
    text = (ROOT / "README.md").read_text().split("## Project layout", 1)[1]
    return text.split("```", 2)[1]


def source_files(top: str) -> list[Path]:
    return sorted((ROOT / top).rglob("*.py"))


def import_graph() -> dict[str, set[str]]:
    """Module -> the repository's modules it imports."""
    modules = {module_name(p): p for top in LAYERS for p in source_files(top)}
    return {
        name: {m for _, m in imports(path) if m in modules and m != name}
        for name, path in modules.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                found.append(sorted([v, *component]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


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


def uv(*args: str, cwd: Path = ROOT) -> str:
    run = subprocess.run(
        [sys.executable, "-m", "uv", *args], cwd=cwd, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr
    return run.stdout


@pytest.fixture(scope="module")
def library_env(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`uv venv` + `uv pip install .` with no extras: what `pip install cuckoo-guard` gives,
    at uv.lock's versions, built from a copy of the sources (the build leaves the tree alone)."""
    root = tmp_path_factory.mktemp("library")
    src, env = root / "src", root / "venv"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("guard", "app"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    pins = root / "pins.txt"
    pins.write_text(uv("export", "--frozen", "--no-hashes", "--no-emit-project"))
    uv("venv", "--quiet", "--python", sys.executable, str(env))
    uv(
        "pip",
        "install",
        "--quiet",
        "--python",
        str(env / "bin" / "python"),
        "-c",
        str(pins),
        str(src),
    )
    return env


class TestLibraryInstall:
    """`pip install cuckoo-guard` is the library: redis (with hiredis), mmh3, numpy."""

    def test_installs_the_library_dependencies_and_nothing_else(self, library_env: Path) -> None:
        listed = uv(
            "pip", "list", "--python", str(library_env / "bin" / "python"), "--format", "json"
        )
        names = {p["name"] for p in json.loads(listed)}
        # hiredis: redis[hiredis]; async-timeout only under Python 3.11.3 (redis-py's marker).
        assert names - {"async-timeout"} == {"cuckoo-guard", "redis", "hiredis", "mmh3", "numpy"}

    def test_the_library_imports_and_the_dev_helpers_are_not_installed(
        self, library_env: Path, tmp_path: Path
    ) -> None:
        code = (
            "import importlib.util as u, json, sys, guard; guard.SyncCuckooFilter;"
            "print(json.dumps([m for m in sys.argv[1:] if u.find_spec(m)]))"
        )
        run = subprocess.run(
            [str(library_env / "bin" / "python"), "-c", code, "guard", "app", "devkit", "tests",
             "bench", "fastapi", "typer"],
            cwd=tmp_path, capture_output=True, text=True, check=True,
        )  # fmt: skip
        assert json.loads(run.stdout) == ["guard", "app"]

    @pytest.mark.parametrize("argv", [[], ["serve"], ["--help"]])
    def test_the_command_says_which_extra_to_install(
        self, library_env: Path, argv: list[str]
    ) -> None:
        run = subprocess.run(
            [str(library_env / "bin" / "guard"), *argv], capture_output=True, text=True, timeout=60
        )
        assert run.returncode == 1, run.stderr
        lines = run.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), run.stderr
        assert (
            "'server' extra" in lines[0]
            and "pip install '/path/to/cuckoo-guard[server]'" in lines[0]
        )
        assert "embedded" in lines[0] and "typer" in lines[0], lines
        assert run.stdout == ""


def test_the_library_needs_only_its_own_dependencies() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[\[<>=~; ]", d, maxsplit=1)[0] for d in project["dependencies"]}
    assert names == LIBRARY_DEPS
    allowed = LIBRARY_DEPS | {"guard"} | set(sys.stdlib_module_names)
    for path in source_files("guard"):
        for line, module in imports(path):
            top = module.split(".")[0]
            assert top in allowed, f"{path.relative_to(ROOT)}:{line} imports {module}"


class TestLayers:
    """Dependencies flow one way: guard <- app <- app.cli; devkit <- tests and bench."""

    def test_each_package_imports_only_the_layers_below(self) -> None:
        wrong = [
            f"{path.relative_to(ROOT)}:{line} imports {module}"
            for top, below in LAYERS.items()
            for path in source_files(top)
            for line, module in imports(path)
            if module.split(".")[0] in LAYERS.keys() - below - {top}
        ]
        assert wrong == []

    def test_the_service_never_imports_its_command_line(self) -> None:
        # app.console, the console script, sits above the command line it starts.
        wrong = [
            f"{path.relative_to(ROOT)}:{line} imports {module}"
            for path in source_files("app")
            if not module_name(path).startswith(("app.cli", "app.console"))
            for line, module in imports(path)
            if module == "app.cli" or module.startswith("app.cli.")
        ]
        assert wrong == []

    def test_no_module_imports_itself_through_others(self) -> None:
        assert cycles(import_graph()) == []

    def test_the_cycle_finder_finds_a_cycle(self) -> None:
        graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
        assert cycles(graph) == [["a", "b", "c"]]

    def test_the_readme_layout_names_every_module(self) -> None:
        layout = readme_layout()
        missing = [
            str(path.relative_to(ROOT))
            for top in ("guard", "app", "devkit", "bench")
            for path in sorted((ROOT / top).glob("*.py"))
            if path.stem not in ("__init__", "__main__") and path.name not in layout
        ]
        assert missing == [], "README.md's Project layout omits these"

    def test_the_readme_layout_names_only_modules_that_exist(self) -> None:
        """Each ``name.py`` it lists is in the folder it is listed under (a stale or moved
        module is a wrong map)."""
        stale, folder = [], ""
        for line in readme_layout().splitlines():
            top = re.match(r"([a-z]+)/ ", line)
            if top:
                folder = top.group(1)
            for name in re.findall(r"\b[\w]+\.py\b", line):
                if not list((ROOT / folder).rglob(name)):
                    stale.append(f"{folder}/{name}")
        assert stale == []

    def test_only_the_library_and_the_service_are_installed(self) -> None:
        find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
        assert find["packages"]["find"]["include"] == ["guard*", "app*"]
