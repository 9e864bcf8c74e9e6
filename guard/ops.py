"""What every operation is made of, and runs with, before any I/O (guard/driver.py sends it).

An operation is a generator: it yields a ``Round`` of calls, or a ``Batch`` of rounds (one per
shard, or per operation of a pipeline), and is sent the replies back; a round that failed is
thrown back into it. A bulk build also yields ``Work``: what its runner does without Redis.
The limits here bound what one call may cost the server.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator, Hashable, Mapping
from typing import Any, NamedTuple, TypeAlias, TypeVar, cast

from guard import layout
from guard.errors import FilterCorruptError

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)

# What one script call may cost Redis: none should hold it longer than about 5 ms (issue 15),
# however full the filter. Measured by `python -m bench mutations` (docs/bench-mutations.md):
# one kick step costs about 2 us of server CPU, an item about 7 us besides its kicks (a
# delete or count about 7 us), on the reference machine under load.
BATCH_CHUNK = 300  # items per count/delete script call: about 2 ms
INSERT_CHUNK = 512  # items per insert/apply call at most (below: insert_chunk)
# Work one insert or apply call may do, in kick steps (about 2 ms): counting each item's kick
# steps plus ITEM_WORK for the rest of its cost, the script takes its next item only while
# the work so far plus that item's reserve (ITEM_WORK and its max_kicks, or RESERVE_MAX if
# less) still fits, and answers for the items it took; the client sends the rest again
# (guard/lua/_add.lua). So a call does at most KICK_BUDGET steps when max_kicks is at most
# RESERVE_MAX (the default 500 is), else RESERVE_MAX plus one item's chain: a filter with long
# chains still takes batches at a low load. The first item always goes: one chain of
# max_kicks steps (at most 4000, about 5 ms) is the least a call can be cut to.
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


# Rounds sent together, by key; the answer maps each key to its replies or to the exception
# its round raised (a batch never throws: each round's failure is its own).
Batch: TypeAlias = dict[Any, Round]
Op: TypeAlias = Generator[Round | Batch | Work, Any, T]


# -- running several operations together ---------------------------------------------------


def lockstep(
    ops: Mapping[K, Op[Any]], check: Callable[[K], BaseException | None] | None = None
) -> Op[dict[K, Any]]:
    """Run ``ops`` side by side: each step's rounds go out as one batch, so N operations
    cost the round trips of the longest, not the sum. Returns each one's result, or the
    exception it raised (one failing does not stop the others).

    ``check(key)``, after each step of an operation, may stop it with an exception of its
    own (a sharded filter stops a shard whose routing went stale before anything is sent).
    """
    # One loop, no helper per step: a pipeline of single lookups runs it once per item, and
    # every Python call here is a share of what the library adds to each lookup.
    results: dict[K, Any] = {}
    answers: dict[K, Any] = dict.fromkeys(ops)  # None: not started (send(None) starts it)
    while answers:
        pending: dict[K, Round | Batch] = {}
        batches = False  # whether some operation asks for a Batch, not a Round
        for key, answer in answers.items():
            op = ops[key]
            try:
                throw = isinstance(answer, BaseException)
                request = op.throw(answer) if throw else op.send(answer)
            except StopIteration as done:
                results[key] = done.value
                continue
            except Exception as exc:
                results[key] = exc
                continue
            if isinstance(request, Work):
                # A bulk build writes with plain commands, which a batch takes for reads (and
                # sends once when several operations send the same): it runs by itself.
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
        if not batches:
            # Rounds only (a pipeline of single-item calls): they go by the operations' keys.
            answers = yield cast("Batch", pending)
            continue
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
    return results


def forgets_on_damage(make_op: Callable[..., Op[T]]) -> Callable[..., Op[T]]:
    """An operation that meets damage leaves its handle with no layout: the bytes no longer
    back the one it had, and the next call must verify the filter again, not trust it."""

    @functools.wraps(make_op)
    def op(self: Any, *args: Any, **kwargs: Any) -> Op[T]:
        try:
            return (yield from make_op(self, *args, **kwargs))
        except FilterCorruptError:
            self._layout = layout.UNKNOWN_LAYOUT
            raise

    return op
