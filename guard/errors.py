"""The library's exceptions: one base class, one subclass per thing a caller may handle, each
carrying what a caller needs as fields (the filter, the parameter and its limit, the results so
far), so nobody has to read them out of the message.
"""

from __future__ import annotations

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

# Redis did not answer (refused, dropped, timed out): not the guard's own errors, but every
# caller that has to tell "Redis is away" from "Redis said no" catches this tuple.
RedisUnreachable = (RedisConnectionError, RedisTimeoutError, OSError)


class GuardError(Exception):
    """Base class of every error the library raises on purpose; ``filter``: the name of the
    filter concerned, when there is one."""

    def __init__(self, message: str = "", *, filter: str | None = None) -> None:
        super().__init__(message)
        self.filter = filter


class InvalidParameterError(GuardError, ValueError):
    """A parameter is out of range; raised before anything is written. ``param``: the one
    at fault (None when no single one is); ``limit``: what it accepts, in words ("an integer
    from 0 to 16"); ``value``: what it was given."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        limit: str | None = None,
        value: object = None,
        filter: str | None = None,
    ) -> None:
        super().__init__(message, filter=filter)
        self.param = param
        self.limit = limit
        self.value = value


class FilterNotFoundError(GuardError):
    """The filter's key does not exist: never read as "absent"."""


class FilterExistsError(GuardError):
    """reserve() on a name that already holds a filter."""


class FilterFullError(GuardError):
    """A fixed-size filter (or one at its growth limit) has no room for an item. ``results``
    tells, item by item, which ones of the batch were added before the failure."""

    def __init__(
        self, message: str, results: list[bool] | None = None, *, filter: str | None = None
    ) -> None:
        super().__init__(message, filter=filter)
        self.results: list[bool] = results if results is not None else []


class StagingBehindError(GuardError):
    """promote(unless_behind=True) refused: the live filter has applied changes of the feed
    they both follow (``live_applied``) that the staging copy has not; bring the copy up to
    there and promote again."""

    def __init__(self, filter: str, live_applied: int) -> None:
        super().__init__(
            f"{filter}: the live filter stands at change {live_applied}, past its staging copy",
            filter=filter,
        )
        self.live_applied = live_applied


class FilterCorruptError(GuardError):
    """The stored filter's bytes are inconsistent (docs/format.md, "Valid values"). The
    message reads ``"<filter>: <reason>"``; ``filter`` and ``reason`` hold the two parts."""

    filter: str

    def __init__(self, filter: str, reason: str | None = None) -> None:
        if reason is None:  # one preformatted "<filter>: <reason>" message
            filter, _, reason = filter.partition(": ")
        super().__init__(f"{filter}: {reason}", filter=filter)
        self.reason = reason


class ChangeSourceError(GuardError):
    """The filter follows another change log than the one given (it was built from another
    database, or install of the change feed): rebuild it. ``stored``: the change log identity
    it holds; ``given``: the caller's."""

    def __init__(self, filter: str, stored: int, given: int) -> None:
        super().__init__(
            f"{filter}: the filter follows change log {stored:#x}, not {given:#x}; rebuild it",
            filter=filter,
        )
        self.stored = stored
        self.given = given
