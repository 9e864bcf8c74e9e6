"""Help and tables as a new user reads them: whole sentences, options without type markers,
tables whole off a terminal, progress bars that end at 100%."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from app.cli import cli
from app.cli.common import COMMANDS, Command
from guard import SyncCuckooFilter
from tests.cli.test_commands import guard


def section(text: str, title: str) -> list[str]:
    """The lines of a help section, up to the next blank line."""
    lines = text.split(f"\n{title}:\n", 1)[1].splitlines()
    return lines[: lines.index("")] if "" in lines else lines


class TestHelp:
    def test_top_level_lists_each_command_in_one_whole_sentence(self) -> None:
        """One line per command, ending its sentence (nothing cut off, nothing wrapped)."""
        code, out, _ = guard("--help")
        assert code == 0
        rows = section(out, "Commands")
        assert [row.split()[0] for row in rows] == list(COMMANDS)
        assert all(row.endswith(".") and len(row) <= 80 for row in rows), rows

    def test_flags_show_no_type(self) -> None:
        code, out, _ = guard("--help")
        assert code == 0 and "-v, --verbose  Say on stderr" in out and "<bool>" not in out

    @pytest.mark.parametrize("command", COMMANDS)
    def test_each_command_help_reads_plainly(self, command: str) -> None:
        """`Usage: guard drop [OPTIONS] NAME`: no `{name}` placeholder, no `<str>` types."""
        code, out, _ = guard(command, "--help")
        assert code == 0
        usage = out.splitlines()[0]
        assert usage.startswith(f"Usage: guard {command} [OPTIONS]") and "{" not in usage
        assert not re.search(r"<(bool|str|int|float|file|path|list\[str\]|int range)>", out), out


class TestTables:
    def test_list_off_a_terminal_is_not_cut(
        self, cli_env: dict[str, str], cli_redis: redis.Redis
    ) -> None:
        """A long name and big numbers stay whole (rich cut tables to 80 columns)."""
        name = "sessions-of-the-checkout-service-eu-west"
        cf = SyncCuckooFilter(cli_redis, name, cli_env["GUARD_KEY_PREFIX"])
        cf.reserve(10_000_000)
        code, out, _ = guard("list")
        assert code == 0
        (row,) = [line for line in out.splitlines() if name in line]
        assert f"{cf.info().buckets * 4:,}" in row and "…" not in out

    @pytest.mark.parametrize("kind", ["text", "csv"])
    def test_the_read_bar_ends_at_100_percent(
        self, kind: str, cli_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """On a terminal (rich takes TTY_COMPATIBLE=1 for one): off one, no bar is drawn."""
        monkeypatch.setenv("TTY_COMPATIBLE", "1")
        monkeypatch.setenv("TTY_INTERACTIVE", "0")
        rows = 100_000
        if kind == "csv":
            path = tmp_path / "users.csv"
            path.write_text("id,email\n" + "".join(f"{i},u{i}@x\n" for i in range(rows)))
            args = ["--column", "email"]
        else:
            path = tmp_path / "users.txt"
            path.write_text("".join(f"u{i}\n" for i in range(rows)))
            args = []
        code, out, err = guard("load", "users", str(path), "--create", *args)
        assert code == 0, err
        bars = re.findall(r"build users\S* \S+ (\d+/\d+ +\d+%)", re.sub(r"\x1b\[[0-9;]*m", "", out))
        assert bars and bars[-1] == f"{rows}/{rows} 100%", out


class TestLazyCommands:
    """A command's module is imported when the command runs, not for `guard --help`."""

    def test_help_imports_no_command_module(self) -> None:
        code = (
            "import json, sys\nfrom app.cli import cli\n"
            "try:\n    cli(['--help'], prog_name='guard')\nexcept SystemExit:\n    pass\n"
            "heavy = ['app.cli.filters', 'app.cli.service', 'app.cli.feed', 'redis', 'numpy',"
            " 'pydantic', 'rich']\n"
            "print(json.dumps([m for m in heavy if m in sys.modules]), file=sys.stderr)"
        )
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert run.returncode == 0 and json.loads(run.stderr) == [], run.stderr

    def test_check_of_one_item_imports_no_numpy_nor_pydantic(
        self, cli_env: dict[str, str], cli_redis: redis.Redis
    ) -> None:
        """`guard check NAME ITEM` hashes one item with mmh3 and reads its settings plainly
        (app/env.py): numpy is for batches, pydantic for the service. redis-py 8.1 imports its
        asyncio client whatever part of it is imported (redis/__init__.py, redis.commands.core),
        so that one cannot be left out here."""
        made = SyncCuckooFilter(cli_redis, "lazy", cli_env["GUARD_KEY_PREFIX"])
        made.reserve(1000)
        made.insert("user-1")
        code = (
            "import json, sys\nfrom app.cli import cli\n"
            "try:\n    cli(['check', 'lazy', 'user-1', 'user-2'], prog_name='guard')\n"
            "except SystemExit as exit:\n    status = exit.code\n"
            "heavy = ['numpy', 'pydantic', 'pydantic_settings', 'app.settings', 'fastapi',"
            " 'rich']\n"
            "print(json.dumps([status, [m for m in heavy if m in sys.modules]]), file=sys.stderr)"
        )
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert run.stdout == "present user-1\nabsent  user-2\n", run.stderr
        assert json.loads(run.stderr.splitlines()[-1]) == [1, []], run.stderr

    def test_a_group_of_commands_is_loaded_when_used(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A module that adds a group (cli.add_typer) is loaded the same way."""
        (tmp_path / "lazy_group_for_test.py").write_text(
            "import typer\nfrom app.cli.common import cli, say\n"
            "things = typer.Typer(name='things', no_args_is_help=True)\n"
            "cli.add_typer(things)\n\n"
            "@things.command()\ndef hello(name: str) -> None:\n    say(f'hello {name}')\n"
        )
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.setattr(cli, "registered_groups", list(cli.registered_groups))
        monkeypatch.setitem(COMMANDS, "things", Command("lazy_group_for_test", "Say hello."))
        assert "  things  Say hello." in guard("--help")[1]
        assert guard("things", "hello", "you")[:2] == (0, "hello you\n")
        code, _, err = guard("things", "hello")
        assert code == 2 and err.startswith("error: Missing argument ") and err.count("\n") == 1
