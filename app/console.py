"""The `guard` console script. pip installs it with the library alone too, which has no
command line: there it says in one line which extra to install instead of an ImportError."""

from __future__ import annotations

import sys

OWN_PACKAGES = {"app", "guard"}


def missing_extra(module: str) -> str:
    return (
        f"guard: the command line needs the server extra ({module} is not installed): "
        "pip install 'cuckoo-guard[server]', or 'cuckoo-guard[server,embedded]' for the "
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
        raise SystemExit(2) from None
    run()
