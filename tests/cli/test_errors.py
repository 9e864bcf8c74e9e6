"""One error style for the whole command line: one `error:` line naming the option or setting
as the user gave it, exit status 1 (2 for a usage mistake), never a traceback; settings,
database and network failures included. A reader that stops reading is no error."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.cli import cli
from devkit.postgres import create_database, database_url, drop_database
from devkit.processes import free_port
from tests.cli.test_commands import assert_one_line_error, guard, runner
from tests.guard_process import clean_env, run_module


def assert_usage_error(code: int, err: str, match: str) -> None:
    assert code == 2, err
    (line,) = err.strip().splitlines()
    assert line.startswith("error: ") and match in line, err


class TestUsage:
    """Usage mistakes: one line (click's usage and hint lines, or typer's box, no more)."""

    def test_missing_argument(self) -> None:
        code, _, err = guard("drop")
        assert_usage_error(code, err, "Missing argument 'NAME'. (see guard drop --help)")

    def test_attack_url_without_a_scheme(self) -> None:
        """Refused at once, not after a whole run of failed requests."""
        code, _, err = guard("attack", "--url", "127.0.0.1:8000", "--duration", "60")
        assert_usage_error(
            code, err, "'127.0.0.1:8000' is not an http:// or https:// URL (e.g. http://"
        )

    def test_unknown_command(self) -> None:
        code, _, err = guard("chek")
        assert_usage_error(code, err, "No such command 'chek'. Did you mean 'check'?")


class TestOptionsNamedAsTyped:
    """An error names what the user typed: the option, or the GUARD_* variable."""

    def test_error_rate_and_fingerprint_bits(self) -> None:
        code, _, err = guard("create", "x", "-c", "10", "--error-rate", "0.01",
                             "--fingerprint-bits", "8")  # fmt: skip
        assert_one_line_error(code, err, "error: give --error-rate or --fingerprint-bits, not both")

    def test_load_error_rate(self, cli_env: dict[str, str], tmp_path: Path) -> None:
        path = tmp_path / "items.txt"
        path.write_text("a\n")
        code, _, err = guard("load", "x", str(path), "--create", "--error-rate", "2")
        assert_one_line_error(code, err, "--error-rate must be between 0 and 1, exclusive, got 2")

    def test_redis_url_option_or_variable(
        self, cli_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        code, _, err = guard("list", "--redis-url", "foo://bar")
        assert_one_line_error(code, err, "--redis-url: got 'foo://bar'; it accepts redis://")
        monkeypatch.setenv("GUARD_REDIS_URL", "foo://bar")
        code, _, err = guard("list")
        assert_one_line_error(code, err, "GUARD_REDIS_URL: got 'foo://bar'; it accepts redis://")

    def test_records_filter_message_is_filled_in(self, cli_env: dict[str, str]) -> None:
        """No `{name}` left in it."""
        code, _, err = guard("drop", "records", "--yes")
        assert_one_line_error(code, err, "rebuild it with POST /filters/records/rebuild, or pass")
        assert "{" not in err


class TestReaderGone:
    """`guard ... | head`: the reader stops reading; the command stops quietly."""

    @pytest.mark.parametrize("argv", [["--help"], ["create", "--help"], ["list"]])
    def test_closed_stdout_exits_quietly(self, argv: list[str], cli_env: dict[str, str]) -> None:
        proc = subprocess.Popen(
            [sys.executable, "-m", "app.cli", *argv],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        proc.stdout.close()  # type: ignore[union-attr]
        err = proc.stderr.read()  # type: ignore[union-attr]
        assert (proc.wait(timeout=60), err) == (0, b"")

    @pytest.mark.parametrize(("item", "status"), [("alice", 0), ("mallory", 1)])
    def test_check_keeps_its_answer(self, item: str, status: int, tmp_path: Path,
                                    cli_env: dict[str, str]) -> None:  # fmt: skip
        """`check`'s status still says whether every item is present."""
        path = tmp_path / "items.txt"
        path.write_text("alice\n")
        assert guard("load", "users", str(path), "--create")[0] == 0
        proc = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "check", "users", item],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        proc.stdout.close()  # type: ignore[union-attr]
        err = proc.stderr.read()  # type: ignore[union-attr]
        assert (proc.wait(timeout=60), err) == (status, b"")


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


class TestServe:
    def test_taken_port_refused_before_start_up(self, taken_port: int, tmp_path: Path) -> None:
        """At once, as `guard demo` does: no data folder made, no filter rebuilt."""
        data = tmp_path / "data"
        run = run_module("app.cli", "serve", "--port", str(taken_port),
                         env=clean_env(GUARD_DATA_DIR=str(data)))  # fmt: skip
        assert_one_line_error(
            run.returncode,
            run.stderr,
            f"error: --port {taken_port}: 127.0.0.1:{taken_port} is in use (Address already in "
            "use); pick another port",
        )
        assert not data.exists()

    @pytest.mark.parametrize("case", ["no such database", "no such table"])
    def test_postgres_start_up_errors_in_one_line(self, case: str, tmp_path: Path) -> None:
        """What the service cannot start with, as one `error:` line and exit status 1 (not
        uvicorn's two ERROR lines and status 3)."""
        url = asyncio.run(create_database("guard_cli_")) if case == "no such table" else None
        try:
            env = clean_env(
                GUARD_REDIS_URL="memory://",
                GUARD_DATA_DIR=str(tmp_path),
                GUARD_DATABASE_URL=url or database_url("guard_cli_absent_database"),
                GUARD_RECORDS_TABLE="nosuch",
            )
            run = run_module("app.cli", "serve", "--port", str(free_port()), env=env)
        finally:
            if url:
                asyncio.run(drop_database(url))
        errors = [line for line in run.stderr.splitlines() if "ERROR" in line.upper()]
        expected = (
            ["GUARD_DATABASE_URL: cannot connect to ", '"guard_cli_absent_database" does not exist']
            if url is None
            else ["GUARD_RECORDS_TABLE: no table 'nosuch'"]
        )
        assert run.returncode == 1 and len(errors) == 1, run.stderr
        assert errors[0].startswith("error: "), run.stderr
        assert all(part in errors[0] for part in expected), run.stderr
        assert "Traceback" not in run.stderr


class TestAttack:
    def test_nothing_listening_refused_at_once(self) -> None:
        """A wrong port: one line naming the connection error, not `0 requests` forever."""
        port = free_port()
        run = run_module("app.cli", "attack", "--url", f"http://127.0.0.1:{port}",
                         "--duration", "0", env=clean_env())  # fmt: skip
        assert_one_line_error(
            run.returncode, run.stderr, f"error: --url http://127.0.0.1:{port}: no answer ("
        )
        assert "Connect" in run.stderr and run.stdout == ""


class TestUnexpected:
    """A bug is one line too, saying how to see its traceback (--verbose)."""

    def test_one_line_then_the_traceback_on_request(
        self, cli_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        from app.cli import filters

        def broken(*args: object) -> None:
            raise KeyError("boom")

        monkeypatch.setattr(filters, "open_filter", broken)
        assert_one_line_error(
            *guard("info", "x")[::2],
            "error: KeyError: 'boom' (unexpected: guard --verbose ... shows its traceback)",
        )
        result = runner.invoke(cli, ["--verbose", "info", "x"])
        assert isinstance(result.exception, KeyError)
