"""What every command shares: the `guard` group, whose commands are imported when used, the
Redis options and settings, output, and one way to fail: `error: <one line>` on stderr and exit
status 1 (2 for a usage mistake), whatever went wrong.

Nothing heavy is imported here: `guard --help` needs only this module and typer, and
`guard check` only what a lookup needs (app/env.py reads its settings without pydantic).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from importlib import import_module
from typing import TYPE_CHECKING, Annotated, Any, NamedTuple, NoReturn

import typer
from typer._click.exceptions import ClickException, NoArgsIsHelpError, UsageError  # vendored
from typer.core import TyperArgument, TyperGroup

if TYPE_CHECKING:
    from rich.console import Console

    from app.env import EnvSettings
    from app.settings import Settings

# A command waits longer than a request would (a load, an export): a reply may take this long.
COMMAND_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 2.0


class Command(NamedTuple):
    module: str  # where it is defined (imported when the command is used)
    line: str  # what `guard --help` says of it: one whole sentence


COMMANDS = {
    "serve": Command("app.cli.service", "Run the service (settings: GUARD_* variables)."),
    "demo": Command("app.cli.service", "Show the guard at work: a seeded service, a flood."),
    "attack": Command("app.cli.service", "Flood a running service with random keys."),
    "where": Command("app.cli.service", "Say which Redis, data folder and database are used."),
    "create": Command("app.cli.filters", "Create a filter."),
    "info": Command("app.cli.filters", "Show a filter's size, load and error rate."),
    "list": Command("app.cli.filters", "List the filters under the key prefix."),
    "check": Command("app.cli.filters", "Say whether items are (probably) in a filter."),
    "drop": Command("app.cli.filters", "Delete a filter."),
    "load": Command("app.cli.filters", "Add the items of a text or CSV file to a filter."),
    "export": Command("app.cli.filters", "Dump a filter to a file."),
    "import": Command("app.cli.filters", "Restore a filter from a dump."),
    "follow": Command("app.cli.feed", "Apply the database's change feed to the records filter."),
    "rules": Command("app.cli.rules", "Check a route rules file (GUARD_RULES)."),
}
# How a command line names the settings its options set (an error names what was typed).
OPTIONS = {"redis_url": "--redis-url", "key_prefix": "--prefix"}


class _Argument(TyperArgument):
    """An argument as most tools show one: `guard drop [OPTIONS] NAME`, and `NAME` in its
    help (typer writes `{NAME}`, which reads as a placeholder left unfilled, and its type)."""

    def get_usage_pieces(self, ctx: Any) -> list[str]:
        name = self.make_metavar(ctx) if self.metavar is None else self.metavar
        name = name if self.required else f"[{name}]"
        return [name + ("..." if self.nargs != 1 else "")]

    def display_type_rich(self, ctx: Any) -> str | None:
        return None


def _name(info: Any) -> str:
    """The name a registered command goes by (typer's rule: given, or the function's)."""
    return str(info.name or typer.main.get_command_name(info.callback.__name__))


def _group_name(info: Any) -> str:
    """The name a group added with cli.add_typer() goes by: given there, or its own."""
    given = info.name if isinstance(info.name, str) else None
    return str(given or info.typer_instance.info.name)


def ours(name: str, command: Any) -> Any:
    """``command`` as `guard` shows it: its line from COMMANDS, its arguments our way."""
    command.short_help = COMMANDS[name].line
    for param in command.params:
        if type(param) is TyperArgument:  # typer makes them: shown our way from here on
            param.__class__ = _Argument
    return command


class _Commands(dict[str, Any]):
    """The group's commands by name, each module imported when one of its commands is asked
    for: `guard --help` lists them from COMMANDS without importing any."""

    def __missing__(self, name: str) -> Any:
        if name not in COMMANDS:
            raise KeyError(name)
        # Importing the module registers the command on `cli` (@cli.command(), or
        # cli.add_typer() for a group of them): built here, alone.
        import_module(COMMANDS[name].module)
        style: dict[str, Any] = {
            "pretty_exceptions_short": cli.pretty_exceptions_short,
            "rich_markup_mode": cli.rich_markup_mode,
        }
        commands = [i for i in cli.registered_commands if _name(i) == name]
        if commands:
            command = typer.main.get_command_from_info(commands[0], **style)
        else:
            (group,) = [g for g in cli.registered_groups if _group_name(g) == name]
            command = typer.main.get_group_from_info(group, suggest_commands=True, **style)
        self[name] = ours(name, command)
        return command

    def get(self, name: str, default: Any = None) -> Any:  # type: ignore[override]
        try:
            return self[name]
        except KeyError:
            return default

    def keys(self) -> Any:  # what a mistyped command is compared with
        return COMMANDS.keys()


class GuardGroup(TyperGroup):
    """The `guard` group: lazy commands, and every failure as one `error:` line."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.commands = _Commands({n: ours(n, c) for n, c in self.commands.items()})

    def list_commands(self, ctx: Any) -> list[str]:
        return list(COMMANDS)

    def format_commands(self, ctx: Any, formatter: Any) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, command.line) for name, command in COMMANDS.items()])

    def make_context(self, *args: Any, **kwargs: Any) -> Any:  # where `guard --help` prints
        try:
            return super().make_context(*args, **kwargs)
        except BrokenPipeError:
            reader_gone()

    def invoke(self, ctx: Any) -> Any:  # typer vendors click: its Context type is private
        try:
            return super().invoke(ctx)
        except BrokenPipeError:
            reader_gone()
        except (typer.Exit, typer.Abort, ClickException):  # --help, prompts, usage
            raise
        except Exception as exc:
            if expected(exc):
                error(one_line(exc))
            elif verbose:
                raise  # the traceback was asked for
            else:  # a bug: still one line, and how to see where it came from
                error(f"{one_line(exc)} (unexpected: guard --verbose ... shows its traceback)")
            raise typer.Exit(1) from None

    def main(  # type: ignore[override]
        self,
        args: Any = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        """Typer's main, with its errors in our one-line style (click would add the usage
        and a hint on two more lines, "Aborted!" for a declined prompt)."""
        try:
            with stop_on_signals():
                status = super().main(args, prog_name, complete_var, False, **extra)
        except NoArgsIsHelpError as exc:  # `guard` alone: the help, as a usage mistake
            exc.show()
            sys.exit(exc.exit_code)
        except UsageError as exc:
            command = exc.ctx.command_path if exc.ctx else "guard"
            error(f"{one_line(exc.format_message())} (see {command} --help)")
            sys.exit(exc.exit_code)
        except ClickException as exc:
            error(one_line(exc.format_message()))
            sys.exit(exc.exit_code)
        except typer.Abort:
            error("aborted")
            sys.exit(1)
        if not standalone_mode:
            return status
        try:
            sys.stdout.flush()
        except BrokenPipeError:
            reader_gone()
        sys.exit(status if isinstance(status, int) else 0)


def reader_gone(status: int = 0) -> NoReturn:
    """Stdout's reader has gone (`guard list | head -1`): the rest of the output is not
    wanted, which is no failure. Exit with ``status`` (0, or what the command had already
    decided), and write nothing more (not even at exit)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    raise SystemExit(status)


# While > 0, a stopping signal waits (signals_deferred); the ones that came are kept here.
_deferring = 0
_deferred: list[int] = []


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGTERM ends a command as Ctrl-C does, by an exception in the main thread (exit status
    128 + 15), so every `finally` runs: a server, embedded Redis or folder the command made
    does not outlive it. SIGHUP (its terminal closed) is taken as SIGTERM, and reaches uvicorn
    as one while `guard serve` serves. Signals ignored by whoever started us stay ignored."""
    if not hasattr(signal, "SIGHUP"):  # Windows
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        if _deferring:
            _deferred.append(signum)
        elif not stopping:  # a second one must not cut the first one's clean-up short
            stopping.append(signum)
            raise SystemExit(128 + signum)

    stopping: list[int] = []

    def as_term(signum: int, frame: Any) -> None:
        signal.raise_signal(signal.SIGTERM)

    handlers = {signal.SIGTERM: stop, signal.SIGHUP: as_term}
    try:
        before: dict[signal.Signals, Any] = {s: signal.getsignal(s) for s in handlers}
    except ValueError:  # not the main thread: signals are not ours to handle
        yield
        return
    for s, handler in handlers.items():
        if before[s] is signal.SIG_DFL:
            signal.signal(s, handler)
    try:
        yield
    finally:
        for s, handler in before.items():
            if handler is not None:
                signal.signal(s, handler)


@contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold Ctrl-C, SIGTERM and SIGHUP while starting a process, until we hold its handle: it
    is then stopped with the rest. (Blocking the signals instead would block them in the
    child too: a child inherits its parent's signal mask.)"""
    global _deferring
    interrupt = signal.getsignal(signal.SIGINT)
    if interrupt is signal.default_int_handler:
        signal.signal(signal.SIGINT, lambda signum, frame: _deferred.append(signum))
    _deferring += 1
    try:
        yield
    finally:
        _deferring -= 1
        if interrupt is signal.default_int_handler:
            signal.signal(signal.SIGINT, interrupt)
    if not _deferring and _deferred:
        signum = _deferred.pop()
        _deferred.clear()
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)


class Failure(RuntimeError):
    """A failure its message explains in full: printed without its type's name."""


def _raised_by(exc: BaseException, module: str, name: str) -> bool:
    """Whether ``exc`` is a ``module.name``; False, without importing it, if ``module`` was
    never imported (then nothing raised one)."""
    return module in sys.modules and isinstance(exc, getattr(sys.modules[module], name))


def expected(exc: BaseException) -> bool:
    """Whether ``exc`` is a failure a user can act on (one line, no traceback): an OS or
    value error, the library's errors, Redis's."""
    return (
        isinstance(exc, OSError | ValueError | RuntimeError)
        or _raised_by(exc, "guard.errors", "GuardError")
        or _raised_by(exc, "redis.exceptions", "RedisError")
    )


def one_line(exc: BaseException | str) -> str:
    """``exc`` in one line: its message, after its type unless it is ours or a ValueError."""
    if isinstance(exc, str):
        return " ".join(exc.split())
    text = " ".join(str(exc).split()) or type(exc).__name__
    plain = isinstance(exc, ValueError | Failure) or _raised_by(exc, "guard.errors", "GuardError")
    return text if plain else f"{type(exc).__name__}: {text}"


def error(message: str) -> None:
    sys.stderr.write(f"error: {message}\n")


def say(line: str) -> None:
    """One line on stdout, as it is (no markup, no highlighting: greppable)."""
    sys.stdout.write(line + "\n")


@cache
def rich_console() -> Console:
    """Rich, for tables, progress bars and live views (imported when first needed). Off a
    terminal it has no width to fit: rich would cut every table to 80 columns."""
    from rich.console import Console

    class QuietOnBrokenPipe(Console):
        def on_broken_pipe(self) -> None:
            reader_gone()

    out = QuietOnBrokenPipe(soft_wrap=True)
    if not out.is_terminal:
        out.width = 1 << 16  # a table is printed at its natural width
    return out


class _Console:
    """`console.print(...)`: rich_console(), made when first used."""

    def __getattr__(self, name: str) -> Any:
        return getattr(rich_console(), name)


console = _Console()


def on_terminal() -> bool:
    """Whether stdout is a terminal, as rich decides it (TTY_COMPATIBLE=1 or 0 says so)."""
    given = os.environ.get("TTY_COMPATIBLE", "")
    return given == "1" if given in ("0", "1") else sys.stdout.isatty()


class NoProgress:
    """A progress bar that shows nothing: off a terminal a bar is noise in a log (and rich's
    progress module, a tenth of a big load's start-up, is not imported)."""

    def __enter__(self) -> NoProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def add_task(self, *args: Any, **kwargs: Any) -> Any:
        return 0

    def update(self, *args: Any, **kwargs: Any) -> None:
        return None

    def advance(self, *args: Any, **kwargs: Any) -> None:
        return None


def show(renderable: Any) -> None:
    rich_console().print(renderable)


cli = typer.Typer(
    cls=GuardGroup,
    name="guard",
    help="cuckoo-guard: cuckoo filters in Redis, and a service that stops requests for absent "
    "keys before they reach the database.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # click's plain help: whole sentences, flags without types
    context_settings={"help_option_names": ["-h", "--help"]},
)

# Set by the global --verbose option: every command then names the Redis it uses on stderr.
verbose = False


@cli.callback()
def _global_options(
    be_verbose: Annotated[
        bool,
        typer.Option(
            "--verbose",
            "-v",
            help="Say on stderr which Redis a command uses (and where an unexpected error was).",
        ),
    ] = False,
) -> None:
    global verbose
    verbose = be_verbose


RedisUrl = Annotated[
    str | None,
    typer.Option(
        "--redis-url",
        metavar="URL",
        help='Redis to use (default: GUARD_REDIS_URL); "" = the embedded redis-server, '
        '"memory://" = in-process fakeredis.',
    ),
]
Prefix = Annotated[
    str | None,
    typer.Option(
        "--prefix", metavar="PREFIX", help="Prefix of every key (default: GUARD_KEY_PREFIX)."
    ),
]


def settings(**given: Any) -> Settings:
    """Every GUARD_* setting, with the options given on the command line (None: not given)
    over them; a bad one is refused in one line naming it as the user gave it."""
    from pydantic import ValidationError

    from app.settings import Settings, describe

    given = {k: v for k, v in given.items() if v is not None}
    try:
        return Settings(**given)
    except ValidationError as exc:
        names = {field: OPTIONS[field] for field in given if field in OPTIONS}
        raise ValueError(describe(exc, names)) from None


def quick_settings(**given: Any) -> EnvSettings | Settings:
    """The settings a filter command needs (app/env.py), read without pydantic when they
    are plainly valid; otherwise as `settings` reads them (which refuses a bad one)."""
    from app import env

    try:
        return env.read(**{k: v for k, v in given.items() if v is not None})
    except env.NotPlain:
        return settings(**given)


def check_startup(cfg: Settings) -> None:
    """Refuse settings the service would refuse, in one line, before starting anything."""
    from app.settings import startup_problem

    problem = startup_problem(cfg)
    if problem:
        raise ValueError(problem)


def describe_redis(cfg: EnvSettings | Settings) -> str:
    """Which Redis ``cfg`` reaches, for people (a password in the URL is hidden)."""
    from app.env import MEMORY_URL
    from app.redis_conn import redact

    if cfg.redis_url == MEMORY_URL:
        return "in-process fakeredis (memory://, nothing kept)"
    if cfg.redis_url:
        return redact(cfg.redis_url)
    return f"embedded redis-server, data in {os.path.abspath(cfg.embedded_redis_file)}"


@contextmanager
def sync_redis(cfg: EnvSettings | Settings) -> Iterator[Any]:
    """A blocking client of ``cfg``'s Redis, opened as the service opens its own
    (app/redis_conn.py: a cluster from its URL, no command re-sent after a timeout), with a
    command's patience (COMMAND_TIMEOUT_S per reply)."""
    from app.env import missing_embedded_redis
    from app.redis_conn import open_sync_redis

    missing = missing_embedded_redis(cfg)
    if missing:
        raise ValueError(missing)
    if verbose:
        sys.stderr.write(f"redis: {describe_redis(cfg)}\n")
    timeouts = {
        "socket_timeout": COMMAND_TIMEOUT_S,
        "socket_connect_timeout": max(cfg.redis_timeout, CONNECT_TIMEOUT_S),
    }
    with open_sync_redis(cfg, **timeouts) as client:
        client.ping()
        yield client


def refuse_records_filter(cfg: EnvSettings | Settings, name: str, force: bool) -> None:
    if name == cfg.records_filter and not force:
        raise ValueError(
            f"filter {name!r} follows the service's records table (GUARD_RECORDS_FILTER); "
            f"changing it by hand breaks that bookkeeping: rebuild it with "
            f"POST /filters/{name}/rebuild, or pass --force"
        )
