"""What every operation is made of, and runs with, before any I/O (guard/driver.py sends it).

An operation is a generator: it yields a ``Round`` of calls, or a ``Batch`` of rounds (one per
shard, or per operation of a pipeline), and is sent the replies back; a round that failed is
thrown back into it. A bulk build also yields ``Work``: what its runner does without Redis.
The limits here bound what one call may cost the server.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator, Hashable, Iterable, Mapping
from types import GeneratorType
from typing import Any, NamedTuple, TypeAlias, TypeVar, cast

from guard import layout
from guard.errors import FilterCorruptError

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)

# No script call should hold Redis longer than about 5 ms (issue 15), however full the filter.
# `python -m bench mutations` (docs/bench-mutations.md) measured on the reference machine under
# load: a kick step costs about 2 us of server CPU, an item about 7 us besides its kicks.
BATCH_CHUNK = 300  # items per count/delete script call: about 2 ms
INSERT_CHUNK = 512  # items per insert/apply call at most (below: insert_chunk)
# An insert or apply call's work, in kick steps (about 2 ms). Counting ITEM_WORK per item plus
# its kick steps, the script takes its next item only while that item's reserve (ITEM_WORK +
# min(max_kicks, RESERVE_MAX)) still fits what is left; the client sends the rest again
# (guard/lua/_add.lua). So a call does at most KICK_BUDGET steps when max_kicks <= RESERVE_MAX
# (the default 500 is), else RESERVE_MAX plus one chain, so long chains still take batches at a
# low load. The first item always goes: one chain (max_kicks <= 4000, about 5 ms) is the floor.
KICK_BUDGET = 1000
RESERVE_MAX = KICK_BUDGET // 2
ITEM_WORK = 4  # an item's cost besides its kicks, in kick steps


def insert_chunk(max_kicks: int) -> int:
    """Items per insert/apply call: what the script takes when no item kicks (sending more
    would only send their arguments twice)."""
    return max(1, min(INSERT_CHUNK, (KICK_BUDGET - min(max_kicks, RESERVE_MAX)) // ITEM_WORK))


MAX_RETRIES = 8  # times an operation reads a layout that keeps changing before it gives up


class Call(NamedTuple):
    """One EVALSHA of a guard script; EVALSHA_RO when ``read_only`` (it runs on a replica)."""

    script: str
    keys: list[str]
    args: list[Any]
    read_only: bool = False


class Command(NamedTuple):
    """One plain Redis command (the script-free reads)."""

    name: str
    args: list[Any]


class Round(NamedTuple):
    """What an operation sends at once: one pipeline, a MULTI when ``atomic``."""

    calls: list[Call | Command]
    atomic: bool = False


_tuple_new = tuple.__new__


def one_command(name: str, args: list[Any]) -> Round:
    """``Round([Command(name, args)])``, made without NamedTuple's Python-level ``__new__``:
    the two constructors cost a single lookup a quarter of its own Python time."""
    return _tuple_new(Round, ([_tuple_new(Command, (name, args))], False))


class Work(NamedTuple):
    """Work without Redis that an operation hands its runner: ``call()``, CPU-heavy (a bulk
    build's hashing and placement, guard/bulk.py) or reading the caller's input. A blocking
    runner calls it; an asyncio runner calls it in a worker thread, off the event loop, or,
    when ``awaits`` (the next batch of an async iterable), awaits what it returns."""

    call: Callable[[], Any]
    awaits: bool = False


class Reads(NamedTuple):
    """Plain commands, each whole (its name first), sent with a batch's other plain rounds
    and each answered by its reply or the exception it met (never raised): ``lockstep``'s
    ``OneCommand`` operations, with no Round or Command each."""

    calls: list[list[Any]]


# Rounds sent together, by key; the answer maps each key to its replies or to the exception
# its round raised (a batch never throws: each round's failure is its own).
Batch: TypeAlias = dict[Any, Round | Reads]
Op: TypeAlias = Generator[Round | Batch | Work, Any, T]
MakeOp = TypeVar("MakeOp", bound=Callable[..., Op[Any]])


class OneCommand:
    """An operation that, when all goes as expected, is one plain command and a look at its
    reply (a single lookup queued in a pipeline, guard/filter.py). ``lockstep`` runs it with
    no generator, Round or Command: those, one each per item alive until the replies came,
    made the garbage collector run in every pipeline of 100. ``start`` and ``finish`` may
    hand over to an operation (a generator, not started) that goes on from there."""

    __slots__ = ()

    def start(self) -> list[Any] | Op[Any]:
        """The command, its name first; or the operation to run instead."""
        raise NotImplementedError

    def finish(self, reply: Any) -> Any:
        """The result, from the command's reply or the exception it met (which it raises,
        or handles); or the operation to go on with instead."""
        raise NotImplementedError


def run_one(op: OneCommand) -> Op[Any]:
    """``op`` run alone, as an operation: what ``lockstep`` does with it, with one command."""
    started = op.start()
    if not isinstance(started, list):
        return (yield from started)
    try:
        (reply,) = yield one_command(started[0], started[1:])
    except Exception as exc:  # finish raises it, or handles it (a refused BITFIELD_RO)
        reply = exc
    result = op.finish(reply)
    if isinstance(result, GeneratorType):
        return (yield from result)
    return result


_READS = object()  # the key of a step's Reads in its batch: equal to no caller's key


# -- running several operations together ---------------------------------------------------


def lockstep(
    ops: Mapping[K, Op[Any] | OneCommand],
    check: Callable[[K], BaseException | None] | None = None,
) -> Op[dict[K, Any]]:
    """Run ``ops`` side by side: each step's rounds go out as one batch, so N operations
    cost the round trips of the longest, not the sum. Returns each one's result, or the
    exception it raised (one failing does not stop the others). ``check(key)``, after each
    step of an operation, may stop it with an exception of its own (a sharded filter stops a
    shard whose routing went stale before anything is sent).

    A ``OneCommand`` runs without a generator until it hands over to one. Several alone in a
    step go as one ``Reads``; else each goes as a Round in its place, in the operations' order.
    """
    # One loop, no helper per step: a pipeline of single lookups runs it once per item, and
    # every Python call here adds to each lookup's cost.
    results: dict[K, Any] = {}
    running: dict[K, Any] = dict(ops)  # a OneCommand until it finishes or hands over
    answers: dict[K, Any] = dict.fromkeys(ops)  # None: not started (send(None) starts it)
    while answers:
        pending: dict[Any, Any] = {}  # a Round or Batch; a OneCommand's command (a list)
        batches = False  # whether some operation asks for a Batch, not a Round
        readers: dict[K, OneCommand] = {}  # the OneCommands whose command is in pending
        for key, answer in answers.items():
            op = running[key]
            if answer is None and isinstance(op, OneCommand):
                try:
                    started = op.start()
                except Exception as exc:
                    results[key] = exc
                    continue
                if isinstance(started, list):
                    stop = check(key) if check is not None else None
                    if stop is not None:
                        results[key] = stop
                        continue
                    readers[key] = op
                    pending[key] = started
                    continue
                running[key] = op = started  # handed over before its command: runs now
            try:
                throw = isinstance(answer, BaseException)
                request = op.throw(answer) if throw else op.send(answer)
            except StopIteration as done:
                results[key] = done.value
                continue
            except Exception as exc:
                results[key] = exc
                continue
            if isinstance(request, Work):  # a bulk build: in a batch, its writes pass for reads
                op.close()
                results[key] = TypeError("bulk_load runs on its handle, not in a pipeline")
                continue
            stop = check(key) if check is not None else None
            if stop is not None:
                op.close()
                results[key] = stop
                continue
            pending[key] = request
            batches = batches or isinstance(request, dict)
        if not pending:
            break
        if readers:
            if len(readers) > 1 and len(readers) == len(pending):  # only OneCommands
                pending = {_READS: Reads(list(pending.values()))}
            else:  # a lone one, or among other rounds: each a Round in its place
                for key in readers:
                    command = pending[key]
                    pending[key] = one_command(command[0], command[1:])
        if not batches:
            # Rounds only (a pipeline of single-item calls): they go by the operations' keys.
            answers = yield pending
        else:
            # Batches too: (key,) for a round, (key, sub) for each round of a batch, so that
            # no key of one can be taken for a key of another.
            batch: Batch = {}
            for key, request in pending.items():
                if isinstance(request, Round):
                    batch[(key,)] = request
                else:
                    batch.update(((key, sub), rnd) for sub, rnd in request.items())
            replies = yield batch
            answers = {
                key: replies[(key,)]
                if isinstance(request, Round)
                else {sub: replies[(key, sub)] for sub in request}
                for key, request in pending.items()
            }
        if readers:
            answers = _finish(readers, answers, results, running)
    return results


def _finish(
    readers: dict[K, OneCommand],
    answers: dict[Any, Any],
    results: dict[K, Any],
    running: dict[K, Any],
) -> dict[Any, Any]:
    """``lockstep``'s OneCommands of one step, given their replies (taken out of ``answers``):
    each one's result, or the operation it hands over to, which starts next step in its place
    among the others. Returns the next step's answers."""
    got = answers.pop(_READS, None)
    if got is None:  # one Round each: [reply], or the exception its round met
        replies = [
            a if isinstance(a := answers.pop(key), BaseException) else a[0] for key in readers
        ]
    else:
        replies = [got] * len(readers) if isinstance(got, BaseException) else got
    handed = False
    for (key, op), reply in zip(readers.items(), replies, strict=True):
        try:
            result = op.finish(reply)
        except Exception as exc:
            results[key] = exc
            continue
        if isinstance(result, GeneratorType):
            running[key] = result
            answers[key] = None  # not started
            handed = True
        else:
            results[key] = result
    if handed:  # the operations' order, as the generators handed over to had kept it
        answers = {key: answers[key] for key in running if key in answers}
    return answers


def raise_first(results: Iterable[Any]) -> None:
    """Raise the first exception among results of operations run side by side, if any."""
    for result in results:
        if isinstance(result, BaseException):
            raise result


def forgets_on_damage(make_op: MakeOp) -> MakeOp:
    """An operation that meets damage leaves its handle with no layout: the bytes no longer
    back the one it had, and the next call must verify the filter again, not trust it."""

    @functools.wraps(make_op)
    def op(self: Any, *args: Any, **kwargs: Any) -> Op[Any]:
        try:
            return (yield from make_op(self, *args, **kwargs))
        except FilterCorruptError:
            self._layout = layout.UNKNOWN_LAYOUT
            raise

    return cast(MakeOp, op)
