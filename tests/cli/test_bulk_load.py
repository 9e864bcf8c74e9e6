"""`guard load --create` builds a new filter with the bulk builder (guard/bulk.py)."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.cli import filters
from guard import SyncCuckooFilter
from tests.cli.test_commands import assert_one_line_error, guard


class TestLineReader:
    @settings(
        max_examples=200,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture],  # one file, rewritten
    )
    @given(
        text=st.lists(st.sampled_from(["a", "b", "é", "😀", "\n", "\r", "\r\n"])).map("".join),
        block=st.integers(1, 9),
    )
    def test_reads_what_the_text_reader_reads(self, tmp_path: Path, text: str, block: int) -> None:
        """Lines end at \\n, \\r or \\r\\n; empty ones are skipped; a character split across
        blocks is read whole."""
        path = tmp_path / "items.txt"
        path.write_bytes(text.encode())
        fast = [x for chunk in filters._line_chunks(path, block) for x in chunk]
        assert fast == [x.encode() for x in filters._items(path, None, header=False)]

    def test_refuses_what_is_not_utf8(self, tmp_path: Path) -> None:
        path = tmp_path / "items.txt"
        path.write_bytes(b"a\nb\xff\nc\n")
        with pytest.raises(ValueError, match="not UTF-8"):
            list(filters._line_chunks(path))


class TestLoadCreate:
    def test_builds_the_whole_file(
        self, cli_env: dict[str, str], cli_redis: redis.Redis, tmp_path: Path
    ) -> None:
        """Every line once per occurrence, sized as the service sizes its records filter."""
        items = [f"user-{i}" for i in range(30_000)] + ["dup"] * 3
        path = tmp_path / "items.txt"
        path.write_text("\r\n".join(items) + "\n\n")
        code, out, err = guard("load", "users", str(path), "--create", "--error-rate", "0.01")
        assert code == 0, err
        assert "loaded 30,003 items into 'users' (30,003 added)" in out and "items/s" in out
        cf = SyncCuckooFilter(cli_redis, "users", cli_env["GUARD_KEY_PREFIX"])
        info = cf.info()
        assert (info.items, info.subfilters, info.target_error_rate) == (30_003, 1, 0.01)
        assert all(cf.lookup_many(items)) and cf.count("dup") == 3

    def test_small_blocks(
        self,
        cli_env: dict[str, str],
        cli_redis: redis.Redis,
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        monkeypatch.setattr(filters, "_line_chunks", partial(filters._line_chunks, block=5))
        path = tmp_path / "items.txt"
        path.write_text("".join(f"ключ-{i}\n" for i in range(500)))
        assert guard("load", "k", str(path), "--create")[0] == 0
        cf = SyncCuckooFilter(cli_redis, "k", cli_env["GUARD_KEY_PREFIX"])
        assert cf.info().items == 500 and cf.lookup("ключ-499")

    def test_failed_build_leaves_nothing(
        self, cli_env: dict[str, str], cli_redis: redis.Redis, tmp_path: Path
    ) -> None:
        """A file that turns out not to be text half-way: no filter, no staging copy."""
        path = tmp_path / "items.txt"
        path.write_bytes(b"".join(b"item-%d\n" % i for i in range(100_000)) + b"\xff\xfe\n")
        code, _, err = guard("load", "bad", str(path), "--create")
        assert_one_line_error(code, err, match="not UTF-8")
        assert not list(cli_redis.scan_iter(match=f"{cli_env['GUARD_KEY_PREFIX']}*"))

    def test_existing_filter_is_loaded_item_by_item(
        self, cli_env: dict[str, str], cli_redis: redis.Redis, tmp_path: Path
    ) -> None:
        """--create on a filter that exists adds to it (insert_many), keeping what it held."""
        cf = SyncCuckooFilter(cli_redis, "kept", cli_env["GUARD_KEY_PREFIX"])
        cf.reserve(1000)
        cf.insert("old")
        path = tmp_path / "items.txt"
        path.write_text("new\n")
        assert guard("load", "kept", str(path), "--create")[0] == 0
        assert cf.lookup_many(["old", "new"]) == [True, True]
