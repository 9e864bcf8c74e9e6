"""FilterParams: what ``reserve()`` takes, with its defaults, limits and rules in one place.

The service's request schema and the CLI's ``create`` options are made from ``FIELDS`` (their
defaults, limits and help), and every caller's values are checked here, so a limit changed
here is the one all of them enforce and document.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any, NamedTuple

from guard import layout
from guard.errors import InvalidParameterError
from guard.layout import Layout

# error_rate and fingerprint_bits both size the fingerprints: a filter takes one or neither.
EITHER = ("error_rate", "fingerprint_bits")
DEFAULT_FP_BITS = 16


class Limit(NamedTuple):
    """The values one parameter accepts: ``low``..``high`` (exclusive where ``open``), or one
    of ``choices``. ``integer``: whole numbers only (a bool is not one)."""

    low: float = 0
    high: float = 0
    integer: bool = True
    choices: tuple[int, ...] = ()
    open: bool = False  # both bounds exclusive

    def check(self, name: str, value: object) -> None:
        if not self.accepts(value):
            limit = self.describe()
            raise InvalidParameterError(
                f"{name} must be {limit}, got {value!r}", param=name, limit=limit, value=value
            )

    def accepts(self, value: object) -> bool:
        kinds = int if self.integer else int | float
        if isinstance(value, bool) or not isinstance(value, kinds):
            return False
        if self.choices:
            return value in self.choices
        if self.open:
            return self.low < value < self.high
        return self.low <= value <= self.high

    def describe(self) -> str:
        if self.choices:
            return f"one of {self.choices}"
        if self.open:
            return f"between {self.low:g} and {self.high:g}, exclusive"
        return f"an integer from {self.low:.0f} to {self.high:.0f}"


class Spec(NamedTuple):
    """A parameter as the service and the CLI present it: its limit and what it means."""

    limit: Limit
    help: str


def _param(limit: Limit, help: str, default: Any = MISSING) -> Any:
    return field(default=default, metadata={"spec": Spec(limit, help)})


@dataclass(frozen=True, kw_only=True)
class FilterParams:
    """A filter's parameters, checked when made (``InvalidParameterError`` names the one at
    fault). ``layout()`` sizes the filter they describe."""

    capacity: int = _param(Limit(1, layout.MAX_CAPACITY), "Items the filter must hold")
    error_rate: float | None = _param(
        Limit(0, 1, integer=False, open=True), "Target false-positive rate", None
    )
    fingerprint_bits: int | None = _param(
        Limit(layout.MIN_FP_BITS, layout.MAX_FP_BITS),
        f"Fingerprint width, instead of error_rate (default {DEFAULT_FP_BITS})",
        None,
    )
    bucket_size: int = _param(Limit(choices=layout.BUCKET_SIZES), "Slots per bucket", 4)
    max_kicks: int = _param(
        Limit(0, layout.MAX_KICKS_LIMIT), "Relocations before an insert fails", 500
    )
    expansion: int = _param(
        Limit(0, layout.MAX_EXPANSION), "Growth factor when full; 0 = fixed size", 2
    )
    seed: int | None = _param(Limit(0, 2**32 - 1), "Hash seed (random by default)", None)

    def __post_init__(self) -> None:
        for name, spec in FIELDS.items():
            value = getattr(self, name)
            if value is not None or DEFAULTS.get(name, MISSING) is not None:
                spec.limit.check(name, value)
        if self.error_rate is not None and self.fingerprint_bits is not None:
            raise InvalidParameterError(
                "give error_rate or fingerprint_bits, not both", param="fingerprint_bits"
            )
        if self.error_rate is not None and self.fp_bits > layout.MAX_FP_BITS:
            lowest = min_error_rate(self.bucket_size, self.expansion > 0)
            raise InvalidParameterError(
                f"error_rate {self.error_rate} needs {self.fp_bits}-bit fingerprints; "
                f"the limit is {layout.MAX_FP_BITS}",
                param="error_rate",
                limit=f"at least {lowest:g} with bucket_size {self.bucket_size}"
                f" and expansion {self.expansion}",
                value=self.error_rate,
            )

    @classmethod
    def of(cls, capacity: int | FilterParams, **options: Any) -> FilterParams:
        """``reserve()``'s arguments: a capacity and options, or FilterParams (and changes)."""
        # A misspelt option used to be ignored: reserve(100, bucket_sise=2) made bucket size 4.
        if unknown := sorted(set(options) - set(FIELDS)):
            raise InvalidParameterError(
                f"unknown reserve option(s) {', '.join(unknown)}; "
                f"it accepts {', '.join(n for n in FIELDS if n != 'capacity')}",
                param=unknown[0],
            )
        if isinstance(capacity, FilterParams):
            return replace(capacity, **options)
        return cls(capacity=capacity, **options)

    @property
    def fp_bits(self) -> int:
        """Fingerprint width of the first sub-filter."""
        if self.error_rate is None:
            return DEFAULT_FP_BITS if self.fingerprint_bits is None else self.fingerprint_bits
        return layout.fp_bits_for(self.error_rate, self.bucket_size, self.expansion > 0)

    def layout(self) -> Layout:
        """The filter's geometry (a seed drawn now when none was given); no I/O."""
        bits, b = self.fp_bits, self.bucket_size
        # Sized by error rate, a growing filter widens each next sub-filter's prints by a bit.
        step = 1 if self.error_rate is not None and self.expansion > 0 else 0
        seed = secrets.randbits(32) if self.seed is None else self.seed
        buckets = layout.buckets_for(self.capacity, b, bits)
        if layout.string_bytes(buckets, b, bits) > layout.MAX_STRING_BYTES:
            raise InvalidParameterError(
                f"capacity {self.capacity} needs more than one Redis string (512 MB) holds; "
                "lower it or use fewer fingerprint bits",
                param="capacity",
                value=self.capacity,
            )
        return Layout(b, bits, step, self.expansion, 1, self.max_kicks, buckets, seed)


FIELDS: dict[str, Spec] = {f.name: f.metadata["spec"] for f in fields(FilterParams)}
# What an unset option means (capacity has no default: it is always given).
DEFAULTS: dict[str, Any] = {
    f.name: f.default for f in fields(FilterParams) if f.default is not MISSING
}


# Not the filter's shape but where a filter made from a database snapshot stands in the
# database's change log (guard/changes.py): reserve() takes them beside the parameters, 0 for
# a filter that follows no log (guard/changes.py: CHANGE_SOURCE, what apply_changes takes,
# is never 0).
APPLIED = Limit(0, layout.MAX_CHANGE_ID)
SOURCE_OR_NONE = Limit(0, layout.MAX_SOURCE)


def min_error_rate(bucket_size: int, growing: bool) -> float:
    """The lowest error_rate that ``MAX_FP_BITS``-bit fingerprints reach: one full table
    answers a false "maybe" with probability up to 2b / 2^f (layout.fp_bits_for), and a
    growing filter spends one more bit on its series of sub-filters. A power of two, exact."""
    return math.ldexp(2 * bucket_size, (1 if growing else 0) - layout.MAX_FP_BITS)
