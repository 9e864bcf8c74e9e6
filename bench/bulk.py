"""`python -m bench bulk`: the bulk builder (guard/bulk.py) against insert_many, in one run.

A file of N keys (default 10M, written to /tmp) is loaded end to end by `guard load --create`
in a child process (wall clock from start to promoted filter, peak RSS of that process), and
by the library call `bulk_load` in this one (with its phases timed); `insert_many` loads a
sample of the same keys with the same parameters, in the CLI's batches, on the same server.
Then every key is looked up (false negatives must be 0), and absent keys give the false
positive rate. Every target is a ratio or a count measured here: the machine is shared.

The pipeline (bench/suite.py) gives the server: a private redis-server unless --redis-url, keys
under the run's own prefix. ``measure(target, ...)`` returns the rows, ``report(rows)`` the
markdown.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis

from bench.markdown import Row, figures_report
from guard import FilterParams, SyncCuckooFilter, bulk
from guard.connect import connect_async
from guard.layout import pack_header

FULL = {"count": 10_000_000, "sample": 200_000}
QUICK = {"count": 200_000, "sample": 20_000}
ERROR_RATE = 0.001
CLI_BATCH = 5000  # guard load's default --batch
LOOKUP_BATCH = 100_000
ABSENT = 1_000_000  # absent keys looked up (fewer for a small run: a tenth of the keys)
REBUILD_ROWS = 1_000_000  # the records rebuild size
REBUILD_BATCH = 5000
# The targets (issue 15).
T_RATE = 1_000_000  # items/s end to end for 10M keys from a file
T_VS_INSERT_MANY = 20.0
REPO = Path(__file__).resolve().parents[1]

# Runs the CLI in a child and reports its own peak RSS (ru_maxrss, KiB on Linux) on stderr.
_CHILD = """
import resource, sys
from app.cli import cli
try:
    cli(sys.argv[1:], prog_name="guard")
except SystemExit as done:
    code = done.code
else:
    code = 0
print(f"maxrss_kib={resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}", file=sys.stderr)
sys.exit(code)
"""


def write_keys(path: Path, count: int) -> None:
    """``user:<n>`` for n < count, one a line, written in large blocks."""
    step = 1_000_000
    with path.open("wb") as f:
        for start in range(0, count, step):
            f.write(b"".join(b"user:%d\n" % n for n in range(start, min(count, start + step))))


def key_chunks(path: Path, block: int = 1 << 22) -> Iterator[list[bytes]]:
    """The file's lines as bytes, a block at a time (the keys hold no \\r)."""
    rest = b""
    with path.open("rb") as f:
        while data := f.read(block):
            data = rest + data
            cut = data.rfind(b"\n") + 1
            rest = data[cut:]
            yield data[:cut].split(b"\n")[:-1]
    if rest:
        yield [rest]


def run_cli(url: str, prefix: str, *args: str) -> tuple[float, int, str]:
    """(wall seconds, peak RSS in bytes, stdout) of one `guard` command in a child process."""
    env = {**os.environ, "GUARD_REDIS_URL": url, "GUARD_KEY_PREFIX": prefix, "COLUMNS": "120"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, *args], env=env, capture_output=True, text=True, cwd=REPO
    )
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"guard {' '.join(args)} failed: {proc.stderr[-2000:]}")
    rss = [line for line in proc.stderr.splitlines() if line.startswith("maxrss_kib=")]
    return seconds, int(rss[-1].split("=")[1]) * 1024, proc.stdout


def server_cpu(r: redis.Redis) -> float:
    cpu = r.info("cpu")
    return float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"])


def measure(target: Any, count: int, sample: int) -> list[Row]:
    """Every figure of the report, on the pipeline's server (a bench.suite.Target)."""
    r, url, prefix = target.r, target.url, target.prefix
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="guard-bench-bulk-", dir="/tmp") as tmp:
        path = Path(tmp) / "keys.txt"
        write_keys(path, count)
        rows += _cli_rows(r, url, prefix, path, count)
        rows += _library_rows(r, prefix, path, count)
        rows += _insert_many_rows(r, prefix, path, sample, rows)
        rows += _rebuild_rows(url, prefix, path, min(count, REBUILD_ROWS))
        rows += _accuracy_rows(r, prefix, path, count)
    return rows


