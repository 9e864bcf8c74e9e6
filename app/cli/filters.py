"""Filter commands: create, info, list, check, drop, load, export, import."""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TextIO

import typer

from app.cli.common import (
    NoProgress,
    Prefix,
    RedisUrl,
    cli,
    on_terminal,
    quick_settings,
    reader_gone,
    refuse_records_filter,
    rich_console,
    say,
    show,
    sync_redis,
)
from guard.names import NAME_RULE
from guard.params import DEFAULTS, FIELDS

if TYPE_CHECKING:
    from rich.progress import Progress
    from rich.table import Table

    from guard import FilterInfo, SyncCuckooFilter, SyncShardedCuckooFilter

Name = Annotated[str, typer.Argument(metavar="NAME", help=f"Filter name ({NAME_RULE}).")]
Force = Annotated[
    bool, typer.Option("--force", help="Allow changing the service's records filter.")
]
AsJson = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


def _size(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{nbytes} B"


def _info_table(info: FilterInfo) -> Table:
    from rich.table import Table

    from guard import ShardedFilterInfo

    table = Table(title=f"filter {info.name}", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    rows: list[tuple[str, str]] = [
        ("items", f"{info.items:,}"),
        ("capacity", f"{slots(info):,} ({info.capacity:,} reserved)"),
        ("load factor", f"{info.load_factor:.3f}"),
        ("memory", _size(info.memory_bytes)),
        ("buckets", f"{info.buckets:,} x {info.bucket_size}"),
        ("fingerprint bits", str(info.fingerprint_bits)),
        ("sub-filters", str(info.subfilters)),
        ("expansion", str(info.expansion) if info.expansion else "0 (fixed size)"),
        ("error rate (estimate)", f"{info.error_rate:.2e}"),
        ("error rate (target)", f"{info.target_error_rate:g}" if info.target_error_rate else "-"),
        ("deletes / missed", f"{info.deletes:,} / {info.missed_deletes:,}"),
    ]
    if isinstance(info, ShardedFilterInfo):
        rows.insert(0, ("shards", str(info.shards)))
    for key, value in rows:
        table.add_row(key, value)
    return table


def slots(info: FilterInfo) -> int:
    """What the filter holds now, growth included (``capacity`` is what it was created for)."""
    return info.buckets * info.bucket_size


def open_filter(redis: Any, name: str, prefix: str) -> SyncCuckooFilter | SyncShardedCuckooFilter:
    """The filter called ``name``, plain or sharded (a missing one fails on first use). Only
    a name with no plain filter costs a SCAN for shards."""
    from guard import SyncCuckooFilter

    plain = SyncCuckooFilter(redis, name, prefix)
    if plain.exists():
        return plain
    from guard import SyncShardedCuckooFilter, list_sharded_filters_sync

    shards = list_sharded_filters_sync(redis, prefix).get(name)
    return plain if shards is None else SyncShardedCuckooFilter(redis, name, prefix, shards=shards)


def _option(name: str, *flags: str, metavar: str) -> Any:
    """A ``create`` option for FilterParams' ``name``, with its help (the library checks the
    value, so a bad one is the same one-line error as anywhere)."""
    spec = FIELDS[name]
    return typer.Option(*flags, metavar=metavar, help=f"{spec.help}: {spec.limit.describe()}.")


@contextmanager
def options_named() -> Iterator[None]:
    """A filter parameter the library refuses, named as the option that gave it: the rule
    says "error_rate", the user typed --error-rate."""
    from guard.errors import InvalidParameterError

    try:
        yield
    except InvalidParameterError as exc:
        text = str(exc)
        for name in FIELDS:
            text = re.sub(rf"\b{name}\b", "--" + name.replace("_", "-"), text)
        raise ValueError(text) from None


@cli.command()
def create(
    name: Name,
    capacity: Annotated[int, _option("capacity", "--capacity", "-c", metavar="N")],
    error_rate: Annotated[float | None, _option("error_rate", metavar="RATE")] = DEFAULTS[
        "error_rate"
    ],
    fingerprint_bits: Annotated[int | None, _option("fingerprint_bits", metavar="BITS")] = (
        DEFAULTS["fingerprint_bits"]
    ),
    bucket_size: Annotated[int, _option("bucket_size", metavar="B")] = DEFAULTS["bucket_size"],
    max_kicks: Annotated[int, _option("max_kicks", metavar="N")] = DEFAULTS["max_kicks"],
    expansion: Annotated[int, _option("expansion", metavar="K")] = DEFAULTS["expansion"],
    seed: Annotated[int | None, _option("seed", metavar="SEED")] = DEFAULTS["seed"],
    redis_url: RedisUrl = None,
    prefix: Prefix = None,
    force: Force = False,
) -> None:
    """Create a filter."""
    from guard import FilterParams, SyncCuckooFilter

    with options_named():
        params = FilterParams(
            capacity=capacity,
            error_rate=error_rate,
            fingerprint_bits=fingerprint_bits,
            bucket_size=bucket_size,
            max_kicks=max_kicks,
            expansion=expansion,
            seed=seed,
        )
    cfg = quick_settings(redis_url=redis_url, key_prefix=prefix)
    refuse_records_filter(cfg, name, force)
    with sync_redis(cfg) as redis, options_named():
        info = SyncCuckooFilter(redis, name, cfg.key_prefix).reserve(params)
    show(_info_table(info))


@cli.command()
def info(name: Name, redis_url: RedisUrl = None, prefix: Prefix = None, as_json: AsJson = False):
    """Show a filter's size, load and error rate."""
    cfg = quick_settings(redis_url=redis_url, key_prefix=prefix)
    with sync_redis(cfg) as redis:
        result = open_filter(redis, name, cfg.key_prefix).info()
    if as_json:
        import json

        say(json.dumps(_as_json(result), indent=2))
    else:
        show(_info_table(result))


def _as_json(info: FilterInfo) -> dict[str, Any]:
    out = info.as_dict()
    out.pop("per_shard", None)  # the totals are what a script wants; `info` shows one
    return out


@cli.command("list")
def list_(redis_url: RedisUrl = None, prefix: Prefix = None, as_json: AsJson = False) -> None:
    """List the filters (plain and sharded) under the key prefix."""
    from rich.table import Table

    from guard import ShardedFilterInfo
    from guard.listing import read_all_filters_sync

    cfg = quick_settings(redis_url=redis_url, key_prefix=prefix)
    with sync_redis(cfg) as redis:
        report = read_all_filters_sync(redis, cfg.key_prefix)
    infos = report.infos
    if report.damaged:  # not in the list, but not hidden either
        sys.stderr.write(f"damaged (drop or rebuild): {', '.join(report.damaged)}\n")
    if as_json:
        import json

        say(json.dumps([_as_json(i) for i in infos], indent=2))
        return
    if not infos:
        say("no filters")
        return
    table = Table(title=f"filters under {cfg.key_prefix!r}")
    for col in ("name", "shards", "items", "capacity", "sub-filters", "load", "memory"):
        table.add_column(col, justify="left" if col == "name" else "right")
    table.add_column("error rate", justify="right")
    for i in infos:
        table.add_row(
            i.name,
            str(i.shards) if isinstance(i, ShardedFilterInfo) else "-",
            f"{i.items:,}",
            f"{slots(i):,}",
            str(i.subfilters),
            f"{i.load_factor:.3f}",
            _size(i.memory_bytes),
            f"{i.error_rate:.1e}",
        )
    show(table)


@cli.command()
def check(
    name: Name,
    items: Annotated[
        list[str] | None,
        typer.Argument(metavar="ITEM", help='Items to look up; "-" reads them from stdin.'),
    ] = None,
    file: Annotated[
        Path | None,
        typer.Option(
            "--file", "-f", metavar="FILE", exists=True, dir_okay=False, help="Items, one a line."
        ),
    ] = None,
    redis_url: RedisUrl = None,
    prefix: Prefix = None,
) -> None:
    """Say whether each item is (probably) in a filter: exit status 0 if all are, 1 if not.

    Prints `present` or `absent` and the item, one a line. `present` may be a false
    positive (at the filter's error rate); `absent` is always true."""
    wanted = list(items or [])
    if "-" in wanted:
        wanted.remove("-")
        wanted += [line.rstrip("\r\n") for line in sys.stdin if line.rstrip("\r\n")]
    if file is not None:
        wanted += _items(file, None, header=False)
    if not wanted:
        raise ValueError("no items to check: give ITEM..., - for stdin, or --file")
    cfg = quick_settings(redis_url=redis_url, key_prefix=prefix)
    with sync_redis(cfg) as redis:
        cf = open_filter(redis, name, cfg.key_prefix)
        found = [hit for part in _batches(iter(wanted), 5000) for hit in cf.lookup_many(part)]
    status = 0 if all(found) else 1
    try:
        for item, hit in zip(wanted, found, strict=True):
            say(f"{'present' if hit else 'absent '} {item}")
        sys.stdout.flush()
    except BrokenPipeError:
        reader_gone(status)  # the answer stands, whoever stopped reading
    raise typer.Exit(status)


@cli.command()
def drop(
    name: Name,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask.")] = False,
    redis_url: RedisUrl = None,
    prefix: Prefix = None,
    force: Force = False,
) -> None:
    """Delete a filter."""
    from guard import GuardError, SyncCuckooFilter

    cfg = quick_settings(redis_url=redis_url, key_prefix=prefix)
    refuse_records_filter(cfg, name, force)
    if not yes:
        typer.confirm(f"drop filter {name!r}?", abort=True)
    with sync_redis(cfg) as redis:
        if not SyncCuckooFilter(redis, name, cfg.key_prefix).drop():
            raise GuardError(f"{name}: no such filter")
    say(f"dropped {name}")


def _count_lines(path: Path) -> int:
    lines = 0
    last = b"\n"
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            lines += block.count(b"\n")
            last = block[-1:]
    return lines + (last != b"\n")


def _not_utf8(path: Path) -> ValueError:
    """The error for a file that is not UTF-8 text, naming its first line that is not."""
    with path.open("rb") as f:
        for lineno, line in enumerate(f, start=1):  # \n never occurs inside a character
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as exc:
                return ValueError(
                    f"{path}:{lineno}: not UTF-8 text "
                    f"(byte {line[exc.start]:#04x} at position {exc.start + 1} of the line)"
                )
    return ValueError(f"{path}: not UTF-8 text")


def _items(path: Path, column: str | None, header: bool) -> Iterator[str]:
    """The items of a text file (one a line, blank lines skipped) or of a CSV column."""
    try:
        with path.open("r", encoding="utf-8", newline="") as f:
            if column is None:
                for line in f:
                    if item := line.rstrip("\r\n"):
                        yield item
            else:
                yield from _column(path, f, column, header)
    except UnicodeDecodeError:
        raise _not_utf8(path) from None


def _column(path: Path, f: TextIO, column: str, header: bool) -> Iterator[str]:
    """One column of a CSV file (its header name, or a 0-based index). Strict: a quote left
    open would otherwise swallow the rest of the file into one field, and the load succeed."""
    import csv

    rows = csv.reader(f, strict=True)
    start = 1  # the line the row being read starts on
    try:
        names = next(rows, []) if header else []
        start = rows.line_num + 1
        if column in names:
            index, label = names.index(column), f"column {column!r}"
        elif column.isdigit():
            index, label = int(column), f"column {column}"
        elif header:
            raise ValueError(f"{path}: no column {column!r} (columns: {', '.join(names)})")
        else:
            raise ValueError("--column must be a number with --no-header")
        for row in rows:
            if row and index >= len(row):
                fields = f"{len(row)} field{'s' if len(row) > 1 else ''}"
                raise ValueError(f"{path}:{rows.line_num}: the row has no {label} ({fields})")
            if row and row[index]:
                yield row[index]
            start = rows.line_num + 1
    except csv.Error as exc:
        # In strict mode the file ending inside quotes is the only "unexpected end of data".
        if rows.line_num > start or str(exc) == "unexpected end of data":
            raise ValueError(
                f"{path}:{start}: a quoted field starts in this row and is never closed"
            ) from None
        raise ValueError(f"{path}:{rows.line_num}: not valid CSV ({exc})") from None


def _batches(items: Iterator[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for item in items:
        batch.append(item)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


@cli.command()
def load(
    name: Name,
    file: Annotated[
        Path,
        typer.Argument(metavar="FILE", exists=True, dir_okay=False, help="Text or CSV file."),
    ],
    column: Annotated[
        str | None,
        typer.Option(
            metavar="COLUMN",
            help="CSV column (header name or 0-based index); without it, one item a line.",
        ),
    ] = None,
    header: Annotated[bool, typer.Option(help="The CSV's first row names the columns.")] = True,
    batch: Annotated[
        int, typer.Option(metavar="N", min=1, max=100_000, help="Items per round trip.")
    ] = 5000,
    create: Annotated[
        bool, typer.Option("--create", help="Create the filter if missing, sized for the file.")
    ] = False,
    error_rate: Annotated[
        float | None,
        typer.Option(
            metavar="RATE",
            help=f"Error rate for --create: {FIELDS['error_rate'].limit.describe()} "
            "(default GUARD_RECORDS_ERROR_RATE, as the service's records filter).",
        ),
    ] = None,
    redis_url: RedisUrl = None,
    prefix: Prefix = None,
    force: Force = False,
) -> None:
    """Bulk-insert items from a text file (one a line) or a CSV column: one copy per line,
    duplicates included (skipping "present" items could skip one whose fingerprint merely
    collides with another's, and deleting the other would then lose it)."""
    from guard import GuardError, SyncCuckooFilter

    cfg = quick_settings(redis_url=redis_url, key_prefix=prefix)
    refuse_records_filter(cfg, name, force)
    if column is None and file.suffix.lower() == ".csv":
        raise ValueError(f"{file} is a CSV file: say which --column to load")
    next(_items(file, column, header), None)  # a bad --column fails before anything is made
    with sync_redis(cfg) as redis:
        cf = SyncCuckooFilter(redis, name, cfg.key_prefix)
        if cf.exists():
            # Every row is read (and checked) before the first is inserted: a bad one further
            # down must not leave the filter half loaded.
            total = sum(1 for _ in _items(file, column, header))
            seen, added, elapsed = _load_into(cf, name, file, column, header, batch, total)
        elif create:
            # Sized as the service sizes its records filter; built whole in memory and swapped
            # in at once (guard/bulk.py): no half-loaded filter is ever visible, and a failed
            # build leaves nothing behind.
            total = max(0, _count_lines(file) - (1 if column is not None and header else 0))
            target = cfg.records_error_rate if error_rate is None else error_rate
            with options_named():
                seen, elapsed = _build(cf, name, file, column, header, total, cfg, target)
            added = seen
        else:
            raise GuardError(f"{name}: no such filter (create it, or pass --create)")
        result = cf.info()
    rate = seen / elapsed if elapsed > 0 else 0.0
    say(
        f"loaded {seen:,} items into {name!r} ({added:,} added) in {elapsed:.2f} s: "
        f"{rate:,.0f} items/s; load factor {result.load_factor:.3f}, {result.items:,} items, "
        f"{_size(result.memory_bytes)}, {result.subfilters} sub-filter(s)"
    )


def _progress() -> Progress | NoProgress:
    if not on_terminal():
        return NoProgress()
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TaskProgressColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    columns = [
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TaskProgressColumn(),
        TimeElapsedColumn(),
    ]
    return Progress(*columns, console=rich_console(), transient=False)


def _line_chunks(path: Path, block: int = 1 << 22) -> Iterator[list[bytes]]:
    """What ``_items(path, None, ...)`` yields, as bytes, a block of lines at a time.

    A line ends at \\n, \\r or \\r\\n (as text mode with newline="" reads it); empty lines
    are skipped; the file must be UTF-8. No Python string is made per line: for a 10M-line
    file this reads at several times the text reader's speed.
    """
    rest = b""
    with path.open("rb") as f:
        while block_data := f.read(block):
            data = rest + block_data
            cut = max(data.rfind(b"\n"), data.rfind(b"\r")) + 1  # never inside a character
            data, rest = data[:cut], data[cut:]
            if data:
                yield _lines(path, data)
    if rest:
        yield _lines(path, rest)


def _lines(path: Path, data: bytes) -> list[bytes]:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        raise _not_utf8(path) from None
    return list(filter(None, data.replace(b"\r", b"\n").split(b"\n")))


def _build(
    cf: SyncCuckooFilter,
    name: str,
    file: Path,
    column: str | None,
    header: bool,
    total: int,
    cfg: Any,
    error_rate: float,
) -> tuple[int, float]:
    """Make the filter from the file with the bulk builder: (items, seconds)."""
    start = time.perf_counter()
    seen = 0
    with _progress() as progress:
        task = progress.add_task(f"read {name}", total=total)

        def chunks() -> Iterator[list[Any]]:
            nonlocal seen
            if column is None:
                source: Iterator[list[Any]] = _line_chunks(file)
            else:
                source = _batches(_items(file, column, header), 1 << 16)
            for chunk in source:
                seen += len(chunk)
                progress.update(task, completed=seen)
                yield chunk
            progress.update(task, total=seen, description=f"build {name}")

        cf.bulk_load(chunks(), cfg.capacity_for(total), error_rate=error_rate)
        # Whatever the builder read ahead or left unread, the bar ends on what was loaded.
        progress.update(task, total=seen, completed=seen)
    return seen, time.perf_counter() - start


def _load_into(
    cf: SyncCuckooFilter,
    name: str,
    file: Path,
    column: str | None,
    header: bool,
    batch: int,
    total: int,
) -> tuple[int, int, float]:
    """Insert the file's items in batches with a progress bar: (seen, added, seconds)."""
    from guard import FilterFullError, GuardError

    added = seen = 0
    start = time.perf_counter()
    with _progress() as progress:
        task = progress.add_task(f"load {name}", total=total)
        for part in _batches(_items(file, column, header), batch):
            try:
                results = cf.insert_many(part)
            except FilterFullError as exc:
                added += sum(exc.results)
                raise GuardError(
                    f"{name}: filter is full after {seen + sum(exc.results):,} items "
                    f"({added:,} added); create it larger or with --expansion"
                ) from None
            seen += len(part)
            added += sum(results)
            progress.update(task, completed=seen)
        progress.update(task, total=seen, completed=seen)
    return seen, added, time.perf_counter() - start


def _byte_progress() -> Progress | NoProgress:
    if not on_terminal():
        return NoProgress()
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        console=rich_console(),
    )


@cli.command("export")
def export_(
    name: Name,
    file: Annotated[Path, typer.Argument(metavar="FILE", dir_okay=False, help="Dump to write.")],
    chunk_bytes: Annotated[int, typer.Option(metavar="N", min=1, help="Bytes per chunk.")] = (
        1 << 20
    ),
    redis_url: RedisUrl = None,
    prefix: Prefix = None,
) -> None:
    """Dump a filter to a file: a consistent snapshot, in chunks, with a SHA-256."""
    from guard import SyncCuckooFilter
    from guard.dump import export_filter

    cfg = quick_settings(redis_url=redis_url, key_prefix=prefix)
    tmp = file.with_name(file.name + ".part")
    with sync_redis(cfg) as redis:
        cf = SyncCuckooFilter(redis, name, cfg.key_prefix)
        with _byte_progress() as progress, tmp.open("wb") as out:
            task = progress.add_task(f"export {name}", total=None)
            try:
                summary = export_filter(
                    cf,
                    out,
                    chunk_bytes=chunk_bytes,
                    progress=lambda n: progress.advance(task, n),
                )
            except BaseException:
                out.close()
                tmp.unlink(missing_ok=True)
                raise
    tmp.replace(file)  # a reader never sees half a dump under the final name
    say(
        f"exported {name!r}: {summary.items:,} items, {summary.subfilters} sub-filter(s), "
        f"{_size(summary.bytes)} -> {file} (sha256 {summary.sha256[:16]}...)"
    )


@cli.command("import")
def import_(
    name: Name,
    file: Annotated[
        Path,
        typer.Argument(metavar="FILE", exists=True, dir_okay=False, help="Dump to restore."),
    ],
    redis_url: RedisUrl = None,
    prefix: Prefix = None,
    force: Force = False,
) -> None:
    """Restore a filter from a dump (replacing it atomically if it exists).

    The whole file is checked first (checksum, lengths); a corrupt or truncated dump is
    refused and the existing filter is left untouched.
    """
    from guard import SyncCuckooFilter
    from guard.dump import import_filter, validate_dump

    cfg = quick_settings(redis_url=redis_url, key_prefix=prefix)
    refuse_records_filter(cfg, name, force)
    header = validate_dump(file)
    with sync_redis(cfg) as redis:
        cf = SyncCuckooFilter(redis, name, cfg.key_prefix)
        with _byte_progress() as progress:
            task = progress.add_task(f"import {name}", total=sum(header.lengths))
            import_filter(cf, file, progress=lambda n: progress.advance(task, n))
        result = cf.info()
    source = f" (dumped from {header.name!r})" if header.name != name else ""
    say(
        f"imported {name!r}{source}: {result.items:,} items, load factor "
        f"{result.load_factor:.3f}, {_size(result.memory_bytes)}"
    )
