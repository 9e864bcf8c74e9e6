"""`import guard` is free: each public name is imported from its module when first used."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import guard


def fresh(code: str) -> object:
    """What ``code`` prints (as JSON) in a new interpreter."""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(run.stdout)


def test_import_guard_imports_neither_redis_nor_numpy() -> None:
    code = (
        "import json, sys, guard; print(json.dumps([m in sys.modules for m in ('redis', 'numpy')]))"
    )
    assert fresh(code) == [False, False]


def test_every_public_name_is_its_modules_own() -> None:
    """Each name in __all__ is found, is the object its module defines, and nothing else is
    offered as public."""
    assert sorted(guard._MODULE_OF) == sorted(guard.__all__)
    for name in guard.__all__:
        module = importlib.import_module(guard._MODULE_OF[name])
        assert getattr(guard, name) is getattr(module, name), name


def test_submodules_and_unknown_names() -> None:
    from guard import hashing

    assert hashing.__name__ == "guard.hashing"
    code = (
        "import json, guard\n"
        "try:\n    guard.Nope\nexcept AttributeError as e:\n    print(json.dumps(str(e)))"
    )
    assert fresh(code) == "module 'guard' has no attribute 'Nope'"
