"""Running operations on a client: written once, sent by a blocking or an asyncio redis-py client.

An operation (guard/ops.py) does no I/O: it yields rounds of calls and is sent the replies.
``transport`` does everything between that and a client: it sends a lone call by itself and
several in one pipeline, re-sends as EVAL a script a SCRIPT FLUSH unloaded, turns script errors
into the library's exceptions and splits a batch's replies per round. What it yields are the
few sends a client can make (``Send``, ``SendPipeline``, ``Parallel``; a listing's ``Scan``),
and an operation's ``Work``; ``SyncRunner`` and ``AsyncRunner`` make them, with or without
``await`` (Work in a worker thread on asyncio): all that differs between the two flavours.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator, Hashable, Sequence
from functools import cached_property
from typing import Any, NamedTuple, Self, TypeAlias, TypeVar

from redis.exceptions import NoScriptError, ResponseError

from guard import scripts
from guard.ops import Batch, Call, Command, Op, Reads, Round, Work

T = TypeVar("T")


# -- the sends a client makes -------------------------------------------------------------


class Send(NamedTuple):
    """One call by itself (a script through its Script object, which reloads on NOSCRIPT),
    or as EVAL (EVAL_RO) when ``as_eval``: the source travels with it, so it cannot miss."""

    call: Call | Command
    as_eval: bool = False


class SendPipeline(NamedTuple):
    """Calls in one pipeline (a MULTI when ``atomic``); replies with errors in place."""

    calls: Sequence[Call | Command | list[Any]]
    atomic: bool


class Parallel(NamedTuple):
    """Independent transports: concurrently on asyncio, one after another when blocking.
    Answered with each one's result or the exception it raised."""

    parts: list[Generator[Any, Any, Any]]


class Scan(NamedTuple):
    """The keys matching ``match``, by the client's own ``scan_iter``: a cluster's keeps a
    cursor per node, which no one SCAN command can (guard/listing.py)."""

    match: str
    page: int = 1000  # SCAN's COUNT


Transport: TypeAlias = Generator[Send | SendPipeline | Parallel | Scan | Work, Any, T]


def transport(op: Op[T], name: str) -> Transport[T]:
    """Drive ``op``: its rounds become sends, the replies (or errors) go back into it; its
    ``Work`` goes to the runner as it is.

    ``name`` is the filter's, for the exceptions a script's error reply becomes."""
    try:
        request = next(op)
        while True:
            answer: Any
            try:
                if isinstance(request, Round):
                    answer = yield from _round(request, name)
                elif isinstance(request, Work):
                    answer = yield request
                else:
                    answer = yield from _batch(request, name)  # never raises: see Batch
            except Exception as exc:  # goes back into the operation, which may handle it
                request = op.throw(exc)
            else:
                request = op.send(answer)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


def _round(rnd: Round, name: str) -> Transport[list[Any]]:
    if len(rnd.calls) > 1 or rnd.atomic:
        return _raise_first_error((yield from _sent(rnd.calls, rnd.atomic, name)), name)
    call = rnd.calls[0]
    try:
        try:
            return [(yield Send(call))]
        except NoScriptError:  # flushed again between redis-py's reload and its retry
            return [(yield Send(call, as_eval=True))]
    except ResponseError as exc:
        raise scripts.map_error(exc, name) from exc


def _sent(
    calls: Sequence[Call | Command | list[Any]], atomic: bool, name: str
) -> Transport[list[Any]]:
    """``calls`` in one pipeline, each reply or error in its place (a list: a whole command,
    see Reads)."""
    try:
        replies: list[Any] = yield SendPipeline(calls, atomic)
    except ResponseError as exc:
        raise scripts.map_error(exc, name) from exc
    # A SCRIPT FLUSH between the pipeline's script preload and its execution (or a cluster
    # pipeline, which preloads nothing): those calls did nothing, so they alone are sent
    # again, as EVAL.
    for k, reply in enumerate(replies):
        call = calls[k]
        if isinstance(reply, NoScriptError) and not isinstance(call, list):
            try:
                replies[k] = yield Send(call, as_eval=True)
            except ResponseError as exc:
                replies[k] = exc
    return replies