def _cli_rows(r: redis.Redis, url: str, prefix: str, path: Path, count: int) -> list[Row]:
    section = f"`guard load --create`, {count:,} keys from a file (child process)"
    _, base_rss, _ = run_cli(url, prefix, "load", "tiny", str(_one_line(path)), "--create")
    cpu0 = server_cpu(r)
    seconds, rss, out = run_cli(
        url, prefix, "load", "cli", str(path), "--create", "--error-rate", str(ERROR_RATE)
    )
    cpu = server_cpu(r) - cpu0
    info = SyncCuckooFilter(r, "cli", prefix).info()
    assert info.items == count, (info.items, out)
    return [
        Row(section, "end to end (process start to promoted filter)", count / seconds, "items/s",
            f"{seconds:.2f} s wall"),
        Row(section, "peak RSS of the process", rss / 2**20, "MiB",
            f"{(rss - base_rss) / count:.1f} bytes per key above the same command on 1 key "
            f"({base_rss / 2**20:.0f} MiB)"),
        Row(section, "Redis CPU during the load", cpu, "s"),
        Row(section, "load factor reached", info.load_factor, "",
            f"sized as the service sizes (x{info.capacity / count:g} headroom), "
            f"{info.subfilters} sub-filter(s), {info.memory_bytes / 2**20:.1f} MiB"),
        Row(section, "the command's own summary", 0, "", out.strip().splitlines()[-1]),
    ]  # fmt: skip


def _one_line(path: Path) -> Path:
    small = path.with_name("one.txt")
    small.write_text("user:0\n")
    return small


def _library_rows(r: redis.Redis, prefix: str, path: Path, count: int) -> list[Row]:
    section = f"library `bulk_load`, {count:,} keys from the file, capacity = keys"
    cf = SyncCuckooFilter(r, "lib", prefix)
    cpu0 = server_cpu(r)
    start = time.perf_counter()
    info = cf.bulk_load(key_chunks(path), count, error_rate=ERROR_RATE)
    seconds = time.perf_counter() - start
    cpu = server_cpu(r) - cpu0
    phases = _phases(r, prefix, path, count)
    return [
        Row(section, "file to promoted filter", count / seconds, "items/s", f"{seconds:.2f} s"),
        *(Row(section, f"phase: {name}", t, "s", "the same steps, timed one by one")
          for name, t in phases.items()),
        Row(section, "Redis CPU during bulk_load", cpu, "s"),
        Row(section, "load factor reached", info.load_factor, "",
            f"{info.subfilters} sub-filter(s), {info.memory_bytes / 2**20:.1f} MiB, "
            f"b={info.bucket_size}, f={info.fingerprint_bits}"),
    ]  # fmt: skip


def _phases(r: redis.Redis, prefix: str, path: Path, count: int) -> dict[str, float]:
    """bulk_load's steps one after another, each timed: hashing and placement by
    guard/bulk.py's own functions; the strings then written with one SET each and promoted."""
    cf = SyncCuckooFilter(r, "phases", prefix)
    times = {}
    start = time.perf_counter()
    sink = bulk.HashSink(seed=12345)
    sink.add_all(key_chunks(path))
    times["read the file and hash"] = time.perf_counter() - start
    start = time.perf_counter()
    layout = FilterParams(capacity=count, seed=12345, error_rate=ERROR_RATE).layout()
    header = pack_header(layout, count, ERROR_RATE)
    built = bulk.build(*sink.take(), layout, header, name=cf.name)
    times["place and pack"] = time.perf_counter() - start
    start = time.perf_counter()
    staging = cf.staging()
    with r.pipeline(transaction=False) as pipe:
        for n, string in reversed(list(enumerate(built.strings))):
            pipe.set(staging.key(n), bytes(string))
        pipe.execute()
    staging.promote()
    times["upload (a SET per string) and promote"] = time.perf_counter() - start
    return times


