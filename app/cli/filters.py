"""Filter commands: create, info, list, check, drop, load, export, import."""

from __future__ import annotations

import csv
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from app.cli.common import (
    Prefix,
    RedisUrl,
    cli,
    console,
    err_console,
    refuse_records_filter,
    settings,
    sync_redis,
)
from guard import (
    FilterFullError,
    FilterInfo,
    GuardError,
    ShardedFilterInfo,
    SyncCuckooFilter,
    SyncShardedCuckooFilter,
    list_sharded_filters_sync,
)
from guard.dump import export_filter, import_filter, validate_dump
from guard.listing import read_filters_sync
from guard.names import NAME_RULE
from guard.params import DEFAULTS, FIELDS, FilterParams

Name = Annotated[str, typer.Argument(help=f"Filter name ({NAME_RULE}).")]
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
    """The filter called ``name``, plain or sharded (a missing one fails on first use)."""
    shards = list_sharded_filters_sync(redis, prefix).get(name)
    if shards is not None and not SyncCuckooFilter(redis, name, prefix).exists():
        return SyncShardedCuckooFilter(redis, name, prefix, shards=shards)
    return SyncCuckooFilter(redis, name, prefix)


def _option(name: str, *flags: str) -> Any:
    """A ``create`` option for FilterParams' ``name``, with its help (the library checks the
    value, so a bad one is the same one-line error as anywhere)."""
    spec = FIELDS[name]
    return typer.Option(*flags, help=f"{spec.help}: {spec.limit.describe()}.")


@cli.command()
def create(
    name: Name,
    capacity: Annotated[int, _option("capacity", "--capacity", "-c")],
    error_rate: Annotated[float | None, _option("error_rate")] = DEFAULTS["error_rate"],
    fingerprint_bits: Annotated[int | None, _option("fingerprint_bits")] = DEFAULTS[
        "fingerprint_bits"
    ],
    bucket_size: Annotated[int, _option("bucket_size")] = DEFAULTS["bucket_size"],
    max_kicks: Annotated[int, _option("max_kicks")] = DEFAULTS["max_kicks"],
    expansion: Annotated[int, _option("expansion")] = DEFAULTS["expansion"],
    seed: Annotated[int | None, _option("seed")] = DEFAULTS["seed"],
    redis_url: RedisUrl = None,
    prefix: Prefix = None,
    force: Force = False,
) -> None:
    """Create a filter."""
    params = FilterParams(
        capacity=capacity,
        error_rate=error_rate,
        fingerprint_bits=fingerprint_bits,
        bucket_size=bucket_size,
        max_kicks=max_kicks,
        expansion=expansion,
        seed=seed,
    )
    cfg = settings(redis_url=redis_url, key_prefix=prefix)
    refuse_records_filter(cfg, name, force)
    with sync_redis(cfg) as redis:
        info = SyncCuckooFilter(redis, name, cfg.key_prefix).reserve(params)
    console.print(_info_table(info))


@cli.command()
def info(name: Name, redis_url: RedisUrl = None, prefix: Prefix = None, as_json: AsJson = False):
    """Show a filter's size, load and error rate."""
    cfg = settings(redis_url=redis_url, key_prefix=prefix)
    with sync_redis(cfg) as redis:
        result = open_filter(redis, name, cfg.key_prefix).info()
    if as_json:
        console.print_json(json.dumps(_as_json(result)))
    else:
        console.print(_info_table(result))


def _as_json(info: FilterInfo) -> dict[str, Any]:
    out = info.as_dict()
    out.pop("per_shard", None)  # the totals are what a script wants; `info` shows one
    return out


@cli.command("list")
def list_(redis_url: RedisUrl = None, prefix: Prefix = None, as_json: AsJson = False) -> None:
    """List the filters (plain and sharded) under the key prefix."""
    cfg = settings(redis_url=redis_url, key_prefix=prefix)
    with sync_redis(cfg) as redis:
        report = read_filters_sync(redis, cfg.key_prefix)
    infos = report.infos
    if report.damaged:  # not in the list, but not hidden either
        err_console.print(f"damaged (drop or rebuild): {', '.join(report.damaged)}", markup=False)
    if as_json:
        console.print_json(json.dumps([_as_json(i) for i in infos]))
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
    console.print(table if infos else "no filters")