def _batch(batch: Batch, name: str) -> Transport[dict[Any, Any]]:
    """Every round of ``batch``: the plain ones share one pipeline (on a cluster, redis-py
    writes each node's share before reading any reply, so the nodes work in parallel); each
    MULTI goes alone, since a cluster cannot run one across slots. A read that several
    operations send at once (each probing the same handle) goes once. A ``Reads`` joins the
    shared pipeline, its commands answered one by one."""
    same: dict[Any, Any] = {}  # a round's key -> the key of the identical read sent instead
    reads: dict[Hashable, Any] = {}
    alone: list[Any] = []  # MULTIs, in the batch's order
    shared: list[Any] = []
    many: dict[Any, Reads] = {}
    rounds: dict[Any, Round] = {}
    for k, rnd in batch.items():
        if isinstance(rnd, Reads):
            many[k] = rnd
            continue
        rounds[k] = rnd
        if not rnd.atomic:
            shared.append(k)
            continue
        # Probes are MULTIs; a plain read (a lookup's) is not worth comparing.
        if all(isinstance(c, Command) or c.read_only for c in rnd.calls):
            key = tuple(tuple(map(_frozen, c)) for c in rnd.calls)
            if reads.setdefault(key, k) != k:
                same[k] = reads[key]
                continue
        alone.append(k)
    if len(shared) == 1 and not many:  # one plain round goes by itself, where the batch has it
        keys = [k for k in rounds if k not in same]
        alone, shared = keys, []
    parts = [_round(rounds[k], name) for k in alone]
    if shared or many:
        calls: list[Call | Command | list[Any]] = [c for k in shared for c in rounds[k].calls]
        for r in many.values():
            calls += r.commands
        parts.append(_sent(calls, False, name))
    done = yield Parallel(parts)
    answers = dict(zip(alone, done, strict=False))
    if shared or many:
        replies, start = done[-1], 0
        failed = replies if isinstance(replies, Exception) else None
        for k in shared:
            count = len(rounds[k].calls)
            if failed is not None:
                answers[k] = failed
            elif count == 1 and not isinstance(replies[start], Exception):
                answers[k] = [replies[start]]  # a lookup's: nothing to look through
            else:
                try:
                    answers[k] = _raise_first_error(replies[start : start + count], name)
                except Exception as exc:
                    answers[k] = exc
            start += count
        for k, r in many.items():
            count = len(r.commands)
            if failed is not None:
                answers[k] = failed
            else:  # each error as a Round of its own would have raised it
                answers[k] = [
                    _error(r, name) if isinstance(r, Exception) else r
                    for r in replies[start : start + count]
                ]
            start += count
    for k, sent in same.items():
        answer = answers[sent]
        answers[k] = answer if isinstance(answer, Exception) else list(answer)
    return answers


def _frozen(field: Any) -> Hashable:
    return tuple(field) if isinstance(field, list) else field


def _error(reply: Exception, name: str) -> Exception:
    """The exception an error ``reply`` raises: a script's error reply as the library's
    exception, caused by the reply."""
    if not isinstance(reply, ResponseError):
        return reply
    mapped = scripts.map_error(reply, name)
    mapped.__cause__ = reply  # what `raise ... from reply` sets
    return mapped


def _raise_first_error(replies: list[Any], name: str) -> list[Any]:
    for reply in replies:
        if isinstance(reply, Exception):
            raise _error(reply, name)
    return replies


# -- the two client flavours ----------------------------------------------------------------


def _eval_args(call: Call) -> list[Any]:
    command = "EVAL_RO" if call.read_only else "EVAL"
    return [command, scripts.source(call.script), len(call.keys), *call.keys, *call.args]


def _evalsha_args(call: Call, registered: dict[str, Any]) -> list[Any]:
    command = "EVALSHA_RO" if call.read_only else "EVALSHA"
    return [command, registered[call.script].sha, len(call.keys), *call.keys, *call.args]


