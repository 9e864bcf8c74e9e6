"""The registry of databases: a further database is its module plus one `register` line
(docs/postgresql.md, "Adding a database"), followed here step by step with a toy one."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator

import pytest

from app.db import BaseDatabase, DatabaseSetupError, open_database, register
from app.db import registry as db_registry
from app.settings import Settings
from guard.changes import Change
from tests.app.conftest import AUTH, StartService

TOY = "tests.app.memory_db"
BUILT_IN = re.escape("sqlite:///<path>, postgresql://... or postgres://...")


@pytest.fixture
def registered() -> Iterator[None]:
    """The databases as registered now, again after the test (registering is for good)."""
    before = list(db_registry.BACKENDS)
    yield
    db_registry.BACKENDS[:] = before


@pytest.fixture
def toy(registered: None) -> None:
    """Step 2 of "Adding a database": its one line (step 1 is tests/app/memory_db.py)."""
    sys.modules.pop(TOY, None)
    register(f"{TOY}:MemoryDatabase", "memory-db://<name>")


class TestRegistry:
    """Which class a URL opens, and what the settings accept."""

    def test_the_settings_accept_what_is_registered(self) -> None:
        with pytest.raises(ValueError, match=f"it accepts {BUILT_IN}"):
            Settings(database_url="memory-db://shop")
        Settings(database_url="postgres://db/shop")

    @pytest.mark.usefixtures("toy")
    def test_a_registered_database_is_accepted_and_listed(self) -> None:
        assert Settings(database_url="memory-db://shop").database_url == "memory-db://shop"
        accepts = "sqlite:///<path>, postgresql://..., postgres://... or memory-db://<name>"
        with pytest.raises(ValueError, match=f"it accepts {re.escape(accepts)}$"):
            db_registry.backend_for("mysql://db/shop")
        assert TOY not in sys.modules  # its module is imported only when a URL opens it

    async def test_an_unregistered_url_opens_nothing(self) -> None:
        with pytest.raises(DatabaseSetupError, match=f"GUARD_DATABASE_URL: .* {BUILT_IN}$"):
            await open_database("memory-db://shop")

    @pytest.mark.usefixtures("registered")
    @pytest.mark.parametrize(
        ("forms", "why"),
        [
            (("sqlite:///<file>",), "registered already"),
            (("memory-db",), "no URL form"),
            ((), "no URL form"),
        ],
    )
    def test_a_form_taken_or_malformed_is_refused(self, forms: tuple[str, ...], why: str) -> None:
        with pytest.raises(ValueError, match=why):
            register(f"{TOY}:MemoryDatabase", *forms)

    @pytest.mark.usefixtures("registered")
    async def test_a_target_that_is_no_database_is_refused(self) -> None:
        register("app.db.base:TableSpec", "not-a-db://...")
        with pytest.raises(TypeError, match="no BaseDatabase"):
            await open_database("not-a-db://x")


class TestAToyDatabase:
    """The toy database, opened through open_database, is a whole database of record."""

    @pytest.mark.usefixtures("toy")
    async def test_it_opens_and_feeds_its_changes(self) -> None:
        db = await open_database("memory-db://feeds")
        try:
            assert isinstance(db, BaseDatabase) and type(db).__module__ == TOY
            assert await db.seed(3) == 3 and await db.seed(3) == 0
            assert (await db.put("a", '"1"')).created is True
            assert (await db.put("a", '"2"')).created is False
            assert await db.get("a") == '"2"' and await db.delete("user-2") is True
            assert await db.changes_after(3, 10) == [
                Change(4, True, "a"),
                Change(5, False, "user-2"),
            ]
            assert await db.present_at(["a", "user-2", "user-3"]) == (5, ["a", "user-3"])
            assert sorted(await db.sample_keys(10)) == ["a", "user-1", "user-3"]
            assert await db.wait_for_change(4, 1.0) == 5
            assert await db.compact(4) == 4 and await db.oldest_change() == 5
        finally:
            await db.close()

    @pytest.mark.usefixtures("toy")
    async def test_the_service_runs_on_it(self, start: StartService) -> None:
        svc = await start(database_url="memory-db://service", demo_records=20)
        assert type(svc.db).__module__ == TOY
        assert (await svc.client.get("/records/user-7")).json()["value"] == "value-7"
        r = await svc.client.put("/records/new", json={"value": "v"}, headers=AUTH)
        assert r.status_code == 201
        assert (await svc.client.get("/records/new")).headers["x-guard"] == "passed"
        asked = svc.db.queries
        r = await svc.client.get("/records/nowhere")
        assert r.status_code == 404 and r.headers["x-guard"] == "blocked"
        assert svc.db.queries == asked  # the filter, fed by the toy's change feed, answered