@cli.command()
def check(
    name: Name,
    items: Annotated[
        list[str] | None, typer.Argument(help='Items to look up; "-" reads them from stdin.')
    ] = None,
    file: Annotated[
        Path | None,
        typer.Option("--file", "-f", exists=True, dir_okay=False, help="Items, one a line."),
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
    cfg = settings(redis_url=redis_url, key_prefix=prefix)
    with sync_redis(cfg) as redis:
        cf = open_filter(redis, name, cfg.key_prefix)
        found = [hit for part in _batches(iter(wanted), 5000) for hit in cf.lookup_many(part)]
    for item, hit in zip(wanted, found, strict=True):
        console.print(f"{'present' if hit else 'absent '} {item}", markup=False, highlight=False)
    if not all(found):
        raise typer.Exit(1)


@cli.command()
def drop(
    name: Name,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask.")] = False,
    redis_url: RedisUrl = None,
    prefix: Prefix = None,
    force: Force = False,
) -> None:
    """Delete a filter."""
    cfg = settings(redis_url=redis_url, key_prefix=prefix)
    refuse_records_filter(cfg, name, force)
    if not yes:
        typer.confirm(f"drop filter {name!r}?", abort=True)
    with sync_redis(cfg) as redis:
        if not SyncCuckooFilter(redis, name, cfg.key_prefix).drop():
            raise GuardError(f"{name}: no such filter")
    console.print(f"dropped {name}")


def _count_lines(path: Path) -> int:
    lines = 0
    last = b"\n"
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            lines += block.count(b"\n")
            last = block[-1:]
    return lines + (last != b"\n")


def _items(path: Path, column: str | None, header: bool) -> Iterator[str]:
    with path.open("r", encoding="utf-8", newline="") as f:
        if column is None:
            for line in f:
                item = line.rstrip("\r\n")
                if item:
                    yield item
            return
        rows = csv.reader(f)
        index: int
        if header:
            names = next(rows, [])
            if column in names:
                index = names.index(column)
            elif column.isdigit():
                index = int(column)
            else:
                raise ValueError(f"{path}: no column {column!r} (columns: {', '.join(names)})")
        elif column.isdigit():
            index = int(column)
        else:
            raise ValueError("--column must be a number with --no-header")
        for lineno, row in enumerate(rows, start=2 if header else 1):
            if not row:
                continue
            if index >= len(row):
                raise ValueError(f"{path}:{lineno}: row has no column {index}")
            if row[index]:
                yield row[index]


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
    file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="Text or CSV file.")],
    column: Annotated[
        str | None,
        typer.Option(
            help="CSV column (header name or 0-based index); without it, one item a line."
        ),
    ] = None,
    header: Annotated[bool, typer.Option(help="The CSV's first row names the columns.")] = True,
    batch: Annotated[int, typer.Option(min=1, max=100_000, help="Items per round trip.")] = 5000,
    create: Annotated[
        bool, typer.Option("--create", help="Create the filter if missing, sized for the file.")
    ] = False,
    error_rate: Annotated[
        float | None,
        typer.Option(
            help=f"Error rate for --create: {FIELDS['error_rate'].limit.describe()} "
            "(default GUARD_RECORDS_ERROR_RATE, as the service's records filter)."
        ),
    ] = None,
    redis_url: RedisUrl = None,
    prefix: Prefix = None,
    force: Force = False,
) -> None:
    """Bulk-insert items from a text file (one a line) or a CSV column: one copy per line,
    duplicates included (skipping "present" items could skip one whose fingerprint merely
    collides with another's, and deleting the other would then lose it)."""
    cfg = settings(redis_url=redis_url, key_prefix=prefix)
    refuse_records_filter(cfg, name, force)
    if column is None and file.suffix.lower() == ".csv":
        raise ValueError(f"{file} is a CSV file: say which --column to load")
    total = max(0, _count_lines(file) - (1 if column is not None and header else 0))
    next(_items(file, column, header), None)  # a bad --column fails before anything is made
    with sync_redis(cfg) as redis:
        cf = SyncCuckooFilter(redis, name, cfg.key_prefix)
        if cf.exists():
            seen, added, elapsed = _load_into(cf, name, file, column, header, batch, total)
        elif create:
            # Sized as the service sizes its records filter; built whole in memory and swapped
            # in at once (guard/bulk.py): no half-loaded filter is ever visible, and a failed
            # build leaves nothing behind.
            capacity = cfg.capacity_for(total)
            target = cfg.records_error_rate if error_rate is None else error_rate
            seen, elapsed = _build(cf, name, file, column, header, total, capacity, target)
            added = seen
        else:
            raise GuardError(f"{name}: no such filter (create it, or pass --create)")
        result = cf.info()
    rate = seen / elapsed if elapsed > 0 else 0.0
    console.print(
        f"loaded {seen:,} items into {name!r} ({added:,} added) in {elapsed:.2f} s: "
        f"{rate:,.0f} items/s; load factor {result.load_factor:.3f}, {result.items:,} items, "
        f"{_size(result.memory_bytes)}, {result.subfilters} sub-filter(s)"
    )


