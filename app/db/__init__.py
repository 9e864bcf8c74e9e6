"""The guarded resource's database of record: SQLite (embedded default) or PostgreSQL.

`open_database` picks one by GUARD_DATABASE_URL; both implement `Database` (app/db/base.py),
change log included.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from app.db.base import (
    POSTGRES_SCHEMES,
    Database,
    DatabaseSetupError,
    RecordInputError,
    SnapshotHook,
    Stored,
    TableSpec,
    parse_columns,
    redacted_url,
)
from app.db.sqlite import SQLiteDatabase, sqlite_path

if TYPE_CHECKING:  # app.settings checks its values with app.db.base: no import at run time
    from app.settings import Settings

__all__ = [
    "Database",
    "DatabaseSetupError",
    "RecordInputError",
    "SQLiteDatabase",
    "SnapshotHook",
    "Stored",
    "TableSpec",
    "open_database",
    "redacted_url",
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

    Given Settings, the URL, latency and guarded table all come from them.
    """
    if isinstance(settings_or_url, str):
        url = settings_or_url
    else:
        url = settings_or_url.database_url
        latency_ms = settings_or_url.db_latency_ms
        table = table_spec(settings_or_url)
    if url.startswith(POSTGRES_SCHEMES):
        from app.db.postgres import PostgresDatabase

        pg = PostgresDatabase(url, latency_ms, table)
        await pg.connect()
        return pg
    db = SQLiteDatabase(sqlite_path(url), latency_ms, table)
    await db.connect()
    return db
