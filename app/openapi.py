"""What the OpenAPI schema says: the error answers each route documents, and its input limits.

Limits come from where they are enforced: guard's FilterParams (``param_field``) and the
GUARD_* settings (``document_limits``, applied to the schema of the app those settings made).
A field or parameter marks the setting that bounds it with ``LIMIT_KEY``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, Field

from app.settings import Settings
from guard.params import DEFAULTS, EITHER, FIELDS, Limit, min_error_rate

# ---- response bodies ----------------------------------------------------------------------


class ErrorBody(BaseModel):
    detail: str


class FullBody(BaseModel):
    detail: str
    results: list[bool]


class FieldError(BaseModel):
    loc: list[str | int]
    msg: str
    type: str


class ValidationBody(BaseModel):
    detail: list[FieldError]


Responses = dict[int | str, dict[str, Any]]


def _doc(status: int, model: type[BaseModel], description: str) -> Responses:
    return {status: {"model": model, "description": description}}


UNAUTHORIZED = _doc(401, ErrorBody, "Missing or wrong `Authorization: Bearer <GUARD_API_KEY>`")
NOT_FOUND = _doc(404, ErrorBody, "No such filter")
CONFLICT = _doc(409, ErrorBody, "Conflicts with the current state")
TOO_LARGE = _doc(413, ErrorBody, "Request body over GUARD_MAX_BODY_BYTES")
INVALID = _doc(422, ValidationBody, "Bad input; `loc` names the field, `msg` the limit")
FULL = _doc(507, FullBody, "Fixed-size filter is full; `results` says which items were added")
UNAVAILABLE = _doc(503, ErrorBody, "Redis unreachable; retry after `Retry-After` seconds")
IN_DOUBT = _doc(
    504,
    ErrorBody,
    "Redis did not answer in time: the operation may have taken effect (the message says how"
    " to check; a retry is safe)",
)
DAMAGED = _doc(
    500,
    ErrorBody,
    "The filter's data in Redis is damaged (truncated, overwritten, or a key of another type):"
    " drop it, or rebuild it; retrying does not help",
)
COMMON: Responses = {**INVALID, **UNAVAILABLE, **DAMAGED}
# What every route that changes a filter may answer (an API key, a filter that may be missing
# or managed, a Redis that may not answer in time).
CHANGE: Responses = {**UNAUTHORIZED, **NOT_FOUND, **CONFLICT, **COMMON, **IN_DOUBT}


# ---- filter parameters, from guard's FilterParams -----------------------------------------


def limit_schema(limit: Limit) -> dict[str, Any]:
    """The JSON Schema keywords that say what ``limit`` accepts."""
    if limit.choices:
        return {"enum": list(limit.choices)}
    low, high = (int(limit.low), int(limit.high)) if limit.integer else (limit.low, limit.high)
    if limit.open:
        return {"exclusiveMinimum": low, "exclusiveMaximum": high}
    return {"minimum": low, "maximum": high}


def param_field(name: str, **extra: Any) -> Any:
    """A request-model field for FilterParams' ``name``: its default, help and limit."""
    spec = FIELDS[name]
    default = DEFAULTS.get(name, ...)
    schema = {**limit_schema(spec.limit), **extra}
    return Field(default, description=spec.help, json_schema_extra=schema)


def _when(name: str, value: Any, present: bool = True) -> dict[str, Any]:
    """Schema: field ``name`` is ``value``, counting an absent field as its default."""
    given = {"required": [name], "properties": {name: {"const": value}}}
    if DEFAULTS[name] != value:
        return given
    return {"anyOf": [given, {"not": {"required": [name]}}]}


def reserve_rules() -> dict[str, Any]:
    """The rules between FilterParams' fields: error_rate and fingerprint_bits exclude each
    other, and the lowest error_rate depends on bucket_size and on growth (expansion > 0)."""
    numbers = {"type": "number"}
    both = {"required": list(EITHER), "properties": {k: numbers for k in EITHER}}
    rules: list[dict[str, Any]] = [{"not": both}]
    for b in FIELDS["bucket_size"].limit.choices:
        for growing in (False, True):
            expansion = {"not": _when("expansion", 0)} if growing else _when("expansion", 0)
            rules.append(
                {
                    "if": {"allOf": [_when("bucket_size", b), expansion]},
                    "then": {
                        "properties": {
                            "error_rate": {
                                "anyOf": [
                                    {"type": "null"},
                                    {"type": "number", "minimum": min_error_rate(b, growing)},
                                ]
                            }
                        }
                    },
                }
            )
    return {"allOf": rules}


# ---- limits set by GUARD_* settings -------------------------------------------------------

LIMIT_KEY = "x-guard-limit"  # marks what a setting bounds; replaced by document_limits


def utf8_text(max_bytes: int) -> dict[str, Any]:
    """1 to ``max_bytes`` bytes of UTF-8, as nearly as JSON Schema can say it: ``maxLength``
    counts characters, not bytes. Each branch is a case that always fits (ASCII at one byte a
    character, up to U+07FF at two, anything at four), so every string the schema allows is
    accepted; a string mixing wide and narrow characters may fit without matching one."""
    return {
        "anyOf": [
            {
                "type": "string",
                "minLength": 1,
                "maxLength": max_bytes,
                "pattern": r"^[\x00-\x7f]*$",
            },
            {
                "type": "string",
                "minLength": 1,
                "maxLength": max_bytes // 2,
                "pattern": r"^[\x00-\u07ff]*$",
            },
            {"type": "string", "minLength": 1, "maxLength": max_bytes // 4},
        ],
        "description": f"1-{max_bytes} bytes of UTF-8 (GUARD_MAX_ITEM_BYTES)",
    }


def _limits(settings: Settings) -> dict[str, Callable[[dict[str, Any]], None]]:
    def capacity(schema: dict[str, Any]) -> None:
        schema["maximum"] = min(schema.get("maximum", settings.max_capacity), settings.max_capacity)

    def batch(schema: dict[str, Any]) -> None:
        schema["maxItems"] = settings.max_batch

    def item(schema: dict[str, Any]) -> None:
        schema.pop("type", None)
        schema.update(utf8_text(settings.max_item_bytes))

    return {"max_capacity": capacity, "max_batch": batch, "item": item}


def document_limits(schema: dict[str, Any], settings: Settings) -> dict[str, Any]:
    """Write the limits ``settings`` set into an OpenAPI ``schema`` (in place, and returned):
    each ``LIMIT_KEY`` marker becomes the keywords that state its setting's value."""
    apply = _limits(settings)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            marker = node.pop(LIMIT_KEY, None)
            if marker is not None:
                apply[marker](node)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema
