"""The `guard` console script. A library-only install has it too, with no command line behind
it: there it says in one line which extra to install instead of an ImportError."""

from __future__ import annotations

import sys

OWN_PACKAGES = {"app", "guard"}


def missing_extra(module: str) -> str:
    return (
        f"error: the command line needs cuckoo-guard's 'server' extra ({module} is not "
        "installed): pip install '/path/to/cuckoo-guard[server]' from a checkout, or the "
        "wheel uv build makes with [server] after its name; [server,embedded] adds the "
        "embedded Redis"
    )


def main() -> None:
    try:
        from app.cli import main as run
    except ModuleNotFoundError as exc:
        module = (exc.name or "").partition(".")[0]
        if not module or module in OWN_PACKAGES:
            raise  # a broken install, not a missing extra: keep the traceback
        print(missing_extra(module), file=sys.stderr)
        raise SystemExit(1) from None
    run()
