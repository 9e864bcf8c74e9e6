"""Which database a GUARD_DATABASE_URL names: one registry of URL schemes.

Each database is registered once, in app/db/__init__.py, with the class that implements it
and the URL forms it takes. `open_database`, the settings' check of GUARD_DATABASE_URL and
the message naming what it accepts all read this registry, so a further database is its
module plus one `register` line (docs/postgresql.md, "Adding a database").
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the implementations import this package: only their type here
    from app.db.common import BaseDatabase

# A URL form as messages show it: the scheme and its slashes (what a URL must start with,
# case as written), then `...` or a `<placeholder>` for the rest.
FORM = re.compile(r"(?P<prefix>[a-z][a-z0-9+.-]*:/*)(?:\.\.\.|<[^<>]+>)")


@dataclass(frozen=True)
class Backend:
    """A registered database: its class, and the URL forms that choose it."""

    target: str  # "package.module:Class", imported only when a URL names it
    forms: tuple[str, ...]  # e.g. "postgresql://...", "sqlite:///<path>"

    @property
    def prefixes(self) -> tuple[str, ...]:
        return tuple(_prefix(form) for form in self.forms)

    def load(self) -> type[BaseDatabase]:
        """The class, its module imported now (so a driver loads only for its own URLs)."""
        from app.db.common import BaseDatabase

        module, _, name = self.target.partition(":")
        cls = getattr(importlib.import_module(module), name)
        if not (isinstance(cls, type) and issubclass(cls, BaseDatabase)):
            raise TypeError(f"{self.target} is registered as a database but is no BaseDatabase")
        return cls


BACKENDS: list[Backend] = []  # in the order registered (the order messages list them)


def _prefix(form: str) -> str:
    found = FORM.fullmatch(form)
    if found is None:
        raise ValueError(f"{form!r} is no URL form like 'mysql://...' or 'sqlite:///<path>'")
    return found["prefix"]


def register(target: str, *forms: str) -> Backend:
    """Choose `target` ("package.module:Class", a BaseDatabase) for the URLs of `forms`."""
    taken = {p for b in BACKENDS for p in b.prefixes}
    backend = Backend(target, forms)
    clash = [p for p in backend.prefixes if p in taken]
    if not forms or clash:
        raise ValueError(f"{target}: no URL form, or one registered already: {clash}")
    BACKENDS.append(backend)
    return backend


def accepted() -> str:
    """The URL forms registered, as a message lists them."""
    forms = [form for b in BACKENDS for form in b.forms]
    return " or ".join([", ".join(forms[:-1]), forms[-1]] if len(forms) > 1 else forms)


def backend_for(url: str) -> Backend:
    """The database `url` names; a ValueError saying what is accepted when none does."""
    for backend in BACKENDS:
        if url.startswith(backend.prefixes):
            return backend
    raise ValueError(f"got {url!r}; it accepts {accepted()}")
