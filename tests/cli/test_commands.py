"""The `guard` filter commands, run in-process against a real Redis."""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

import pytest
import redis
from typer.testing import CliRunner

from app.cli import cli
from app.settings import Settings
from devkit.processes import free_port
from guard import SyncCuckooFilter, SyncShardedCuckooFilter
from tests import colliding_items
from tests.guard_process import clean_env, run_module

runner = CliRunner()
COMMANDS = ["serve", "demo", "attack", "create", "info", "list", "check", "drop", "load", "export",
            "import", "where"]  # fmt: skip


def guard(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(cli, list(args))
    return result.exit_code, result.stdout, result.stderr


def assert_one_line_error(code: int, err: str, match: str) -> None:
    assert code == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert match in lines[0], err


class TestHelp:
    @pytest.mark.parametrize("command", COMMANDS)
    def test_help_every_command(self, command: str) -> None:
        """Every command answers --help."""
        code, out, _ = guard(command, "--help")
        assert code == 0
        assert "Usage" in out

    def test_help_lists_every_command(self) -> None:
        """The top-level help names them all."""
        code, out, _ = guard("--help")
        assert code == 0
        for command in COMMANDS:
            assert command in out


class TestFilters:
    def test_create_info_list_drop(self, cli_env: dict[str, str]) -> None:
        """A filter goes through its whole life from the command line."""
        code, out, err = guard("create", "users", "--capacity", "1000", "--error-rate", "0.001")
        assert code == 0, err
        assert "users" in out
        code, out, _ = guard("info", "users", "--json")
        assert code == 0
        info = json.loads(out)
        assert info["capacity"] == 1000 and info["items"] == 0
        assert info["target_error_rate"] == pytest.approx(0.001)
        code, out, _ = guard("list", "--json")
        assert [f["name"] for f in json.loads(out)] == ["users"]
        code, out, _ = guard("list")
        assert "users" in out
        code, out, err = guard("drop", "users", "--yes")
        assert code == 0, err
        assert_one_line_error(*guard("info", "users")[::2], match="no such filter")

    def test_create_existing_fails_in_one_line(self, cli_env: dict[str, str]) -> None:
        """A second create is refused with one line on stderr and status 1."""
        assert guard("create", "users", "-c", "100")[0] == 0
        assert_one_line_error(*guard("create", "users", "-c", "100")[::2], match="exists")

    def test_bad_parameter_fails_in_one_line(self, cli_env: dict[str, str]) -> None:
        """The library's rule, naming the option as typed (--bucket-size, not bucket_size)."""
        assert_one_line_error(
            *guard("create", "users", "-c", "100", "--bucket-size", "3")[::2],
            match="--bucket-size must be one of (1, 2, 4, 8), got 3",
        )

    def test_drop_missing_fails(self, cli_env: dict[str, str]) -> None:
        assert_one_line_error(*guard("drop", "nope", "--yes")[::2], match="no such filter")

    def test_records_filter_needs_force(self, cli_env: dict[str, str]) -> None:
        """The service's records filter follows its table: hand changes need --force."""
        assert_one_line_error(*guard("create", "records", "-c", "10")[::2], match="records table")
        assert guard("create", "records", "-c", "10", "--force")[0] == 0

    def test_redis_url_option_and_unreachable_redis(self, cli_env: dict[str, str]) -> None:
        """--redis-url wins over GUARD_REDIS_URL; a dead Redis is one line, status 1."""
        code, _, err = guard("list", "--redis-url", "redis://127.0.0.1:1/0")
        assert_one_line_error(code, err, match="ConnectionError")

    def test_invalid_settings_fail_in_one_line(
        self, cli_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("GUARD_REDIS_TIMEOUT", "-1")
        assert_one_line_error(*guard("list")[::2], match="GUARD_REDIS_TIMEOUT")

    @pytest.mark.parametrize(
        ("env", "match"),
        [
            ({"GUARD_REDIS_URL": "foo://bar"}, "GUARD_REDIS_URL: got 'foo://bar'; it accepts"),
            ({"GUARD_ENV": "production", "GUARD_API_KEY": "change-me"}, "GUARD_API_KEY: "),
        ],
    )
    def test_serve_refuses_bad_settings_in_one_line(
        self, env: dict[str, str], match: str, tmp_path: Path
    ) -> None:
        """`guard serve` names the setting and what it accepts, before uvicorn starts (a
        process with a deadline: without the check it would start serving)."""
        run = run_module(
            "app.cli", "serve", "--port", str(free_port()),
            env=clean_env(GUARD_DATA_DIR=str(tmp_path), **env),
        )  # fmt: skip
        assert_one_line_error(run.returncode, run.stderr, match=match)
        if "URL" in match:
            assert "memory://" in run.stderr and "redis-cluster://" in run.stderr


class TestLoad:
    def test_load_text_file(
        self, cli_env: dict[str, str], cli_redis: redis.Redis, tmp_path: Path
    ) -> None:
        """One item a line, in batches; the summary gives items/s and the load factor."""
        items = [f"item-{i}" for i in range(20_000)]
        path = tmp_path / "items.txt"
        path.write_text("\n".join(items) + "\n\n")
        assert guard("create", "big", "-c", "20000", "--error-rate", "0.001")[0] == 0
        code, out, err = guard("load", "big", str(path), "--batch", "3000")
        assert code == 0, err
        assert "loaded 20,000 items" in out and "items/s" in out and "load factor" in out
        cf = SyncCuckooFilter(cli_redis, "big", cli_env["GUARD_KEY_PREFIX"])
        assert cf.info().items == 20_000
        assert all(cf.lookup_many(items))

    def test_load_keeps_colliding_items(
        self, cli_env: dict[str, str], cli_redis: redis.Redis, tmp_path: Path
    ) -> None:
        """Every line is a copy: of two items with one fingerprint and bucket pair, deleting
        one (as DELETE /filters/{name}/items/{item} would) leaves the other found."""
        x, y = colliding_items.colliding_pair()
        cf = SyncCuckooFilter(cli_redis, "pair", cli_env["GUARD_KEY_PREFIX"])
        cf.reserve(colliding_items.CAPACITY, **colliding_items.PARAMS)
        path = tmp_path / "items.txt"
        path.write_text(f"{x}\n{y}\n")
        code, out, err = guard("load", "pair", str(path))
        assert code == 0, err
        assert "(2 added)" in out
        assert cf.delete(y)
        assert cf.lookup(x)

    def test_load_has_no_unique_option(self, cli_env: dict[str, str], tmp_path: Path) -> None:
        path = tmp_path / "items.txt"
        path.write_text("a\n")
        code, _, err = guard("load", "x", str(path), "--unique", "--create")
        assert code == 2 and "--unique" in err

    def test_load_csv_column_with_create(
        self, cli_env: dict[str, str], cli_redis: redis.Redis, tmp_path: Path
    ) -> None:
        """A CSV column by header name; --create sizes a new filter from the file."""
        path = tmp_path / "users.csv"
        path.write_text("id,email\n" + "".join(f"{i},u{i}@example.com\n" for i in range(500)))
        code, _, err = guard("load", "emails", str(path), "--column", "email", "--create")
        assert code == 0, err
        cf = SyncCuckooFilter(cli_redis, "emails", cli_env["GUARD_KEY_PREFIX"])
        assert cf.lookup("u42@example.com") and not cf.lookup("42")
        assert cf.info().items == 500

    def test_load_csv_needs_a_known_column(self, cli_env: dict[str, str], tmp_path: Path) -> None:
        path = tmp_path / "users.csv"
        path.write_text("id,email\n1,a@b\n")
        assert_one_line_error(*guard("load", "x", str(path), "--create")[::2], match="--column")
        assert_one_line_error(
            *guard("load", "x", str(path), "--column", "name", "--create")[::2],
            match="no column 'name'",
        )

    def test_load_missing_filter_without_create(
        self, cli_env: dict[str, str], tmp_path: Path
    ) -> None:
        path = tmp_path / "items.txt"
        path.write_text("a\nb\n")
        assert_one_line_error(*guard("load", "nope", str(path))[::2], match="--create")

    def test_load_into_full_fixed_filter_fails(
        self, cli_env: dict[str, str], tmp_path: Path
    ) -> None:
        path = tmp_path / "items.txt"
        path.write_text("".join(f"i{i}\n" for i in range(200)))
        guard("create", "tiny", "-c", "4", "--expansion", "0", "--bucket-size", "1",
              "--fingerprint-bits", "4")  # fmt: skip
        assert_one_line_error(*guard("load", "tiny", str(path))[::2], match="full")


class TestExportImport:
    def test_round_trip_to_another_name(
        self, cli_env: dict[str, str], cli_redis: redis.Redis, tmp_path: Path
    ) -> None:
        """export then import under a new name gives the same bytes and the same answers."""
        prefix = cli_env["GUARD_KEY_PREFIX"]
        src = SyncCuckooFilter(cli_redis, "src", prefix)
        src.reserve(1000, error_rate=0.01)
        items = [f"k{i}" for i in range(5000)]  # grows to several sub-filters
        src.insert_many(items)
        dump = tmp_path / "src.ckgd"
        code, out, err = guard("export", "src", str(dump), "--chunk-bytes", "4096")
        assert code == 0, err
        assert "exported 'src': 5,000 items" in out
        assert not (tmp_path / "src.ckgd.part").exists()
        code, out, err = guard("import", "copy", str(dump))
        assert code == 0, err
        assert "dumped from 'src'" in out
        dst = SyncCuckooFilter(cli_redis, "copy", prefix)
        n = src.info().subfilters
        assert n > 1
        assert [cli_redis.get(dst.key(i)) for i in range(n)] == [
            cli_redis.get(src.key(i)) for i in range(n)
        ]
        assert all(dst.lookup_many(items))
        assert not cli_redis.keys(f"{prefix}*dump*") and not cli_redis.keys(f"{prefix}*staging*")

    def test_corrupt_dump_refused_and_filter_untouched(
        self, cli_env: dict[str, str], cli_redis: redis.Redis, tmp_path: Path
    ) -> None:
        """A flipped byte or a cut file: one-line error, the live filter stays as it was."""
        prefix = cli_env["GUARD_KEY_PREFIX"]
        live = SyncCuckooFilter(cli_redis, "live", prefix)
        live.reserve(100)
        live.insert_many(["a", "b"])
        before = cli_redis.get(live.key(0))
        other = SyncCuckooFilter(cli_redis, "other", prefix)
        other.reserve(5000)
        other.insert_many([f"x{i}" for i in range(3000)])
        dump = tmp_path / "other.ckgd"
        assert guard("export", "other", str(dump))[0] == 0
        data = dump.read_bytes()
        flipped = bytearray(data)
        flipped[len(data) // 2] ^= 0x01
        bad = tmp_path / "bad.ckgd"
        bad.write_bytes(bytes(flipped))
        assert_one_line_error(*guard("import", "live", str(bad))[::2], match="checksum")
        bad.write_bytes(data[: len(data) - 100])
        assert_one_line_error(*guard("import", "live", str(bad))[::2], match="truncated")
        bad.write_bytes(b"hello world")
        assert_one_line_error(*guard("import", "live", str(bad))[::2], match="dump")
        assert cli_redis.get(live.key(0)) == before
        assert live.lookup("a") and not cli_redis.keys(f"{prefix}*staging*")

    def test_export_missing_filter(self, cli_env: dict[str, str], tmp_path: Path) -> None:
        assert_one_line_error(
            *guard("export", "nope", str(tmp_path / "d"))[::2], match="no such filter"
        )
        assert not list(tmp_path.iterdir())


class TestCheck:
    """`guard check NAME ITEM…`: per-item answers, status 0 only when every item is present."""

    def test_items_stdin_and_file(self, cli_env: dict[str, str], tmp_path: Path) -> None:
        guard("create", "users", "-c", "100")
        path = tmp_path / "items.txt"
        path.write_text("alice\nbob\n")
        assert guard("load", "users", str(path))[0] == 0
        code, out, _ = guard("check", "users", "alice", "bob")
        assert code == 0 and out.split("\n")[:2] == ["present alice", "present bob"]
        code, out, _ = guard("check", "users", "alice", "mallory")
        assert code == 1 and "absent  mallory" in out and "present alice" in out
        result = runner.invoke(cli, ["check", "users", "-"], input="bob\nmallory\n")
        assert result.exit_code == 1 and "absent  mallory" in result.stdout
        code, out, _ = guard("check", "users", "--file", str(path))
        assert code == 0 and "present bob" in out

    def test_missing_filter_and_no_items(self, cli_env: dict[str, str]) -> None:
        assert_one_line_error(*guard("check", "nope", "x")[::2], match="nope")
        assert_one_line_error(*guard("check", "nope")[::2], match="no items")


class TestSharded:
    """Sharded filters made with the library show up in `list`, `info` and `check`."""

    def test_list_info_check(self, cli_env: dict[str, str], cli_redis: redis.Redis) -> None:
        sharded = SyncShardedCuckooFilter(
            cli_redis, "susers", cli_env["GUARD_KEY_PREFIX"], shards=4
        )
        sharded.reserve(1000)
        sharded.insert_many(["a", "b"])
        code, out, err = guard("list", "--json")
        assert code == 0, err
        (listed,) = json.loads(out)
        assert (listed["name"], listed["shards"], listed["items"]) == ("susers", 4, 2)
        code, out, err = guard("info", "susers")
        assert code == 0, err
        assert "shards" in out and "susers" in out
        assert guard("check", "susers", "a", "b")[0] == 0


class TestWhere:
    """Every command uses one data directory, whatever the current folder, and says so."""

    def test_data_dir_not_current_folder(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        for name in ("GUARD_REDIS_URL", "GUARD_EMBEDDED_REDIS_FILE", "GUARD_DATABASE_URL"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("GUARD_DATA_DIR", str(tmp_path / "share"))
        monkeypatch.chdir(tmp_path)
        code, out, _ = guard("where")
        assert code == 0
        assert f"embedded redis-server, data in {tmp_path / 'share' / 'redis.rdb'}" in out
        assert f"sqlite:///{tmp_path / 'share' / 'records.db'}" in out

    def test_where_hides_the_database_password(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("GUARD_DATABASE_URL", "postgresql://shop:s3cret@db:5432/shop")
        code, out, _ = guard("where")
        assert code == 0
        assert "database: postgresql://shop:***@db:5432/shop" in out and "s3cret" not in out

    def test_default_data_dir_is_per_user(self, tmp_path: Path) -> None:
        """Without GUARD_DATA_DIR: the user's XDG data directory, not ./data."""
        run = run_module("app.cli", "where", env=clean_env(XDG_DATA_HOME=str(tmp_path / "xdg")))
        assert run.returncode == 0, run.stderr
        assert f"data in {tmp_path / 'xdg' / 'cuckoo-guard' / 'redis.rdb'}" in run.stdout

    def test_verbose_names_the_redis(self, cli_env: dict[str, str]) -> None:
        code, _, err = guard("--verbose", "list")
        assert code == 0
        assert err.strip() == f"redis: {cli_env['GUARD_REDIS_URL']}"


class TestLoadCreate:
    """`load --create`: sized with the service's headroom; a failure leaves no filter."""

    def test_bad_column_creates_nothing(
        self, cli_env: dict[str, str], cli_redis: redis.Redis, tmp_path: Path
    ) -> None:
        path = tmp_path / "users.csv"
        path.write_text("id,email\n1,a@b\n")
        code, _, err = guard("load", "x", str(path), "--column", "name", "--create")
        assert_one_line_error(code, err, match="no column 'name'")
        assert not SyncCuckooFilter(cli_redis, "x", cli_env["GUARD_KEY_PREFIX"]).exists()

    def test_failure_midway_drops_the_new_filter(
        self, cli_env: dict[str, str], cli_redis: redis.Redis, tmp_path: Path
    ) -> None:
        path = tmp_path / "users.csv"
        path.write_text("id,email\n1,a@b\n2\n")  # the second row has no email column
        code, _, err = guard("load", "x", str(path), "--column", "1", "--create", "--batch", "1")
        assert_one_line_error(code, err, match="no column 1")
        assert not SyncCuckooFilter(cli_redis, "x", cli_env["GUARD_KEY_PREFIX"]).exists()

    def test_sized_with_the_services_headroom(
        self, cli_env: dict[str, str], cli_redis: redis.Redis, tmp_path: Path
    ) -> None:
        path = tmp_path / "items.txt"
        path.write_text("".join(f"i{i}\n" for i in range(1000)))
        assert guard("load", "sized", str(path), "--create")[0] == 0
        info = SyncCuckooFilter(cli_redis, "sized", cli_env["GUARD_KEY_PREFIX"]).info()
        assert info.capacity == 1000 * Settings().records_headroom
        assert info.load_factor < 0.5


class TestLoadRefusesBadFiles:
    """A file that is not what it claims fails the load in one line naming the file, the line
    and what is wrong, before anything is loaded (into a new filter or an existing one)."""

    CASES: ClassVar[dict[str, tuple[bytes, str]]] = {
        "unterminated quote": (
            b'id,email\n1,a@b\n2,"c@d\n3,e@f\n',
            "{path}:3: a quoted field starts in this row and is never closed",
        ),
        "not UTF-8": (
            b"id,email\n1,a@b\n2,\xffc@d\n3,e@f\n",
            "{path}:3: not UTF-8 text (byte 0xff at position 3 of the line)",
        ),
        "short row": (
            b"id,email\n1,a@b\n2\n3,e@f\n",
            "{path}:3: the row has no column 'email' (1 field)",
        ),
    }

    @pytest.mark.parametrize("case", CASES)
    @pytest.mark.parametrize("existing", [False, True], ids=["create", "existing"])
    def test_csv(
        self,
        case: str,
        existing: bool,
        cli_env: dict[str, str],
        cli_redis: redis.Redis,
        tmp_path: Path,
    ) -> None:
        data, message = self.CASES[case]
        path = tmp_path / "users.csv"
        path.write_bytes(data)
        cf = SyncCuckooFilter(cli_redis, "users", cli_env["GUARD_KEY_PREFIX"])
        if existing:
            cf.reserve(100)
        code, _, err = guard("load", "users", str(path), "--column", "email", "--create")
        assert_one_line_error(code, err, message.format(path=path))
        assert cf.exists() == existing and (not existing or cf.info().items == 0)

    def test_text_file_not_utf8_names_the_line(
        self, cli_env: dict[str, str], tmp_path: Path
    ) -> None:
        path = tmp_path / "items.txt"
        path.write_bytes(b"".join(b"item-%d\n" % i for i in range(50_000)) + b"bad\xfe\n")
        code, _, err = guard("load", "items", str(path), "--create")
        assert_one_line_error(
            code, err, f"{path}:50001: not UTF-8 text (byte 0xfe at position 4 of the line)"
        )