def _queue(
    calls: Sequence[Call | Command | list[Any]], registered: dict[str, Any], pipe: Any
) -> None:
    """Queue calls on a pipeline (sync or asyncio), as raw commands, without awaiting them.

    For Redis Cluster pipelines (redis-py 8): awaiting what an asyncio ``ClusterPipeline``
    returns re-initializes it and empties its queue, and the sync one refuses its ``evalsha``
    method (not the raw command). A plain pipeline still loads the scripts before it runs; a
    cluster pipeline's NOSCRIPT replies are re-sent as EVAL by ``transport``.
    """
    for call in calls:
        if isinstance(call, list):  # a whole command (Reads)
            pipe.execute_command(*call)
            continue
        if isinstance(call, Command):
            pipe.execute_command(call.name, *call.args)
            continue
        if hasattr(pipe, "scripts"):
            pipe.scripts.add(registered[call.script])
        pipe.execute_command(*_evalsha_args(call, registered))


class _Runner:
    redis: Any
    name: str

    @classmethod
    def on(cls, redis: Any) -> Self:
        """A runner of no one filter's (guard/listing.py)."""
        runner = cls()
        runner.redis, runner.name = redis, ""
        return runner

    @cached_property
    def _scripts(self) -> dict[str, Any]:
        """One Script object per guard script, bound to this handle's client."""
        return scripts.register(self.redis)

    def _target(
        self, send: Send | SendPipeline
    ) -> tuple[Callable[..., Any], list[Any], dict[str, Any]]:
        """What to call for ``send`` (the runner calls it, awaiting it or not), and how."""
        client = self.redis
        if isinstance(send, SendPipeline):
            pipe = client.pipeline(transaction=send.atomic)
            _queue(send.calls, self._scripts, pipe)
            return pipe.execute, [], {"raise_on_error": False}
        call = send.call
        if isinstance(call, Command):
            return client.execute_command, [call.name, *call.args], {}
        if send.as_eval:
            return client.execute_command, _eval_args(call), {}
        if call.read_only:
            return client.execute_command, _evalsha_args(call, self._scripts), {}
        kwargs = {"keys": call.keys, "args": call.args, "client": client}
        return self._scripts[call.script], [], kwargs


class SyncRunner(_Runner):
    """Sends over a blocking ``redis.Redis`` or ``redis.cluster.RedisCluster``."""

    def _run(self, op: Op[T]) -> T:
        return self._drive(transport(op, self.name))

    def _drive(self, io: Transport[T]) -> T:
        try:
            send = next(io)
            while True:
                try:
                    reply = self._send(send)
                except Exception as exc:
                    send = io.throw(exc)
                else:
                    send = io.send(reply)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]

    def _send(self, send: Send | SendPipeline | Parallel | Scan | Work) -> Any:
        if isinstance(send, Work):
            if send.awaits:
                raise TypeError("a blocking handle reads no async iterable: use the asyncio one")
            return send.call()
        if isinstance(send, Scan):
            return list(self.redis.scan_iter(match=send.match, count=send.page))
        if not isinstance(send, Parallel):
            function, args, kwargs = self._target(send)
            return function(*args, **kwargs)
        out: list[Any] = []
        for part in send.parts:
            try:
                out.append(self._drive(part))
            except Exception as exc:
                out.append(exc)
        return out


class AsyncRunner(_Runner):
    """Sends over ``redis.asyncio.Redis`` or its ``RedisCluster``."""

    async def _run(self, op: Op[T]) -> T:
        return await self._drive(transport(op, self.name))

    async def _drive(self, io: Transport[T]) -> T:
        try:
            send = next(io)
            while True:
                try:
                    reply = await self._send(send)
                except Exception as exc:
                    send = io.throw(exc)
                else:
                    send = io.send(reply)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]

    async def _send(self, send: Send | SendPipeline | Parallel | Scan | Work) -> Any:
        if isinstance(send, Work):
            return await (send.call() if send.awaits else asyncio.to_thread(send.call))
        if isinstance(send, Parallel):
            return await asyncio.gather(
                *(self._drive(p) for p in send.parts), return_exceptions=True
            )
        if isinstance(send, Scan):
            return [k async for k in self.redis.scan_iter(match=send.match, count=send.page)]
        if isinstance(send, SendPipeline) and send.atomic:
            # redis-py 8: a MULTI as an asyncio RedisCluster's first command sets up its
            # connections outside the running loop, breaking every later call. Plain
            # clients and set-up clusters return at once.
            await self.redis.initialize()
        function, args, kwargs = self._target(send)
        return await function(*args, **kwargs)
