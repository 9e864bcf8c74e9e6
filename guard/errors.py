"""The library's exceptions: one base class, one subclass per thing a caller may handle."""

from __future__ import annotations

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

# Redis did not answer (refused, dropped, timed out): not the guard's own errors, but every
# caller that has to tell "Redis is away" from "Redis said no" catches this tuple.
RedisUnreachable = (RedisConnectionError, RedisTimeoutError, OSError)


class GuardError(Exception):
    """Base class of every error the guard library raises on purpose."""


class InvalidParameterError(GuardError, ValueError):
    """A parameter is out of range; raised before anything is written."""


class FilterNotFoundError(GuardError):
    """The filter's key does not exist: never read as "absent"."""


class FilterExistsError(GuardError):
    """reserve() on a name that already holds a filter."""


class FilterFullError(GuardError):
    """A fixed-size filter (or one at its growth limit) has no room for an item.

    ``results`` tells, item by item, which ones of the batch were added before the failure.
    """

    def __init__(self, message: str, results: list[bool] | None = None) -> None:
        super().__init__(message)
        self.results: list[bool] = results if results is not None else []


class FilterCorruptError(GuardError):
    """The stored filter's bytes are inconsistent (docs/format.md, "Valid values").

    The message reads ``"<filter>: <reason>"``; ``filter`` and ``reason`` hold the two parts.
    """

    def __init__(self, filter: str, reason: str | None = None) -> None:
        if reason is None:  # one preformatted "<filter>: <reason>" message
            filter, _, reason = filter.partition(": ")
        super().__init__(f"{filter}: {reason}")
        self.filter = filter
        self.reason = reason


class ChangeSourceError(GuardError):
    """The filter follows another change log than the one given: it was built from another
    database (or another install of the change feed). Rebuild it from this one.

    ``stored`` is the change log identity the filter holds, ``given`` the caller's.
    """

    def __init__(self, filter: str, stored: int, given: int) -> None:
        super().__init__(
            f"{filter}: the filter follows change log {stored:#x}, not {given:#x}; rebuild it"
        )
        self.filter = filter
        self.stored = stored
        self.given = given
