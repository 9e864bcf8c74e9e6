"""PostgreSQL databases of a run's own on the machine's server, created and dropped by name.

The server: GUARD_TEST_POSTGRES_URL, default the local PostgreSQL 15 with trust auth (as in
CI). Nothing here skips: an unreachable server is an error, so a test that needs PostgreSQL
fails without it.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import urlsplit, urlunsplit

import asyncpg

DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
NAME = re.compile(r"[a-z][a-z0-9_]{0,30}")


def server_url() -> str:
    """The maintenance database's URL: where databases are created and dropped."""
    return os.environ.get("GUARD_TEST_POSTGRES_URL", DEFAULT_URL)


def database_url(name: str, base: str | None = None) -> str:
    """The URL of database `name` on the server of `base` (default: server_url())."""
    parts = urlsplit(base or server_url())
    return urlunsplit(parts._replace(path=f"/{name}"))


async def create_database(prefix: str) -> str:
    """A new empty database `<prefix><random>`; returns its URL."""
    name = f"{prefix}{uuid.uuid4().hex[:12]}"
    if not NAME.fullmatch(name):
        raise ValueError(f"database prefix must be lower-case letters, digits, _: {prefix!r}")
    await _on_server(f'CREATE DATABASE "{name}"')
    return database_url(name)


async def drop_database(url: str) -> None:
    """Drop the database of `url`, closing whatever is still connected to it."""
    name = urlsplit(url).path.lstrip("/")
    if not NAME.fullmatch(name):
        raise ValueError(f"not a database this module creates: {name!r}")
    await _on_server(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


async def _on_server(statement: str) -> None:
    """One statement on the maintenance database (CREATE / DROP DATABASE run outside a
    transaction, on a connection to another database)."""
    conn = await asyncpg.connect(server_url(), timeout=10)
    try:
        await conn.execute(statement)
    finally:
        await conn.close()


@asynccontextmanager
async def temporary_database(prefix: str) -> AsyncIterator[str]:
    """A database for the block (its URL), dropped after it."""
    url = await create_database(prefix)
    try:
        yield url
    finally:
        await drop_database(url)
