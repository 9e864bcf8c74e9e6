"""`guard follow`: the change feed's follower as a process of its own (app/feed.py)."""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Annotated

import typer

from app.cli.common import Prefix, RedisUrl, cli, console, settings
from app.db import open_database
from app.feed import NeedsRebuild
from app.metrics import Metrics
from app.records import RebuildInProgress, RecordStore
from app.redis_conn import open_redis
from app.settings import Settings, missing_embedded_redis

log = logging.getLogger("guard.follow")


@cli.command()
def follow(
    once: Annotated[
        bool,
        typer.Option("--once", help="Apply what is committed now, compact the log, and exit."),
    ] = False,
    rebuild: Annotated[
        bool,
        typer.Option(
            "--rebuild/--no-rebuild",
            help="Rebuild the filter from the table when it cannot follow the log (missing, "
            "the log compacted past it, made from another database).",
        ),
    ] = True,
    redis_url: RedisUrl = None,
    prefix: Prefix = None,
) -> None:
    """Apply the database's change log (GUARD_DATABASE_URL) to the records filter, so rows
    written by anyone reach it: for deployments whose service runs with GUARD_FEED=false, or
    none. Runs until stopped; any number of followers may run at once."""
    cfg = settings(redis_url=redis_url, key_prefix=prefix)
    missing = missing_embedded_redis(cfg)
    if missing:
        raise ValueError(missing)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=cfg.log_level, format="%(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(_follow(cfg, once=once, rebuild=rebuild))
    except (KeyboardInterrupt, asyncio.CancelledError):  # Ctrl-C, SIGTERM: a clean stop
        return


async def _follow(cfg: Settings, *, once: bool, rebuild: bool) -> None:
    task = asyncio.current_task()
    if task is not None:  # SIGTERM (a service manager stopping us) ends the run as Ctrl-C does
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    async with open_redis(cfg) as clients:
        db = await open_database(cfg)

        async def repair(why: NeedsRebuild) -> None:
            log.info("rebuilding %s from the table: %s", store.filter.name, why)
            try:
                info = await store.rebuild()
            except RebuildInProgress as exc:
                log.info("%s", exc)
                return
            log.info("rebuilt %s: %d items", store.filter.name, info.items)

        try:
            # The service's record store: the follower also drops what the caches hold of
            # each key it applies, for the services reading them.
            store = RecordStore(
                clients.main, db, cfg, Metrics(), admin=clients.admin,
                on_needs_rebuild=repair if rebuild else None,
            )  # fmt: skip
            follower, cf = store.follower, store.filter
            if once:
                try:
                    applied = await follower.catch_up()
                except NeedsRebuild as exc:
                    if not rebuild:
                        raise
                    await repair(exc)
                    applied = await follower.catch_up()
                deleted = await follower.compact()
                console.print(
                    f"filter {cf.name}: at change {applied}; {deleted} log rows compacted",
                    markup=False,
                    highlight=False,
                )
                return
            console.print(
                f"following the change log into filter {cf.name} (Ctrl-C to stop)",
                markup=False,
                highlight=False,
            )
            await follower.run()
        finally:
            await db.close()
