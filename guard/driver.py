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
from collections.abc import Generator, Sequence
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
        answer = _checked((yield from _sent(rnd.calls, rnd.atomic, name)), name)
        if isinstance(answer, Exception):
            raise answer
        return answer
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
    # pipeline, which preloads nothing): those calls did nothing; they alone go again, as EVAL.
    for k, reply in enumerate(replies):
        call = calls[k]
        if isinstance(reply, NoScriptError) and not isinstance(call, list):
            try:
                replies[k] = yield Send(call, as_eval=True)
            except ResponseError as exc:
                replies[k] = exc
    return replies


def _error(reply: Exception, name: str) -> Exception:
    """The exception an error ``reply`` raises: a script's error reply as the library's
    exception, caused by the reply."""
    if not isinstance(reply, ResponseError):
        return reply
    mapped = scripts.map_error(reply, name)
    mapped.__cause__ = reply  # what `raise ... from reply` sets
    return mapped


def _checked(replies: list[Any], name: str) -> list[Any] | Exception:
    """A round's ``replies``, or the exception its first error reply raises."""
    for reply in replies:
        if isinstance(reply, Exception):
            return _error(reply, name)
    return replies


def _batch(batch: Batch, name: str) -> Transport[dict[Any, Any]]:
    """Every round of ``batch``. The plain ones and a ``Reads`` share one pipeline (on a
    cluster, redis-py writes each node's share before reading any reply, so the nodes work
    in parallel); but one plain round alone goes by itself, in its place. Each MULTI goes
    alone, since a cluster cannot run one across slots; a read-only one that several
    operations send at once (each probing the same handle) goes once."""
    alone: dict[Any, Round] = {}  # MULTIs, in the batch's order
    shared: dict[Any, Round | Reads] = {}
    first: dict[str, Any] = {}  # a read's calls (as text) -> the key of the round sent
    same: dict[Any, Any] = {}  # a round's key -> the key of the identical read sent instead
    for k, rnd in batch.items():
        if isinstance(rnd, Reads) or not rnd.atomic:
            shared[k] = rnd
            continue
        # Probes are MULTIs; a plain read (a lookup's) is not worth comparing.
        if all(isinstance(c, Command) or c.read_only for c in rnd.calls):
            text = repr(rnd.calls)  # equal for equal calls (str, bytes, int, bool fields)
            if first.setdefault(text, k) != k:
                same[k] = first[text]
                continue
        alone[k] = rnd
    if len(shared) == 1 and isinstance(next(iter(shared.values())), Round):
        alone = {k: r for k, r in batch.items() if isinstance(r, Round) and k not in same}
        shared = {}
    parts: list[Transport[Any]] = [_round(rnd, name) for rnd in alone.values()]
    if shared:
        parts.append(_shared(shared, name))
    done = yield Parallel(parts)
    answers = dict(zip(alone, done, strict=False))
    if shared:
        answers.update(done[-1])
    for k, sent in same.items():
        answer = answers[sent]
        answers[k] = answer if isinstance(answer, Exception) else list(answer)
    return answers


def _shared(rounds: dict[Any, Round | Reads], name: str) -> Transport[dict[Any, Any]]:
    """Plain rounds in one pipeline: each one's replies, or the exception it raises alone
    (never raised here). A ``Reads`` has each command answered by its reply or its error."""
    try:
        replies = yield from _sent([c for r in rounds.values() for c in r.calls], False, name)
    except Exception as exc:  # the whole pipeline failed
        return dict.fromkeys(rounds, exc)
    answers: dict[Any, Any] = {}
    start = 0
    for k, rnd in rounds.items():
        got = replies[start : start + len(rnd.calls)]
        start += len(rnd.calls)
        if isinstance(rnd, Reads):  # each error as a Round of its own would have raised it
            answers[k] = [_error(r, name) if isinstance(r, Exception) else r for r in got]
        else:
            answers[k] = _checked(got, name)
    return answers


# -- the two client flavours ----------------------------------------------------------------


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
    def _scripts(self) -> scripts.BoundScripts:
        """The guard scripts' Script objects, bound to this handle's client."""
        return scripts.BoundScripts(self.redis)

    def _call(self, send: Send | SendPipeline) -> Any:
        """The client's reply to ``send``; an awaitable of it on asyncio.

        A pipeline's calls are queued as raw commands, not awaited, for Redis Cluster
        pipelines (redis-py 8): awaiting what an asyncio ``ClusterPipeline`` returns
        re-initializes it and empties its queue, and the sync one refuses its ``evalsha``
        method. A plain pipeline still loads the scripts before it runs; a cluster
        pipeline's NOSCRIPT replies are re-sent as EVAL by ``transport``."""
        client = self.redis
        if isinstance(send, SendPipeline):
            pipe = client.pipeline(transaction=send.atomic)
            for call in send.calls:
                if isinstance(call, list):  # a whole command (Reads)
                    pipe.execute_command(*call)
                elif isinstance(call, Command):
                    pipe.execute_command(call.name, *call.args)
                else:
                    if hasattr(pipe, "scripts"):
                        pipe.scripts.add(self._scripts[call.script])
                    pipe.execute_command(*self._script_args(call))
            return pipe.execute(raise_on_error=False)
        call = send.call
        if isinstance(call, Command):
            return client.execute_command(call.name, *call.args)
        if send.as_eval or call.read_only:
            return client.execute_command(*self._script_args(call, send.as_eval))
        return self._scripts[call.script](keys=call.keys, args=call.args, client=client)

    def _script_args(self, call: Call, as_eval: bool = False) -> list[Any]:
        """EVALSHA running ``call``, or EVAL with the script's source when ``as_eval``; the
        _RO form when the call is read-only."""
        if as_eval:
            head = ["EVAL_RO" if call.read_only else "EVAL", scripts.source(call.script)]
        else:
            head = ["EVALSHA_RO" if call.read_only else "EVALSHA", self._scripts[call.script].sha]
        return [*head, len(call.keys), *call.keys, *call.args]


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
            return self._call(send)
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
        return await self._call(send)