def _insert_many_rows(
    r: redis.Redis, prefix: str, path: Path, sample: int, rows: list[Row]
) -> list[Row]:
    section = f"`insert_many` vs the builder, same keys and parameters ({sample:,}-key sample)"
    keys: list[bytes] = []
    for chunk in key_chunks(path):
        keys += chunk[: sample - len(keys)]
        if len(keys) >= sample:
            break
    capacity = 2 * len(keys)  # the CLI's sizing (headroom 2)
    slow = SyncCuckooFilter(r, "insert-many", prefix)
    slow.reserve(capacity, error_rate=ERROR_RATE)
    cpu0 = server_cpu(r)
    start = time.perf_counter()
    for k in range(0, len(keys), CLI_BATCH):
        slow.insert_many(keys[k : k + CLI_BATCH])
    seconds = time.perf_counter() - start
    cpu = server_cpu(r) - cpu0
    fast = SyncCuckooFilter(r, "sample-bulk", prefix)
    start = time.perf_counter()
    fast.bulk_load(keys, capacity, error_rate=ERROR_RATE)
    bulk_seconds = time.perf_counter() - start
    rate = len(keys) / seconds
    cli_rate = next(x.value for x in rows if x.figure.startswith("end to end"))
    return [
        Row(section, "insert_many (batches of 5000)", rate, "items/s",
            f"{seconds:.2f} s; Redis CPU {cpu / len(keys) * 1e6:.1f} us per key"),
        Row(section, "bulk_load of the same sample", len(keys) / bulk_seconds, "items/s",
            f"{bulk_seconds:.2f} s; {seconds / bulk_seconds:.0f}x insert_many"),
        Row(section, "end to end (CLI) / insert_many", cli_rate / rate, "x"),
    ]  # fmt: skip


