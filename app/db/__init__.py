"""The guarded resource's database of record: SQLite (embedded default) or PostgreSQL.

`open_database` picks one by GUARD_DATABASE_URL from the databases registered below; each
implements `Database` (app/db/base.py), change log included, on `BaseDatabase`
(app/db/common.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from app.db.base import (
    Database,
    DatabaseSetupError,
    RecordInputError,
    SnapshotHook,
    Stored,
    TableSpec,
    parse_columns,
    redacted_url,
)
from app.db.common import BaseDatabase
from app.db.registry import backend_for, register
from app.db.sqlite import SQLiteDatabase, sqlite_path

if TYPE_CHECKING:  # app.settings checks its values with app.db.base: no import at run time
    from app.settings import Settings

# One line a database: its class (imported when a URL names it, so a driver loads only for
# its own URLs) and the URL forms that choose it, as the settings' message shows them.
register("app.db.sqlite:SQLiteDatabase", "sqlite:///<path>")
register("app.db.postgres:PostgresDatabase", "postgresql://...", "postgres://...")

__all__ = [
    "BaseDatabase",
    "Database",
    "DatabaseSetupError",
    "RecordInputError",
    "SQLiteDatabase",
    "SnapshotHook",
    "Stored",
    "TableSpec",
    "open_database",
    "redacted_url",
    "register",
    "sqlite_path",
    "table_spec",
]


def table_spec(settings: Settings) -> TableSpec:
    """The guarded table the settings name (GUARD_RECORDS_TABLE, _KEY_COLUMN, _COLUMNS)."""
    return TableSpec(
        table=settings.records_table,
        key_column=settings.records_key_column,
        columns=parse_columns(settings.records_columns),
        prefix=settings.feed_prefix,
    )


async def open_database(
    settings_or_url: Settings | str, latency_ms: float = 0.0, table: TableSpec | None = None
) -> Database:
    """Connect to the database GUARD_DATABASE_URL names, installing its change log if needed.

    Given Settings, the URL, latency and guarded table all come from them. A URL no database
    is registered for is a DatabaseSetupError saying which are.
    """
    if isinstance(settings_or_url, str):
        url = settings_or_url
    else:
        url = settings_or_url.database_url
        latency_ms = settings_or_url.db_latency_ms
        table = table_spec(settings_or_url)
    try:
        backend = backend_for(url)
    except ValueError as exc:
        raise DatabaseSetupError(f"GUARD_DATABASE_URL: {exc}") from None
    return await backend.load().open(url, latency_ms, table)