def _progress() -> Progress:
    columns = [
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TaskProgressColumn(),
        TimeElapsedColumn(),
    ]
    return Progress(*columns, console=console, transient=False)


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
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc.reason})") from None
    return list(filter(None, data.replace(b"\r", b"\n").split(b"\n")))


def _build(
    cf: SyncCuckooFilter,
    name: str,
    file: Path,
    column: str | None,
    header: bool,
    total: int,
    capacity: int,
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
            progress.update(task, total=seen, completed=seen, description=f"build {name}")

        cf.bulk_load(chunks(), capacity, error_rate=error_rate)
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


def _byte_progress(label: str) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        console=console,
    )


@cli.command("export")
def export_(
    name: Name,
    file: Annotated[Path, typer.Argument(dir_okay=False, help="Dump file to write.")],
    chunk_bytes: Annotated[int, typer.Option(min=1, help="Bytes per chunk.")] = 1 << 20,
    redis_url: RedisUrl = None,
    prefix: Prefix = None,
) -> None:
    """Dump a filter to a file: a consistent snapshot, in chunks, with a SHA-256."""
    cfg = settings(redis_url=redis_url, key_prefix=prefix)
    tmp = file.with_name(file.name + ".part")
    with sync_redis(cfg) as redis:
        cf = SyncCuckooFilter(redis, name, cfg.key_prefix)
        with _byte_progress("export") as progress, tmp.open("wb") as out:
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
    console.print(
        f"exported {name!r}: {summary.items:,} items, {summary.subfilters} sub-filter(s), "
        f"{_size(summary.bytes)} -> {file} (sha256 {summary.sha256[:16]}...)"
    )


@cli.command("import")
def import_(
    name: Name,
    file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="Dump to restore.")],
    redis_url: RedisUrl = None,
    prefix: Prefix = None,
    force: Force = False,
) -> None:
    """Restore a filter from a dump (replacing it atomically if it exists).

    The whole file is checked first (checksum, lengths); a corrupt or truncated dump is
    refused and the existing filter is left untouched.
    """
    cfg = settings(redis_url=redis_url, key_prefix=prefix)
    refuse_records_filter(cfg, name, force)
    header = validate_dump(file)
    with sync_redis(cfg) as redis:
        cf = SyncCuckooFilter(redis, name, cfg.key_prefix)
        with _byte_progress("import") as progress:
            task = progress.add_task(f"import {name}", total=sum(header.lengths))
            import_filter(cf, file, progress=lambda n: progress.advance(task, n))
        result = cf.info()
    source = f" (dumped from {header.name!r})" if header.name != name else ""
    console.print(
        f"imported {name!r}{source}: {result.items:,} items, load factor "
        f"{result.load_factor:.3f}, {_size(result.memory_bytes)}"
    )