def _rebuild_rows(url: str, prefix: str, path: Path, rows: int) -> list[Row]:
    """A records rebuild's shape: batches from an async iterator (a database cursor) into the
    staging copy with the asyncio handle, then promote; against insert_many the same way."""
    import asyncio

    from guard import CuckooFilter

    keys: list[bytes] = []
    for chunk in key_chunks(path):
        keys += chunk[: rows - len(keys)]
        if len(keys) >= rows:
            break
    section = (
        f"asyncio, a records rebuild's shape: {len(keys):,} rows in batches of {REBUILD_BATCH}"
    )

    async def cursor(part: list[bytes]) -> Any:
        for k in range(0, len(part), REBUILD_BATCH):
            yield part[k : k + REBUILD_BATCH]

    async def run() -> tuple[float, float, int]:
        client = connect_async(url)
        try:
            cf = CuckooFilter(client, "rebuild", prefix)
            start = time.perf_counter()
            await cf.bulk_load(cursor(keys), 2 * len(keys), error_rate=ERROR_RATE, promote=False)
            await cf.staging().promote()
            fast = time.perf_counter() - start
            old = CuckooFilter(client, "rebuild-insert-many", prefix).staging()
            await old.reserve(2 * len(keys), error_rate=ERROR_RATE)
            sample = keys[: max(REBUILD_BATCH, len(keys) // 10)]
            start = time.perf_counter()
            async for batch in cursor(sample):
                await old.insert_many(batch)
            slow = time.perf_counter() - start
            return fast, slow, len(sample)
        finally:
            await client.aclose()

    fast, slow, sample = asyncio.run(run())
    return [
        Row(section, "bulk_load (promote=False) + promote", len(keys) / fast, "items/s",
            f"{fast:.2f} s"),
        Row(section, "insert_many into a staging copy (today's rebuild)", sample / slow,
            "items/s", f"{sample:,} rows in {slow:.2f} s"),
        Row(section, "rebuild speed-up", (len(keys) / fast) / (sample / slow), "x"),
    ]  # fmt: skip


def _accuracy_rows(r: redis.Redis, prefix: str, path: Path, count: int) -> list[Row]:
    section = "answers of the CLI-built filter"
    cf = SyncCuckooFilter(r, "cli", prefix)
    missing = 0
    start = time.perf_counter()
    pending: list[bytes] = []
    for chunk in key_chunks(path):
        pending += chunk
        while len(pending) >= LOOKUP_BATCH:
            missing += cf.lookup_many(pending[:LOOKUP_BATCH]).count(False)
            pending = pending[LOOKUP_BATCH:]
    if pending:
        missing += cf.lookup_many(pending).count(False)
    seconds = time.perf_counter() - start
    absent = [b"absent:%d" % n for n in range(min(ABSENT, max(10_000, count // 10)))]
    hits = sum(
        cf.lookup_many(absent[k : k + LOOKUP_BATCH]).count(True)
        for k in range(0, len(absent), LOOKUP_BATCH)
    )
    info = cf.info()
    lib = SyncCuckooFilter(r, "lib", prefix)
    lib_hits = sum(
        lib.lookup_many(absent[k : k + LOOKUP_BATCH]).count(True)
        for k in range(0, len(absent), LOOKUP_BATCH)
    )
    lib_info = lib.info()
    return [
        Row(section, "false negatives (lookup_many of every key)", missing, "",
            f"{count:,} keys looked up at {count / seconds:,.0f}/s"),
        Row(section, "false positive rate, CLI filter", hits / len(absent), "",
            f"{len(absent):,} absent keys; target {ERROR_RATE:g}, "
            f"estimate {info.error_rate:.2e}"),
        Row(section, "false positive rate, library filter (capacity = keys)",
            lib_hits / len(absent), "",
            f"target {ERROR_RATE:g}, estimate {lib_info.error_rate:.2e}"),
    ]  # fmt: skip


def _value(row: Row) -> str:
    if row.unit == "items/s":
        return f"{row.value:,.0f} items/s"
    if row.unit == "x":
        return f"{row.value:.1f}x"
    if row.unit in ("s", "MiB"):
        return f"{row.value:,.2f} {row.unit}"
    if row.figure.startswith("the command"):
        return ""
    if row.figure.startswith("false negatives"):
        return f"{row.value:.0f}"
    if row.figure.startswith("false positive"):
        return f"{row.value:.4%}"
    return f"{row.value:.3f}"


def targets(rows: list[Row]) -> list[tuple[str, str, bool]]:
    get = {row.figure: row.value for row in rows}
    rate = get["end to end (process start to promoted filter)"]
    ratio = get["end to end (CLI) / insert_many"]
    missing = get["false negatives (lookup_many of every key)"]
    fpr = get["false positive rate, CLI filter"]
    return [
        (f"end to end from a file >= {T_RATE:,} items/s", f"{rate:,.0f}", rate >= T_RATE),
        (f">= {T_VS_INSERT_MANY:g}x insert_many (same run)", f"{ratio:.1f}x",
         ratio >= T_VS_INSERT_MANY),
        ("zero false negatives", f"{missing:.0f}", missing == 0),
        (f"false positive rate <= target {ERROR_RATE:g}", f"{fpr:.4%}", fpr <= ERROR_RATE),
    ]  # fmt: skip


NOTES = """How to read it:

- *End to end* is the `guard` process from start to exit, so it includes Python's start-up and
  the CLI's imports (compare the command's own summary line, which times the load alone). The
  insert_many rate is measured on the same server in the same run, with the same parameters
  and the CLI's batch size, into a filter sized as `--create` sizes it.
- The CLI sizes a new filter as the service sizes its records filter (twice the line count),
  so its load factor is about 0.42; the library call is given capacity = keys and shows how
  full the builder packs a table (the string is also rounded up to its jemalloc size class).
- Peak RSS is the child process's own `ru_maxrss`; the builder keeps about 12 bytes of hash
  per key while reading, then the table of item numbers (4 bytes a slot) while placing.
- Redis CPU is the server's `used_cpu_sys + used_cpu_user` over the load: the server only
  receives a few SETRANGEs and runs one promote.
- The machine is shared (2 cores): absolute rates move with the load average recorded above;
  the ratios are measured side by side."""


def report(rows: list[Row]) -> str:
    """The markdown of docs/bench-bulk.md (the pipeline adds the title and environment)."""
    return figures_report(__doc__ or "", targets(rows), NOTES, rows, _value)
