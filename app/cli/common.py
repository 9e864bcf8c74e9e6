"""What every command shares: the Typer app, its Redis options, and one-line errors."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError
from redis.exceptions import RedisError
from rich.console import Console
from typer.core import TyperGroup

from app.redis_conn import open_sync_redis, redact
from app.settings import (
    MEMORY_URL,
    Settings,
    describe,
    missing_embedded_redis,
    startup_problem,
)
from guard import GuardError

console = Console(soft_wrap=True)  # summaries stay one line (greppable)
err_console = Console(stderr=True)

# A command waits longer than a request would (a load, an export): a reply may take this long.
COMMAND_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 2.0

# Errors a command can meet at run time: each becomes one line on stderr and exit status 1.
EXPECTED = (GuardError, RedisError, OSError, ValueError, RuntimeError)


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if isinstance(exc, GuardError | ValueError) else f"{type(exc).__name__}: {text}"


class GuardGroup(TyperGroup):
    """Turns expected failures into `error: <one line>` and exit status 1 (no traceback)."""

    def invoke(self, ctx: Any) -> Any:  # typer vendors click: its Context type is private
        try:
            return super().invoke(ctx)
        except (typer.Exit, typer.Abort):  # --help, prompts: RuntimeErrors of Typer's own
            raise
        except EXPECTED as exc:
            message = describe(exc) if isinstance(exc, ValidationError) else one_line(exc)
            err_console.print(f"error: {message}", markup=False, highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None


cli = typer.Typer(
    cls=GuardGroup,
    name="guard",
    help="cuckoo-guard: cuckoo filters in Redis, and a service that stops requests for absent "
    "keys before they reach the database.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

# Set by the global --verbose option: every command then names the Redis it uses on stderr.
verbose = False


@cli.callback()
def _global_options(
    be_verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Say on stderr which Redis a command uses.")
    ] = False,
) -> None:
    global verbose
    verbose = be_verbose


RedisUrl = Annotated[
    str | None,
    typer.Option(
        "--redis-url",
        envvar="GUARD_REDIS_URL",
        show_envvar=True,
        help='Redis URL; "" = the embedded redis-server (GUARD_EMBEDDED_REDIS_FILE), '
        '"memory://" = in-process fakeredis.',
    ),
]
Prefix = Annotated[
    str | None,
    typer.Option(
        "--prefix", envvar="GUARD_KEY_PREFIX", show_envvar=True, help="Prefix of every key."
    ),
]


def settings(**overrides: Any) -> Settings:
    """GUARD_* settings from the environment, with the options given on the command line."""
    given = {k: v for k, v in overrides.items() if v is not None}
    return Settings(**given)


def check_startup(cfg: Settings) -> None:
    """Refuse settings the service would refuse, in one line, before starting anything."""
    problem = startup_problem(cfg)
    if problem:
        raise ValueError(problem)


def describe_redis(cfg: Settings) -> str:
    """Which Redis ``cfg`` reaches, for people (a password in the URL is hidden)."""
    if cfg.redis_url == MEMORY_URL:
        return "in-process fakeredis (memory://, nothing kept)"
    if cfg.redis_url:
        return redact(cfg.redis_url)
    return f"embedded redis-server, data in {Path(cfg.embedded_redis_file).resolve()}"


@contextmanager
def sync_redis(cfg: Settings) -> Iterator[Any]:
    """A blocking client of ``cfg``'s Redis, opened as the service opens its own
    (app/redis_conn.py: a cluster from its URL, no command re-sent after a timeout), with a
    command's patience (COMMAND_TIMEOUT_S per reply)."""
    missing = missing_embedded_redis(cfg)
    if missing:
        raise GuardError(missing)
    if verbose:
        err_console.print(f"redis: {describe_redis(cfg)}", markup=False, highlight=False)
    timeouts = {
        "socket_timeout": COMMAND_TIMEOUT_S,
        "socket_connect_timeout": max(cfg.redis_timeout, CONNECT_TIMEOUT_S),
    }
    with open_sync_redis(cfg, **timeouts) as client:
        client.ping()
        yield client


def refuse_records_filter(cfg: Settings, name: str, force: bool) -> None:
    if name == cfg.records_filter and not force:
        raise GuardError(
            f"filter {name!r} follows the service's records table (GUARD_RECORDS_FILTER); "
            "changing it by hand breaks that bookkeeping: rebuild it with "
            "POST /filters/{name}/rebuild, or pass --force"
        )


def fail(message: str) -> None:
    err_console.print(f"error: {message}", markup=False, highlight=False, soft_wrap=True)
    sys.exit(1)
