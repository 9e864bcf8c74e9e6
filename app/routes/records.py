"""The guarded resource: records in the backing database, behind the guard middleware."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from app import openapi
from app.deps import Auth, ItemPath, RecordsDep, SettingsDep, check_item
from app.errors import finite_json
from app.routing import CheckedRoute

router = APIRouter(prefix="/records", tags=["records"], route_class=CheckedRoute)

NOT_FOUND: openapi.Responses = {404: {"model": openapi.ErrorBody, "description": "No such record"}}


class RecordIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    value: Any = Field(description="Any JSON value (numbers finite: no NaN or Infinity)")

    @field_validator("value")
    @classmethod
    def _finite(cls, value: Any) -> Any:
        # Python's json module reads NaN and Infinity, but they are not JSON: the stored row
        # could not be answered with. Rejected here, before anything is written.
        if not finite_json(value):
            raise ValueError("numbers must be finite (no NaN, Infinity or -Infinity)")
        return value


class RecordOut(BaseModel):
    key: str
    value: Any


@router.head("/{key}", include_in_schema=False)  # HEAD is guarded too
@router.get(
    "/{key}",
    response_model=RecordOut,
    responses={
        **NOT_FOUND,
        **openapi.INVALID,
        503: {"model": openapi.ErrorBody, "description": "Guard filter unavailable (fail closed)"},
    },
)
async def get_record(
    key: ItemPath, request: Request, records: RecordsDep, settings: SettingsDep
) -> Any:
    """A record. The guard middleware answers 404 (`X-Guard: blocked`) for keys the filter has
    never seen, before the database is asked."""
    check_item(key, settings, ("path", "key"))
    suspect = request.scope.get("guard.decision") == "passed"
    found, value = await records.get(key, suspect=suspect)
    if not found:
        return JSONResponse({"detail": "Not Found"}, status_code=404)
    return {"key": key, "value": value}


@router.put(
    "/{key}",
    response_model=RecordOut,
    status_code=201,
    dependencies=[Auth],
    responses={
        200: {"model": RecordOut, "description": "Replaced an existing record"},
        **openapi.UNAUTHORIZED,
        **openapi.TOO_LARGE,
        **openapi.FULL,
        **openapi.COMMON,
    },
)
async def put_record(
    key: ItemPath, body: RecordIn, records: RecordsDep, settings: SettingsDep
) -> Any:
    """Create (201) or replace (200) a record; the answer is the row as stored. A new key is
    in the filter when this answers (the write waits for its change to come through the
    change feed). A value with a non-finite number (NaN, Infinity) is refused with 422
    before anything is written."""
    check_item(key, settings, ("path", "key"))
    created, stored = await records.put(key, body.value)
    return JSONResponse({"key": key, "value": stored}, status_code=201 if created else 200)


@router.delete(
    "/{key}",
    status_code=204,
    dependencies=[Auth],
    responses={**NOT_FOUND, **openapi.UNAUTHORIZED, **openapi.COMMON},
)
async def delete_record(key: ItemPath, records: RecordsDep, settings: SettingsDep) -> Response:
    """Delete a record; its key leaves the filter only once the database deleted a row."""
    check_item(key, settings, ("path", "key"))
    if not await records.delete(key):
        return JSONResponse({"detail": "Not Found"}, status_code=404)
    return Response(status_code=204)
