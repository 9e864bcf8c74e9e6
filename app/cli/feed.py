"""`guard follow`: the change feed's follower as a process of its own (app/feed.py)."""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Annotated

import typer

from app.cli.common import Prefix, RedisUrl, cli, console, settings
from app.db import open_database
from app.feed import FeedState, Follower, NeedsRebuild
from app.rebuild import Rebuild, RebuildInProgress
from app.redis_conn import open_redis
from app.settings import Settings, missing_embedded_redis
from guard import CuckooFilter

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
        try:
            state = FeedState()
            rebuilder = Rebuild(clients.admin, db, cfg, state)
            cf = CuckooFilter(clients.main, cfg.records_filter, prefix=cfg.key_prefix)

            async def repair(why: NeedsRebuild) -> None:
                log.info("rebuilding %s from the table: %s", cf.name, why)
                try:
                    info = await rebuilder.run()
                except RebuildInProgress as exc:
                    log.info("%s", exc)
                    return
                log.info("rebuilt %s: %d items", cf.name, info.items)

            follower = Follower(
                cf, db, cfg, state, rebuilder.pinned, on_needs_rebuild=repair if rebuild else None
            )
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
